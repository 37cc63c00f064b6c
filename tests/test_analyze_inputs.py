"""`plait analyze` on inputs it did not write: communication kernels by rule, the window of
profiler steps, rank sets that are not one whole job, idle time and its causes."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.analyze.analysis import analyze
from plait.analyze.breakdown import DEPENDENCY, HOST, idle_rows
from plait.analyze.exposure import waiting_of
from plait.analyze.kineto import Comm, read_trace
from plait.cli.main import app
from plait.errors import SpecError
from plait.intervals import Covered, length, uncovered, union
from plait.workload.operators import CollectiveKind

runner = CliRunner()


class Trace:
    """A GPU trace built event by event: kernels with their CPU launches (correlation ids)."""

    def __init__(self, rank: int = 0, world: int = 2, t0: float = 1.7e15) -> None:
        self.t0 = t0
        self.events: list[dict] = []
        self.doc = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
                    "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
                    "traceEvents": self.events}
        self._corr = 0

    def cpu(self, name: str, ts: float, dur: float, cat: str = "cpu_op", **args) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 9, "tid": 9,
                            "ts": self.t0 + ts, "dur": dur, "args": args})

    def kernel(self, name: str, ts: float, dur: float, launched: float | None = None,
               stream: int = 7, cat: str = "kernel", **args) -> None:
        self._corr += 1
        if launched is not None:
            self.cpu("cudaLaunchKernel", launched, 1, "cuda_runtime", correlation=self._corr)
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": self.t0 + ts, "dur": dur,
                            "args": {"stream": stream, "correlation": self._corr, **args}})

    def write(self, path):
        path.write_text(json.dumps(self.doc))
        return path


def _steps_trace(comm_last: float, n: int = 4) -> Trace:
    """`n` steps of 100 us on the CPU; each launches a GEMM (40 us) and an all-reduce (20 us,
    `comm_last` in the last step) that run 50 us later on the GPU, past the step's end."""
    t = Trace()
    for i in range(n):
        t.cpu(f"ProfilerStep#{i + 1}", 100 * i, 100, "user_annotation")
        t.kernel("sm90_gemm", 100 * i + 50, 40, launched=100 * i + 5)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32", 100 * i + 90,
                 comm_last if i == n - 1 else 20, launched=100 * i + 10, stream=20)
    return t


def test_a_kernel_belongs_to_the_step_that_launched_it(tmp_path):
    (d,) = read_trace(_steps_trace(20).write(tmp_path / "t.json")).devices
    # the GEMM of step 1 runs at 50-90 (inside step 1), its all-reduce at 90-110: past the
    # step's CPU range, still step 1's
    assert [c.step for c in d.comms] == [1, 2, 3, 4]
    assert [g.step for g in d.compute] == [1, 2, 3, 4] and d.steps == (1, 2, 3, 4)


def test_the_window_leaves_out_an_outlier_last_step_and_says_so(tmp_path):
    path = _steps_trace(40).write(tmp_path / "t.json")  # the last step communicates 2x
    a = analyze([path], None)
    assert a.window.steps == (1, 2, 3) and a.window.dropped_last == 4
    assert "step 4 left out" in a.window.note and "2.0x the median" in a.window.note
    (d,) = a.traces[0].exposure
    assert (d.steps, d.comm_us, d.compute_us) == (3, 60, 120)
    assert [r.in_window for r in a.traces[0].step_rows] == [True, True, True, False]
    kept = analyze([path], None, drop_last=False)
    assert kept.window.steps == (1, 2, 3, 4) and kept.traces[0].exposure[0].comm_us == 100
    assert analyze([path], None, steps="2:3").window.steps == (2, 3)
    whole = analyze([path], None, steps="all")  # every event, totals
    assert whole.window.steps == () and whole.traces[0].exposure[0].steps == 0
    assert whole.traces[0].exposure[0].comm_us == 100
    # no outlier: every step is kept, unless asked
    even = _steps_trace(20).write(tmp_path / "even.json")
    assert analyze([even], None).window.steps == (1, 2, 3, 4)
    assert analyze([even], None, drop_last=True).window.steps == (1, 2, 3)
    with pytest.raises(SpecError, match="--steps"):
        analyze([even], None, steps="7:9")
    for bad in ("a:b", "3:1", "1:2:3"):
        res = runner.invoke(app, ["analyze", str(even), "-H", "none", "--steps", bad])
        assert res.exit_code == 2 and "--steps" in res.output, bad


def test_sendrecv_kernels_of_an_all_to_all_are_an_all_to_all(tmp_path):
    t = Trace()
    t.cpu("c10d::alltoall_base_", 0, 30, **{"Input Dims": [[384], [384], [], []],
                                            "Input type": ["long", "long", "", ""]})
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*)", 40, 50, launched=10)
    t.cpu("c10d::broadcast_", 100, 30)
    t.kernel("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long)", 140, 5,
             launched=110)
    (d,) = read_trace(t.write(tmp_path / "t.json")).devices
    a2a, bcast = d.comms
    assert (a2a.kind, a2a.label, a2a.elems, a2a.nbytes) == (
        CollectiveKind.A2A, "all_to_all", 384, 384 * 8)
    assert (bcast.kind, bcast.label) == (None, "broadcast")


def test_expert_parallel_kernels_and_user_patterns_are_communication(tmp_path):
    t = Trace()
    t.kernel("void deep_ep::internode::dispatch<8>(int4*)", 0, 100, stream=27)
    t.kernel("void cutlass::device_kernel<grouped_gemm>(Params)", 0, 90)
    t.kernel("my_custom_a2a_kernel", 100, 10, stream=27)
    path = t.write(tmp_path / "t.json")
    (d,) = read_trace(path).devices
    assert [(c.rule, c.kind) for c in d.comms] == [("expert parallel", CollectiveKind.A2A)]
    a = analyze([path], None, comm_kernels=["custom_a2a"])
    rules = {r.rule: r for r in a.traces[0].rules}
    assert rules["expert parallel"].exposed_us == 10 and rules["user: custom_a2a"].time_us == 10
    with pytest.raises(SpecError, match="--comm-kernel"):
        analyze([path], None, comm_kernels=["(unclosed"])


def test_no_communication_names_what_it_looked_for_and_the_top_kernels(tmp_path):
    t = Trace()
    t.kernel("my_secret_allgather", 0, 300)
    t.kernel("sm90_gemm", 0, 100)
    path = t.write(tmp_path / "t.json")
    res = runner.invoke(app, ["analyze", str(path), "-H", "none"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "DeepEP" in out and "my_secret_allgather (0.30 ms)" in out
    assert "--comm-kernel" in out
    res = runner.invoke(app, ["analyze", str(path), "-H", "none", "--comm-kernel", "secret",
                              "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["traces"][0]["rules"][0]["rule"] == "user: secret"


def test_memory_copies_are_their_own_busy_category(tmp_path):
    t = Trace()
    t.kernel("sm90_gemm", 0, 100)
    t.kernel("Memcpy DtoD (Device -> Device)", 100, 50, cat="gpu_memcpy")
    t.kernel("Memset (Device)", 150, 50, cat="gpu_memset")
    t.kernel("ncclDevKernel_AllReduce", 150, 100, stream=20)
    (e,) = analyze([t.write(tmp_path / "t.json")], None).traces[0].exposure
    # memory alone: 100-150 (the memset runs beside the all-reduce, which is exposed)
    assert (e.span_us, e.compute_us, e.exposed_us, e.memory_us, e.idle_us) == (
        250, 100, 100, 50, 0)


def test_idle_time_is_told_apart_by_cause(tmp_path):
    t = Trace()
    t.kernel("a", 0, 10, launched=0)
    t.kernel("b", 30, 10, launched=25)  # launched after the GPU went idle at 10: the host
    t.kernel("c", 50, 10, launched=1)  # launched long before: a dependency held it
    t.kernel("ncclDevKernel_AllReduce", 60, 10, stream=20, launched=2)
    (d,) = read_trace(t.write(tmp_path / "t.json")).devices
    assert {r.cause: (r.gaps, r.time_us) for r in idle_rows(d)} == {
        HOST: (1, 20), DEPENDENCY: (1, 10)}


def test_rank_sets_that_are_not_one_job(tmp_path):
    r0 = _steps_trace(20).write(tmp_path / "r0.json")
    r1t = _steps_trace(20)
    r1t.doc["distributedInfo"]["rank"] = 1
    r1 = r1t.write(tmp_path / "r1.json")
    # the same trace twice: read once, said so
    a = analyze([r0, r0], None)
    assert len(a.traces) == 1 and "same trace" in a.notes[0]
    # two ranks of two: waiting is exact; of a world of 8 it is a lower bound
    assert not analyze([r0, r1], None).waiting_is_bound
    big = []
    for r, src in ((0, r0), (1, r1)):
        doc = json.loads(src.read_text())
        doc["distributedInfo"]["world_size"] = 8
        big.append(tmp_path / f"big{r}.json")
        big[-1].write_text(json.dumps(doc))
    partial = analyze(big, None)
    assert partial.waiting_is_bound and "2 of 8 ranks" in partial.notes[0]
    # a straggler named from a partial rank set is a guess, and says why
    res = runner.invoke(app, ["analyze", *map(str, big), "-H", "none"])
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "straggler:" in text, text
    assert "A guess: only 2 of 8 ranks were traced" in text
    whole = runner.invoke(app, ["analyze", str(r0), "-H", "none", "--steps", "all"])
    text = " ".join(whole.output.split())
    assert "ms, totals over the whole trace" in text and "per step" not in text.split(
        "time per device")[1][:40]
    # another job: other world size, or rank 0 twice with other content, or far apart
    for other, match in ((big[1], "different jobs"), (_moved(r0, tmp_path, 0), "both rank 0"),
                         (_moved(r1, tmp_path, 3600e6), "apart")):
        with pytest.raises(SpecError, match=match):
            analyze([r0, other], None)


def _moved(src, tmp_path, by_us):
    doc = json.loads(src.read_text())
    for e in doc["traceEvents"]:
        e["ts"] += by_us + 1
    out = tmp_path / f"moved{by_us:.0f}.json"
    out.write_text(json.dumps(doc))
    return out


def test_plaits_own_outputs_in_a_folder_are_skipped(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in (0, 1):
        t = _steps_trace(20)
        t.doc["distributedInfo"]["rank"] = r
        t.write(ranks / f"rank{r}.json")
    res = runner.invoke(app, ["analyze", str(ranks), "-H", "none",
                              "--trace", str(ranks / "exposed.json"),
                              "--json", str(ranks / "result.json")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["analyze", str(ranks), "-H", "none", "--json", "-"])
    assert res.exit_code == 0, res.output
    assert [t["rank"] for t in json.loads(res.stdout)["traces"]] == [0, 1]
    err = "".join(runner.invoke(app, ["analyze", str(ranks), "-H", "none"]).output.split())
    assert "exposed.jsonskipped" in err and "result.jsonskipped" in err


def test_another_accelerator_is_refused_not_read_as_cpu(tmp_path):
    path = tmp_path / "mtia.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "mtia_ccp_events", "name": "k", "pid": 1, "tid": 1, "ts": 0,
         "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 2, "tid": 2, "ts": 0,
         "dur": 5}]}))
    res = runner.invoke(app, ["analyze", str(path)])
    assert res.exit_code == 2 and "accelerator plait does not read" in " ".join(
        res.output.split())


spans = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 10), st.integers(0, 10)),
                 min_size=1, max_size=6)


@given(spans, st.lists(st.tuples(st.integers(0, 60), st.integers(1, 10)), max_size=6))
def test_waiting_is_a_part_of_exposed(comms, compute):
    """Whatever the transfers, their waits and the compute: waiting <= exposed (the parts add
    up), concurrent transfers' waits counted once."""
    cs = [Comm(float(s), float(s + d), "x", "c", CollectiveKind.AR, 2, 0, 0.0, None,
               wait=float(min(w, d))) for s, d, w in comms]
    cover = Covered((float(s), float(s + d)) for s, d in compute)
    exposed = length(uncovered(union((c.start, c.end) for c in cs), cover.spans))
    waiting = waiting_of(cs, cover)
    assert waiting is not None and 0 <= waiting <= exposed + 1e-9


def test_work_that_started_before_the_profiler_is_counted_and_its_step_left_out(tmp_path):
    """GPU kernels whose launch the trace misses (they started before the profiler's first
    runtime events) landed in the first step and inflated it and every per-step average: the
    report counts them, and an outlier first step is left out like the last one."""
    t = _steps_trace(20)
    for k in range(3):  # work queued before profiling: no launch event
        t.kernel("sm90_gemm", 5 + 10 * k, 8, launched=None)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32", 10 + 10 * k, 10, launched=None, stream=20)
    path = t.write(tmp_path / "t.json")
    a = analyze([path], None)
    assert a.window.steps == (2, 3, 4) and a.window.dropped_first == 1
    assert "step 1 left out" in a.window.note and "--keep-first" in a.window.note
    assert any("6 GPU event(s) without their launch" in n for n in a.notes), a.notes
    kept = analyze([path], None, drop_first=False)
    assert kept.window.steps == (1, 2, 3, 4) and "kept (--keep-first)" in kept.window.note
    res = runner.invoke(app, ["analyze", str(path), "-H", "none", "--keep-first", "--json", "-"])
    assert res.exit_code == 0, res.output
    # an even trace keeps its first step
    assert analyze([_steps_trace(20).write(tmp_path / "even.json")], None).window.steps == (
        1, 2, 3, 4)


def test_a_kernel_is_labelled_as_its_siblings_with_metadata_are(tmp_path):
    """One NCCL kernel name seen with its collective's metadata (an all-reduce) and once
    without (work that started before the profiler): it was labelled `p2p` beside
    `all_reduce`; the siblings' kind wins."""
    t = Trace()
    meta = {"Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024,
            "Group size": 2, "dtype": "Float"}
    t.kernel("ncclDevKernel_SendRecv", 0, 10, launched=None, stream=20)
    for i in range(2):
        t.kernel("ncclDevKernel_SendRecv", 100 + 50 * i, 10, launched=90 + 50 * i, stream=20,
                 **meta)
    (d,) = read_trace(t.write(tmp_path / "t.json")).devices
    assert [c.kind for c in d.comms] == [CollectiveKind.AR] * 3
    assert len({c.label for c in d.comms}) == 1


def _finding(path, what):
    a = analyze([path], None)
    return [f for t in a.traces for f in t.findings if what in f.what]


def test_findings_name_what_stopped_overlap(tmp_path):
    """Each finding one line with its evidence and the fix; none where overlap happens."""
    # collectives queued on the stream that runs the GEMMs
    t = Trace()
    for i in range(3):
        t.kernel("sm90_gemm", 100 * i, 60, launched=100 * i)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32", 100 * i + 60, 30, launched=100 * i + 1)
    (f,) = _finding(t.write(tmp_path / "same.json"), "compute stream")
    assert "3 collective kernels" in f.evidence and "stream of their own" in f.fix
    # on two streams but one after the other: never overlapped
    (f,) = _finding(t.write(tmp_path / "same.json"), "never run at the same time")
    assert "0.00 ms of 0.09 ms communication overlapped" in f.evidence
    assert "plait doctor" in f.fix
    # overlapped on a stream of its own, launched ahead of the device: nothing to find
    t = Trace()
    for i in range(3):
        t.kernel("sm90_gemm", 100 * i, 60, launched=0)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32", 100 * i + 10, 30, launched=1, stream=20)
    assert analyze([t.write(tmp_path / "fine.json")], None).traces[0].findings == ()


def test_a_plain_dependent_pair_is_found_unless_a_fused_overlap_ran(tmp_path):
    from tests.test_analyze import _gpu_trace

    doc = _gpu_trace()
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(doc))
    (f,) = _finding(path, "run plainly")
    assert "ag:8192x1792x4096" in f.evidence and "0.10 ms of their transfers exposed" in (
        f.evidence) and "async TP" in f.fix
    doc["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "symm_mem_barrier",
                               "pid": 0, "tid": 22, "ts": 590, "dur": 1,
                               "args": {"device": 0, "stream": 22}})
    path.write_text(json.dumps(doc))
    assert _finding(path, "run plainly") == []
    res = runner.invoke(app, ["analyze", str(path), "-H", "none", "--json", "-"])
    assert res.exit_code == 0 and "findings" in json.loads(res.stdout)["traces"][0]


def _plait_calls_trace() -> Trace:
    """plait's calls on a GPU as the runtime names them: an all-gather -> GEMM call twice
    under fine/dma/c2/g1/M (a 100 us transfer hidden but 10 us, then GEMM pieces: 200 us a
    call), and twice plainly (seq/sm: a 100 us all-gather, then the 100 us GEMM)."""
    t = Trace(world=8)
    shape = "8192x1792x4096 p8 bf16"

    def call(schedule: str, engine: str, ts: float, dur: float) -> None:
        t.events.append({"ph": "X", "cat": "gpu_user_annotation", "pid": 0, "tid": 7,
                         "ts": t.t0 + ts, "dur": dur,
                         "name": f"plait:call all_gather_matmul ag_mm {schedule} {shape} "
                                 f"{engine}"})

    for i in range(2):
        base = 1000 * i
        call("fine/dma/c2/g1/M", "peer_copy", base, 200)
        t.kernel("Memcpy PtoP (Device -> Device)", base, 100, launched=base, stream=21,
                 cat="gpu_memcpy", bytes=1 << 20)
        t.kernel("sm90_gemm", base + 10, 190, launched=base + 1)
        call("seq/sm", "collective", base + 500, 200)
        t.kernel("ncclDevKernel_AllGather_RING_LL", base + 500, 100, launched=base + 500,
                 stream=20)
        t.kernel("sm90_gemm", base + 600, 100, launched=base + 501)
    return t


def test_plaits_calls_are_graded_against_prediction_plan_and_the_plain_path(tmp_path):
    from plait.analyze.grade import read_plan
    from plait.spec.hardware import load_hardware

    path = _plait_calls_trace().write(tmp_path / "t.json")
    (t,) = analyze([path], load_hardware("h100")).traces
    graded = {g.call.schedule: g for g in t.graded}
    fine, plain = graded["fine/dma/c2/g1/M"], graded["seq/sm"]
    assert (fine.calls, fine.time_us, fine.exposed_us) == (2, 200, 10)
    assert (plain.calls, plain.time_us, plain.exposed_us) == (2, 200, 100)
    assert fine.plain_us == 200 and fine.plain_measured  # the plain calls of this trace
    assert fine.predicted_us is not None and fine.predicted_us > 0
    assert plain.verdict != "slower than plain"  # the plain path is never slower than itself
    # a plan that chose another schedule for this pair: not as planned
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pairs": [
        {"name": "fc1", "collective": "all_gather", "direction": "in", "ranks": 8,
         "gemm": {"m": 8192, "n": 1792, "k": 4096, "count": 1},
         "chosen": {"schedule": "fine/dma/c2/g1/M"}}]}))
    (t,) = analyze([path], load_hardware("h100"), plan=read_plan(plan)).traces
    graded = {g.call.schedule: g for g in t.graded}
    assert graded["fine/dma/c2/g1/M"].pair == "fc1"
    assert graded["seq/sm"].verdict == "not as planned"
    assert "the plan chose fine/dma/c2/g1/M; seq/sm ran" in graded["seq/sm"].why
    res = runner.invoke(app, ["analyze", str(path), "-H", "h100", "--plan", str(plan),
                              "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)["traces"][0]["graded"]
    assert {g["ran"] for g in doc} == {"fine/dma/c2/g1/M", "seq/sm"}
    # a plan measured by `plait tune`: its choice is the plan
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"made_by": "plait tune", "pairs": [
        {"name": "fc1", "kind": "ag", "axis": "M", "ranks": 8, "choice": "seq/sm",
         "gemm": {"m": 8192, "n": 1792, "k": 4096, "count": 1}}]}))
    (t,) = analyze([path], load_hardware("h100"), plan=read_plan(tuned)).traces
    graded = {g.call.schedule: g for g in t.graded}
    assert graded["fine/dma/c2/g1/M"].verdict == "not as planned"
    assert graded["seq/sm"].pair == "fc1" and graded["seq/sm"].verdict != "not as planned"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pairs": [{"name": "fc1"}]}))
    res = runner.invoke(app, ["analyze", str(path), "--plan", str(bad)])
    assert res.exit_code == 2 and "plait explore --json" in res.output


def test_a_schedule_slower_than_the_plain_path_measured_beside_it_says_so(tmp_path):
    t = _plait_calls_trace()
    for e in t.events:  # the plain calls take half as long
        if e.get("name", "").startswith("plait:call") and " seq/sm " in e["name"]:
            e["dur"] = 100
    (tr,) = analyze([t.write(tmp_path / "t.json")], None).traces
    fine = next(g for g in tr.graded if g.call.schedule == "fine/dma/c2/g1/M")
    assert fine.verdict == "slower than plain" and "measured in this trace" in fine.why


def test_a_backward_call_matches_the_data_gradient_pair_of_its_shape(tmp_path):
    """A forward pair and another pair's data gradient can share a GEMM shape (qkv and
    fc2_dgrad of a small model): the backward's call (`.bwd`) is the data gradient's."""
    from plait.analyze.grade import read_plan
    from plait.spec.hardware import load_hardware

    t = _plait_calls_trace()
    for e in t.events:
        if e.get("name", "").startswith("plait:call") and " seq/sm " in e["name"]:
            e["name"] = e["name"].replace(" ag_mm ", " mm_rs.bwd ")
    pair = {"collective": "all_gather", "direction": "in", "ranks": 8,
            "gemm": {"m": 8192, "n": 1792, "k": 4096, "count": 1}}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pairs": [
        {"name": "qkv", **pair, "chosen": {"schedule": "fine/dma/c2/g1/M"}},
        {"name": "fc2_dgrad", **pair, "chosen": {"schedule": "seq/sm"}}]}))
    (tr,) = analyze([t.write(tmp_path / "t.json")], load_hardware("h100"),
                    plan=read_plan(plan)).traces
    assert {g.call.label: (g.pair, g.planned) for g in tr.graded} == {
        "ag_mm": ("qkv", "fine/dma/c2/g1/M"), "mm_rs.bwd": ("fc2_dgrad", "seq/sm")}
    assert all(g.verdict != "not as planned" for g in tr.graded)


def test_a_copy_engine_schedule_that_moved_data_with_kernels_is_found(tmp_path):
    t = _plait_calls_trace()
    for e in t.events:  # the copy-engine calls' transfers as collective kernels instead
        if e.get("cat") == "gpu_memcpy":
            e["cat"], e["name"] = "kernel", "ncclDevKernel_AllGather_RING_LL"
    (f,) = _finding(t.write(tmp_path / "t.json"), "copy engines expected")
    assert "fine/dma/c2/g1/M" in f.what and "2 calls: 1 collective kernels, no copy" in (
        f.evidence) and "plait doctor" in f.fix
    assert _finding(_plait_calls_trace().write(tmp_path / "ok.json"), "copy engines") == []


def test_decomposition_and_contention_losses_are_measured_where_the_trace_allows(tmp_path):
    """A decomposed call's GEMM pieces: one beside its transfer (120 us), one alone (100 us),
    against the whole GEMM of a plain call of the same shape (180 us): decomposition
    2 x 100 / 180 - 1, contention 120 / 100 - 1."""
    t = Trace(world=8)
    shape = "8192x1792x4096 p8 bf16"

    def call(schedule: str, ts: float, dur: float) -> None:
        t.events.append({"ph": "X", "cat": "gpu_user_annotation", "pid": 0, "tid": 7,
                         "ts": t.t0 + ts, "dur": dur, "name": f"plait:call all_gather_matmul "
                                                              f"ag_mm {schedule} {shape} x"})

    for i in range(2):
        base = 1000 * i
        call("fine/dma/c2/g1/M", base, 230)
        t.kernel("Memcpy PtoP (Device -> Device)", base, 130, launched=base, stream=21,
                 cat="gpu_memcpy", bytes=1 << 20)
        t.kernel("sm90_gemm", base + 5, 120, launched=base + 1)  # beside the copy
        t.kernel("sm90_gemm", base + 130, 100, launched=base + 2)  # alone
        call("seq/sm", base + 500, 300)
        t.kernel("ncclDevKernel_AllGather_RING_LL", base + 500, 100, launched=base + 500,
                 stream=20)
        t.kernel("sm90_gemm", base + 600, 180, launched=base + 501)
    (tr,) = analyze([t.write(tmp_path / "t.json")], None).traces
    fine = next(g for g in tr.graded if g.call.schedule == "fine/dma/c2/g1/M")
    assert fine.decomposition_loss == pytest.approx(2 * 100 / 180 - 1)
    assert fine.contention_loss == pytest.approx(120 / 100 - 1)
    plain = next(g for g in tr.graded if g.call.schedule == "seq/sm")
    assert plain.decomposition_loss is None and plain.contention_loss is None


def _zero_cta_trace(copy_engine_calls: int) -> Trace:
    """Two all-gathers beside a GEMM each: the first `copy_engine_calls` of them moved by peer
    copies launched inside the all-gather's call (NCCL's zero-CTA path), the others by an NCCL
    kernel."""
    t = Trace()
    meta = {"Collective name": "allgather", "In msg nelems": 1024, "Out msg nelems": 2048,
            "Group size": 2, "dtype": "BFloat16"}
    for i in range(2):
        t.kernel("sm90_gemm", 100 * i, 60, launched=100 * i)
        if i < copy_engine_calls:
            t.cpu("record_param_comms", 100 * i + 1, 5, **meta)
            t.kernel("Memcpy PtoP (Device -> Device)", 100 * i + 10, 30, launched=100 * i + 2,
                     stream=20, cat="gpu_memcpy", bytes=2048)
        else:
            t.kernel("ncclDevKernel_AllGather_RING_LL", 100 * i + 10, 30, launched=100 * i + 2,
                     stream=20, **meta)
    return t


def test_nccl_collectives_that_skipped_copy_engines_are_found(tmp_path):
    """Copy-engine traffic inside a collective's call is that collective, by copy engine
    (communication, never idle); an all-gather that ran as an NCCL kernel beside others that
    went by copy engine, or where the job asked for copy engines, is a finding."""
    path = _zero_cta_trace(1).write(tmp_path / "mixed.json")
    (d,) = read_trace(path).devices
    assert [(c.kind, c.label) for c in d.comms] == [
        (CollectiveKind.AG, "all_gather by copy engine"), (CollectiveKind.AG, "all_gather")]
    (f,) = _finding(path, "copy engines expected")
    assert f.what == "copy engines expected, not used: NCCL all_gather"
    assert "1 NCCL all_gather kernels (0.03 ms)" in f.evidence and "1 peer copies" in (
        f.evidence) and "NCCL_CTA_POLICY=2" in f.fix
    assert analyze([path], None).traces[0].exposure[0].comm_us == pytest.approx(60)
    # only NCCL kernels: a finding only when the job says it asked for copy engines
    path = _zero_cta_trace(0).write(tmp_path / "sm.json")
    assert _finding(path, "copy engines expected") == []
    (f,) = [f for f in analyze([path], None, expect_copy_engines=True).traces[0].findings
            if "copy engines expected" in f.what]
    assert "2 NCCL all_gather kernels" in f.evidence and "zero-CTA" in f.evidence
    res = runner.invoke(app, ["analyze", str(path), "-H", "none", "--expect-copy-engines"])
    assert res.exit_code == 0 and "copy engines expected" in res.stdout
    # every all-gather by copy engine: nothing to find
    assert _finding(_zero_cta_trace(2).write(tmp_path / "ce.json"), "copy engines") == []


def test_a_device_waiting_for_launches_is_found_with_plaits_issue_rate(tmp_path):
    """Short steps launched one by one from the host: the device idles before each kernel it
    was handed late. The finding says how long, how much of it inside plait's calls and how
    often they issued a GPU operation; a trace whose kernels were queued ahead has none."""
    t = Trace(world=8)
    shape = "8192x1792x4096 p8 bf16"
    for i in range(3):
        base = 1000 * i
        t.events.append({"ph": "X", "cat": "gpu_user_annotation", "pid": 0, "tid": 7,
                         "ts": t.t0 + base, "dur": 400,
                         "name": f"plait:call all_gather_matmul ag_mm p2p/dma/M {shape} "
                                 "peer_copy"})
        for j in range(8):  # a 10 us piece every 50 us, each launched 45 us after the last
            t.kernel("sm90_gemm", base + 50 * j, 10, launched=base + 50 * j - 2)
    (f,) = _finding(t.write(tmp_path / "host.json"), "host set the pace")
    assert "in 23 gaps" in f.evidence and "0.92 ms of it inside plait's calls" in f.evidence
    assert "every 50 µs" in f.evidence and "host_call_s" in f.fix
    queued = Trace()
    for j in range(8):  # launched long before they ran: the device never waits for the host
        queued.kernel("sm90_gemm", 50 * j, 40, launched=0)
    assert _finding(queued.write(tmp_path / "queued.json"), "host set the pace") == []


def test_a_time_beyond_any_clock_is_not_read(tmp_path):
    """A kernel at ts=1e300 printed "inf ms ... (nan%)": no clock gives such a time."""
    t = Trace()
    t.kernel("sm90_gemm", 0, 40)
    t.kernel("ncclDevKernel_AllReduce_Sum_f32", 10, 20, stream=20)
    t.kernel("ncclDevKernel_AllReduce_Sum_f32", 1e300, 20, stream=20)
    t.kernel("sm90_gemm", 50, 1e300)
    res = runner.invoke(app, ["analyze", str(t.write(tmp_path / "t.json")), "-H", "none"])
    assert res.exit_code == 0, res.output
    import re

    assert not re.search(r"\b(inf|nan)\b", res.output), res.output
    assert "skipped" in res.output  # said, not silent
    (d,) = read_trace(tmp_path / "t.json").devices
    assert len(d.comms) == 1 and d.comms[0].end - d.comms[0].start == 20
