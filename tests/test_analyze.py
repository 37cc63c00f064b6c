"""`plait analyze`: interval arithmetic, reading GPU (Kineto) and CPU (gloo) traces, pairing
collectives with their GEMMs, and the command line."""

import gzip
import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.analyze.advice import advise
from plait.analyze.analysis import analyze, detect_hardware
from plait.analyze.exposure import collective_rows, device_exposure
from plait.analyze.kineto import read_trace
from plait.cli.main import app
from plait.intervals import covered_span, intersect, length, uncovered, union
from plait.runtime.engines import all_gather_tensor, reduce_scatter_tensor
from plait.runtime.launch import run_ranks
from plait.spec.hardware import load_hardware
from plait.workload.operators import Axis, CollectiveKind

runner = CliRunner()

spans = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)).map(
    lambda t: (float(t[0]), float(t[0] + t[1]))), max_size=8)


@given(spans, spans)
def test_interval_arithmetic_matches_a_unit_grid(a, b):
    ua, ub = union(a), union(b)
    assert all(s < e for s, e in ua) and all(x[1] < y[0] for x, y in itertools.pairwise(ua))
    grid_a = {t for s, e in a for t in range(int(s), int(e))}
    grid_b = {t for s, e in b for t in range(int(s), int(e))}
    assert length(ua) == len(grid_a)
    assert length(intersect(ua, ub)) == len(grid_a & grid_b)
    left = uncovered(ua, ub)
    assert length(left) == len(grid_a - grid_b)
    assert {t for s, e in left for t in range(int(s), int(e))} == grid_a - grid_b
    for s, e in a:  # one span against many, by bisection
        assert covered_span(s, e, ub) == len(set(range(int(s), int(e))) & grid_b)


M, N, K, P = 8192, 1792, 4096, 8


def _gpu_trace(rank: int = 0, ag_start: float = 0) -> dict:
    """One step on GPU 0 of an 8-GPU H100 node: an all-gather (100 us) feeding its GEMM (200 us),
    a reduce-scatter half hidden by an elementwise kernel, a peer copy, a local copy.
    `ag_start`: when this rank joined the all-gather (all ranks leave it together)."""
    def kernel(name, ts, dur, stream, **args):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
                "dur": dur, "args": {"device": 0, "stream": stream, **args}}

    nccl = {"Group size": P, "dtype": "BFloat16"}
    return {"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": P},
            "traceEvents": [
                {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 9,
                 "tid": 9, "ts": 0, "dur": 600},
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 1,
                 "dur": 5, "args": {"External id": 7, "Input Dims": [[M, K], [K, N]],
                                    "Input type": ["c10::BFloat16", "c10::BFloat16"]}},
                kernel("ncclDevKernel_AllGather_RING_LL", ag_start, 100 - ag_start, 20,
                       **{"Collective name": "_allgather_base", "In msg nelems": M * K // P,
                          "Out msg nelems": M * K}, **nccl),
                kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 100, 200, 7, **{"External id": 7}),
                kernel("vectorized_elementwise_kernel", 300, 50, 7),
                kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 320, 100, 20,
                       **{"Collective name": "reduce_scatter", "In msg nelems": 1000,
                          "Out msg nelems": 125}, **nccl),
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)",
                 "pid": 0, "tid": 21, "ts": 500, "dur": 10, "args": {"device": 0, "bytes": 4096}},
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
                 "pid": 0, "tid": 21, "ts": 520, "dur": 10, "args": {"device": 0, "bytes": 64}},
                # record_function ranges as Kineto projects them onto the GPU
                *({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": 7,
                   "ts": ts, "dur": dur} for name, ts, dur in (("layer0", 0, 320),
                                                                ("layer1", 320, 280))),
            ]}


def test_gpu_trace_exposure_and_pairing(tmp_path):
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_gpu_trace()).encode()))
    t = read_trace(path)
    assert (t.rank, t.world) == (0, P) and detect_hardware(t) == "h100"
    (d,) = t.devices
    assert [c.kind for c in d.comms] == [CollectiveKind.AG, CollectiveKind.RS, CollectiveKind.P2P]
    assert d.comms[0].nbytes == M * K * 2 and d.steps == (3,)
    e = device_exposure(d)
    # comm [0,100] [320,420] [500,510]; compute [100,350]: exposed 100 + 70 + 10; the local
    # copy [520,530] is memory: busy, in the span, neither compute nor communication
    assert (e.span_us, e.comm_us, e.compute_us, e.exposed_us) == (530, 210, 250, 180)
    assert (e.memory_us, e.idle_us) == (10, 530 - 250 - 180 - 10)
    rows = {r.kind: r for r in collective_rows(d, e)}
    assert rows["all_gather"].exposed_us == 100 and rows["reduce_scatter"].exposed_us == 70
    # the reduce-scatter matches no GEMM's output
    (ad,) = advise(d, e.compute, load_hardware("h100"))
    assert ad.pair.direction == "in" and (ad.pair.gemm.m, ad.pair.gemm.n, ad.pair.gemm.k) == (
        M, N, K)
    assert ad.pair.collective.bytes == M * K * 2 and ad.pair.ranks == P
    assert (ad.calls, ad.gemm_us, ad.comm_us, ad.exposed_us) == (1, 200, 100, 100)
    r = ad.report
    assert ad.plait_us == (200 + 100) * r.chosen.time_s / r.sequential.time_s
    assert ad.saving_us == 300 - ad.plait_us > 0
    # by record_function range: the all-gather in layer0, the rest in layer1
    (by,) = analyze([path], None, by="layer").traces
    assert [(r.region, r.count, r.span_us, r.comm_us, r.exposed_us) for r in by.regions] == [
        ("layer0", 1, 320, 100, 100), ("layer1", 1, 280, 110, 80)]


def test_communication_kernels_are_known_by_rule():
    from plait.analyze.rules import BUILT_IN, kind_of, label_of, matching_rule

    for name, rule, kind in (
            ("ncclDevKernel_AllGather_RING_LL", "nccl/rccl", CollectiveKind.AG),
            ("ncclKernel_ReduceScatter_RING_LL_Sum_bf16", "nccl/rccl", CollectiveKind.RS),
            ("rcclGenericKernel_AllReduce", "nccl/rccl", CollectiveKind.AR),
            ("two_shot_all_reduce_kernel<bf16>", "symmetric memory", CollectiveKind.AR),
            ("multimem_all_gather_kernel", "symmetric memory", CollectiveKind.AG),
            ("ncclDevKernel_SendRecv", "nccl/rccl", CollectiveKind.P2P),
            ("void deep_ep::intranode::dispatch<8, 768>(int4*, float*)", "expert parallel",
             CollectiveKind.A2A),
            ("void deep_ep::internode_ll::combine<false, 7168>(void*)", "expert parallel",
             CollectiveKind.A2A),
            ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*)", "expert parallel",
             CollectiveKind.A2A)):
        assert matching_rule(name, BUILT_IN) == rule and kind_of(name) is kind, name
    assert matching_rule("userbuffers_fp16_sum_inplace_gpu_rr_rs", BUILT_IN) == "userbuffers"
    assert matching_rule("void dpsk::ep::internode::cached_notify<false>(int)", BUILT_IN)
    for name in ("sm90_xmma_gemm_bf16", "reduce_kernel<512, 1>", "vectorized_elementwise",
                 "void dpsk::ep::cuda::get_dispatch_layout<256, 32>(long*)"):  # local work
        assert matching_rule(name, BUILT_IN) is None, name
    # what plait has no model of is named, not shown as a raw kernel name
    assert label_of("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long)",
                    None) == "broadcast"
    assert label_of("void ns::my_kernel<8, true>(int*, float)", None) == "ns::my_kernel"


def test_waiting_for_the_last_rank_is_told_apart(tmp_path):
    paths = []
    for rank, joined in ((0, 0), (1, 40)):  # rank 1 joins the all-gather 40 us late
        paths.append(tmp_path / f"rank{rank}.json")
        paths[-1].write_text(json.dumps(_gpu_trace(rank, joined)))
    first, late = analyze(paths, load_hardware("h100")).traces
    waits = [[c.wait for c in t.trace.devices[0].comms] for t in (first, late)]
    assert waits == [[40, 0, 0], [0, 0, 0]]
    assert first.exposure[0].waiting_us == 40 and late.exposure[0].waiting_us == 0
    assert {r.kind: r.waiting_us for r in first.collectives}["all_gather"] == 40
    (ad,) = first.advice
    assert (ad.wait_us, ad.exposed_wait_us) == (40, 40)
    r = ad.report
    assert ad.plait_us == (200 + 100 - 40) * r.chosen.time_s / r.sequential.time_s + 40
    # one rank alone: waiting is unknown, not zero
    (alone,) = analyze(paths[:1], None).traces
    assert alone.exposure[0].waiting_us is None and alone.collectives[0].waiting_us is None


def _profile_gloo(rank, world, path, rows, k, n):
    """A sequence-parallel step on CPU ranks: all-gather -> GEMM, GEMM -> reduce-scatter."""
    from torch.profiler import profile

    x, w = torch.randn(rows, k), torch.randn(k, n)
    gathered = torch.empty(rows * world, k)
    with profile(record_shapes=True) as prof:
        all_gather_tensor(gathered, x)
        y = gathered @ w
        reduce_scatter_tensor(torch.empty(rows, n), y)
    prof.export_chrome_trace(path.format(rank=rank))


def _profile_weight_gradients(rank, world, path, rows, h, n):
    """Weight gradients over gathered tokens: dW = dY^T X (X gathered: B) and X^T dY (A, a
    transposed view)."""
    from torch.profiler import profile

    x, dy = torch.randn(rows, h), torch.randn(rows * world, n)
    gathered = torch.empty(rows * world, h)
    with profile(record_shapes=True) as prof:
        all_gather_tensor(gathered, x)
        torch.mm(dy.t(), gathered)
        all_gather_tensor(gathered, x)
        torch.mm(gathered.t(), dy)
    prof.export_chrome_trace(path.format(rank=rank))


@pytest.mark.slow
def test_weight_gradient_gathers_pair_along_k(tmp_path):
    path = str(tmp_path / "wg{rank}.json")
    run_ranks(2, _profile_weight_gradients, path, 64, 48, 32, timeout_s=60)
    (t,) = analyze([path.format(rank=0)], load_hardware("cpu")).traces
    (ad,) = t.advice  # both forms are one pair: tokens are the reduction K
    p = ad.pair
    assert ad.calls == 2 and p.axis is Axis.K and p.direction == "in"
    assert (p.gemm.m, p.gemm.n, p.gemm.k) == (48, 32, 128) and p.name.endswith("/K")


@pytest.mark.slow
def test_cpu_gloo_trace_is_read_from_gloo_work(tmp_path):
    path = str(tmp_path / "cpu{rank}.json")
    run_ranks(2, _profile_gloo, path, 64, 32, 48, timeout_s=60)
    a = analyze([path.format(rank=0), path.format(rank=1)], load_hardware("cpu"))
    t, other = a.traces
    # per call, the rank that joined last waited for nobody
    for mine, theirs in zip(t.trace.devices[0].comms, other.trace.devices[0].comms, strict=True):
        assert min(mine.wait, theirs.wait) == 0 <= max(mine.wait, theirs.wait)
    (d,) = t.trace.devices
    # gloo runs the reduce-scatter as an all-reduce: the kind comes from the c10d call
    assert [c.kind for c in d.comms] == [CollectiveKind.AG, CollectiveKind.RS]
    assert [c.elems for c in d.comms] == [128 * 32, 128 * 48]
    assert all(c.group == 2 and c.dtype == "fp32" for c in d.comms)
    (e,) = t.exposure
    assert 0 < e.exposed_us <= e.comm_us <= e.span_us
    pairs = {ad.pair.direction: ad.pair for ad in t.advice}
    assert set(pairs) == {"in", "out"}
    assert all((p.gemm.m, p.gemm.n, p.gemm.k) == (128, 48, 32) for p in pairs.values())
    # a trace whose shapes and types are numbers where lists belong: read, not a traceback
    doc = json.loads(Path(path.format(rank=0)).read_text())
    for ev in doc["traceEvents"]:
        if isinstance(ev.get("args"), dict) and "Input type" in ev["args"]:
            ev["args"]["Input type"], ev["args"]["Input Dims"] = 7, 3
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(doc))
    (o,) = analyze([str(odd)], load_hardware("cpu")).traces
    assert [c.kind for c in o.trace.devices[0].comms] == [CollectiveKind.AG, CollectiveKind.RS]


def _profile_plait_copies(rank, world, path):
    """plait's copy engine on CPU: its copier thread's copies, recorded on every thread."""
    from torch.profiler import profile

    from plait import ops
    from plait.runtime.context import close_all
    from plait.tracing import every_thread

    x, w = torch.randn(32, 16), torch.randn(16, 8)
    with profile(record_shapes=True, experimental_config=every_thread()) as prof:
        ops.all_gather_matmul(x, [w], schedule="fine/dma/c2/g1/M")
        ops.all_gather_matmul(x, [w], schedule="seq/sm")  # a whole GEMM after a collective
    prof.export_chrome_trace(path.format(rank=rank))
    close_all()


@pytest.mark.slow
def test_plait_copy_engine_transfers_are_communication(tmp_path):
    path = str(tmp_path / "dma{rank}.json")
    run_ranks(2, _profile_plait_copies, path, timeout_s=60)
    (t, _) = analyze([path.format(rank=0), path.format(rank=1)], load_hardware("cpu")).traces
    copies = [c for c in t.trace.devices[0].comms if c.name.startswith("plait:copy ")]
    assert len(copies) == 2 and all(c.kind is CollectiveKind.P2P for c in copies)  # c = 2
    copier = {c.track for c in copies}
    assert len(copier) == 1 and not any(g.track in copier for g in t.trace.devices[0].compute)
    # the runtime's cross-rank shape check is labelled plait's own, never the user's collective
    own = [c for c in t.trace.devices[0].comms if c.plaits_own]
    assert own and {c.label for c in own} == {"plait: shape check"}
    assert 0 < t.exposure[0].plait_us <= t.exposure[0].comm_us
    # the calls' own ranges are recorded when the profiler follows every thread (whose
    # thread-local state says no profiler): each call graded as the schedule that ran
    assert sorted(g.call.schedule for g in t.graded) == ["fine/dma/c2/g1/M", "seq/sm"]
    # the GEMM pieces plait already schedules are not offered as pairs to schedule; the whole
    # GEMM of its sequential schedule is
    (ad,) = t.advice
    assert ad.calls == 1 and (ad.pair.gemm.m, ad.pair.gemm.n, ad.pair.gemm.k) == (64, 8, 16)


def test_cli_tables_json_trace_and_plot(tmp_path):
    src = tmp_path / "rank0.json"
    src.write_text(json.dumps(_gpu_trace()))
    res = runner.invoke(app, ["analyze", str(src), "--trace", str(tmp_path / "x.json"), "--plot",
                              str(tmp_path / "x.png"), "--json", str(tmp_path / "a.json"),
                              "--by", "layer"])
    assert res.exit_code == 0, res.output
    assert "h100 (detected" in res.output and "ag:8192x1792x4096" in res.output
    doc = json.loads((tmp_path / "a.json").read_text())
    (tr,) = doc["traces"]
    assert tr["devices"][0]["exposed_us"] == 180 and tr["pairs"][0]["calls"] == 1
    assert [r["exposed_us"] for r in tr["regions"]] == [100, 80] and "layer1" in res.output
    assert tr["saving_us"] == tr["pairs"][0]["saving_us"] > 0
    added = [e for e in json.loads((tmp_path / "x.json").read_text())["traceEvents"]
             if e.get("cat") == "plait"]
    assert [(e["ts"], e["dur"]) for e in added] == [(0, 100), (350, 70), (500, 10)]
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
    res = runner.invoke(app, ["analyze", str(src), "-H", "none", "--json", "-"])
    assert res.exit_code == 0 and json.loads(res.output)["traces"][0]["pairs"] == []
    ranks = tmp_path / "ranks"  # a folder of every rank's trace
    ranks.mkdir()
    for r in (0, 1):
        (ranks / f"rank{r}.json").write_text(json.dumps(_gpu_trace(r)))
    res = runner.invoke(app, ["analyze", str(ranks), "-H", "none", "--json", "-"])
    assert res.exit_code == 0 and [t["rank"] for t in json.loads(res.output)["traces"]] == [0, 1]
    res = runner.invoke(app, ["analyze", str(ranks)])  # one table of every rank, then one rank
    assert res.exit_code == 0 and "every rank" in res.output
    assert res.output.count("time per device") == 1 and "--every-rank" in res.output
    res = runner.invoke(app, ["analyze", str(ranks), "--every-rank"])
    assert res.exit_code == 0 and res.output.count("time per device") == 2


def test_cli_bad_traces_exit_2_naming_the_trace(tmp_path):
    res = runner.invoke(app, ["analyze", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "trace: file" in res.output
    res = runner.invoke(app, ["analyze", str(tmp_path)])
    assert res.exit_code == 2 and "holds no .json" in " ".join(res.output.split())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = runner.invoke(app, ["analyze", str(bad)])
    assert res.exit_code == 2 and "not a (gzipped) JSON trace" in " ".join(res.output.split())
    quiet = tmp_path / "quiet.json"
    quiet.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0, "dur": 5}]}))
    res = runner.invoke(app, ["analyze", str(quiet)])
    assert res.exit_code == 2 and "no communication found" in " ".join(res.output.split())


def test_a_trace_written_under_a_gz_name_is_gzip_and_reads_back(tmp_path):
    """`--trace OUT.json.gz` wrote plain JSON under a .gz name, which plait then refused to
    read back; explore's --trace too."""
    import gzip

    src = tmp_path / "rank0.json"
    src.write_text(json.dumps(_gpu_trace()))
    out = tmp_path / "exposed.json.gz"
    res = runner.invoke(app, ["analyze", str(src), "-H", "none", "--trace", str(out)])
    assert res.exit_code == 0, res.output
    with gzip.open(out, "rt") as f:
        added = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "plait"]
    assert [(e["ts"], e["dur"]) for e in added] == [(0, 100), (350, 70), (500, 10)]
    res = runner.invoke(app, ["analyze", str(out), "-H", "none", "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["traces"][0]["devices"][0]["exposed_us"] == 180
    sim = tmp_path / "layer.json.gz"
    res = runner.invoke(app, ["explore", "-m", "llama3-8b", "--trace", str(sim)])
    assert res.exit_code == 0, res.output
    with gzip.open(sim, "rt") as f:
        assert any(e["ph"] == "X" for e in json.load(f)["traceEvents"])


def test_shapes_recorded_as_strings_are_not_a_traceback(tmp_path):
    """`Input Dims` (and strides) as lists of strings ended in a TypeError: such a GEMM has no
    known shape, so it is compute without a pair, and the rest is analyzed."""
    doc = _gpu_trace()
    mm = doc["traceEvents"][1]["args"]
    mm["Input Dims"] = [[str(M), str(K)], [str(K), str(N)]]
    mm["Input Strides"] = [["1", str(M)], [str(N), "1"]]
    src = tmp_path / "rank0.json"
    src.write_text(json.dumps(doc))
    res = runner.invoke(app, ["analyze", str(src), "--json", "-"])
    assert res.exit_code == 0, res.output
    (tr,) = json.loads(res.stdout)["traces"]
    assert tr["devices"][0]["exposed_us"] == 180 and tr["pairs"] == []
    res = runner.invoke(app, ["analyze", str(src), "-H", "none"])
    assert "1 operator(s) recorded shapes that are not lists of sizes" in " ".join(
        res.output.split())


def test_a_truncated_gz_among_good_traces_is_named_as_truncated(tmp_path):
    for r in (0, 1):
        data = gzip.compress(json.dumps(_gpu_trace(r)).encode())
        (tmp_path / f"rank{r}.json.gz").write_bytes(data if r == 0 else data[: len(data) // 2])
    res = runner.invoke(app, ["analyze", str(tmp_path), "-H", "none"])
    text = "".join(res.output.split())  # a long temporary path may wrap mid-word
    assert res.exit_code == 2 and "rank1.json.gzistruncated" in text, res.output
    assert "moverank1.json.gzoutofthefolder" in text and "Traceback" not in text


def test_events_that_cannot_be_read_are_skipped_and_counted(tmp_path):
    doc = _gpu_trace()
    doc["traceEvents"] += [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "soon", "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0,
         "dur": float("nan")},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0}]
    src = tmp_path / "rank0.json"
    src.write_text(json.dumps(doc))
    res = runner.invoke(app, ["analyze", str(src), "-H", "none", "--json", "-"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert any("3 event(s) skipped" in n for n in out["notes"]), out["notes"]
    assert out["traces"][0]["devices"][0]["exposed_us"] == 180
