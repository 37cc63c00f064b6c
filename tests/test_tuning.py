"""`schedule="auto"`: the decision rule, the tuning cache, and tuning on real gloo ranks (a
slowed candidate never chosen, one decision on every rank whatever their caches, outputs and
gradients equal to the plain reference during and after tuning, compile, co-execution)."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from plait.runtime.launch import run_ranks
from plait.schedule.verdict import PLAIN
from plait.tuning.cache import TuningCache
from plait.tuning.decide import (
    Candidate,
    Decision,
    TuningReport,
    decide,
    error_summary,
)
from plait.tuning.signature import Signature
from plait.workload.operators import Axis, PairKind

times = st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=5)


@given(base=times, others=st.lists(times, min_size=1, max_size=4))
def test_the_choice_beats_the_baseline_beyond_the_spread_or_is_the_baseline(base, others):
    cands = [Candidate(PLAIN, None, tuple(base)),
             *(Candidate(f"fine/dma/c{2 ** i}/g1/M", None, tuple(t))
               for i, t in enumerate(others))]
    d = decide("k", cands)
    b = cands[0]
    if d.choice == PLAIN:
        assert "does not pay" in d.reason or "fits" in d.reason
    else:
        chosen = d.candidate(d.choice)
        assert chosen is not None and chosen.measured_s is not None and b.measured_s
        assert chosen.measured_s < b.measured_s - max(chosen.spread_s, b.spread_s)
        assert chosen.measured_s == min(c.measured_s or 0 for c in cands[1:])
        assert "won by" in d.reason


@given(base=times, slow=times)
def test_a_candidate_slower_on_every_call_is_never_chosen(base, slow):
    shifted = tuple(t + max(base) for t in slow)
    d = decide("k", [Candidate(PLAIN, None, tuple(base)), Candidate("p2p/dma/M", None,
                                                                        shifted)])
    assert d.choice == PLAIN
    assert "overlap does not pay here: best" in d.reason


def test_a_decision_round_trips_through_its_dict_and_grades_the_prediction(tmp_path):
    from plait.tuning.decide import TuningReport

    d = decide("k", [Candidate(PLAIN, 2e-3, (4e-3, 4e-3, 4e-3)),
                     Candidate("p2p/dma/M", 1e-3, (2e-3, 2e-3, 2.1e-3))])
    assert d.choice == "p2p/dma/M" and d.speedup == pytest.approx(2.0)
    assert Decision.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    s = error_summary([d])
    assert s["median_error"] == pytest.approx(0.5) and s["predicted_best_was_best"] == 1
    report = TuningReport((("tp", d),), measurement_calls=8)
    doc = json.loads(report.save(tmp_path / "r" / "report.json").read_text())
    assert doc["decisions"][0]["choice"] == "p2p/dma/M" and doc["measurement_calls"] == 8
    assert "p2p/dma/M" in str(report) and "won by 50%" in str(report)


def test_a_decisions_candidates_are_graded_in_analyzes_words():
    """One vocabulary: a tuning decision's candidates get `plait analyze`'s verdicts."""
    d = decide("k", [Candidate(PLAIN, 1e-3, (1e-3, 1.1e-3, 1e-3)),
                     Candidate("fine/sm/c2/g1/M", 0.5e-3, (1.4e-3, 1.5e-3, 1.4e-3)),
                     Candidate("p2p/sm/M", 0.5e-3, (0.8e-3, 0.82e-3, 0.8e-3))])
    graded = {s: v for s, (v, _) in d.verdicts().items()}
    assert graded == {PLAIN: "as predicted", "fine/sm/c2/g1/M": "slower than plain",
                      "p2p/sm/M": "1.60x predicted"}
    assert [c.get("verdict") for c in d.to_dict()["candidates"]] == list(graded.values())
    assert "slower than plain" in str(TuningReport((("g", d),)))


def test_a_call_flattened_to_rows_has_the_signature_of_its_rows():
    a = Signature(PairKind.AG, 256, 64, 32, 4, "bf16")
    assert a.key == "ag 256x64x32 bf16 /M p4 gloo on cpu"
    assert a.pair().gemm.m == 256 and a.pair().ranks == 4
    k = Signature(PairKind.AG, 16, 64, 128, 4, "fp32", Axis.K)
    assert k.pair().axis is Axis.K


FP = {"device": "cpu", "torch": "x"}


def _decision(key: str, choice: str = "p2p/dma/M") -> Decision:
    return Decision(key, choice, "won", candidates=(Candidate(choice, 1e-3, (1e-3,)),))


def test_the_cache_keeps_decisions_and_refuses_foreign_or_broken_files(tmp_path):
    warned: list[str] = []
    path = tmp_path / "t.json"
    TuningCache(path, FP, warned.append).save({"a": _decision("a")})
    assert TuningCache(path, FP, warned.append).load() == {"a": _decision("a")}
    assert TuningCache(path, {**FP, "torch": "y"}, warned.append).load() == {}
    assert "written for another machine or version (torch differ)" in warned[-1]
    path.write_text("{not json")
    assert TuningCache(path, FP, warned.append).load() == {}
    assert str(path) in warned[-1] and "unreadable" in warned[-1]
    path.write_text(json.dumps({"format": "plait-tuning/1", "fingerprint": FP,
                                "entries": {"a": {"choice": 3}}}))
    assert TuningCache(path, FP, warned.append).load() == {}
    assert len(warned) == 3


def _save_many(path: str, worker: int) -> None:
    cache = TuningCache(__import__("pathlib").Path(path), FP, print)
    for i in range(15):
        cache.save({f"w{worker}-{i}": _decision(f"w{worker}-{i}")})


def test_concurrent_jobs_writing_one_cache_leave_every_decision(tmp_path):
    path = tmp_path / "shared.json"
    procs = [mp.get_context("fork").Process(target=_save_many, args=(str(path), w))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    entries = TuningCache(path, FP, pytest.fail).load()
    assert set(entries) == {f"w{w}-{i}" for w in range(4) for i in range(15)}


# --- on ranks ------------------------------------------------------------------------------------

def _mlp_steps(rank, world, steps, schedule="auto"):
    """`steps` training steps of a tensor- and sequence-parallel MLP through plait's ops;
    each step's output and gradients against the unsharded torch reference."""
    from plait import ops

    torch.manual_seed(0)
    x = torch.randn(16 * world, 24, requires_grad=True)
    full1, full2 = torch.randn(24, 32 * world), torch.randn(32 * world, 24)
    ref1, ref2 = full1.clone().requires_grad_(), full2.clone().requires_grad_()
    ref = torch.relu(x @ ref1) @ ref2
    ref.square().sum().backward()
    cols = slice(32 * rank, 32 * (rank + 1))
    w1 = full1[:, cols].clone().requires_grad_()
    w2 = full2[cols].clone().requires_grad_()
    shard = x.detach().chunk(world)[rank].clone().requires_grad_()
    ok = True
    for _ in range(steps):
        w1.grad = w2.grad = shard.grad = None
        _, (h,) = ops.all_gather_matmul(shard, [w1], schedule=schedule)
        y = ops.matmul_reduce_scatter(torch.relu(h), w2, schedule=schedule)
        y.square().sum().backward()
        ok &= torch.allclose(y, ref.chunk(world)[rank], atol=1e-3, rtol=1e-4)
        ok &= torch.allclose(w1.grad, ref1.grad[:, cols], atol=1e-2, rtol=1e-3)
        ok &= torch.allclose(w2.grad, ref2.grad[cols], atol=1e-2, rtol=1e-3)
        ok &= torch.allclose(shard.grad, x.grad.chunk(world)[rank], atol=1e-2, rtol=1e-3)
    return bool(ok)


def _tune(rank, world, cache, slowed, slow_rank=None, steps=12):
    from plait import tuning

    held_back = slowed is not None and slow_rank in (None, rank)
    tuning.configure(cache=cache, calls=2, candidates=3,
                     penalty=(lambda s: 0.03 * slowed(s)) if held_back else None)
    ok = _mlp_steps(rank, world, steps)
    rep = tuning.report()
    return ok, {d.key: d.choice for _, d in rep.decisions}, [d.reason for _, d in
                                                            rep.decisions], rep


def _overlapped(s):
    return str(s) != PLAIN


@pytest.mark.slow
def test_slowed_candidates_are_never_chosen_and_outputs_equal_the_reference():
    # every overlapped candidate held back: the baseline, saying why
    out = run_ranks(2, _tune, False, _overlapped, timeout_s=120)
    for ok, choices, reasons, rep in out:
        assert ok, "outputs or gradients differ from the reference during tuning"
        assert set(choices.values()) == {PLAIN}
        assert all("overlap does not pay here: best" in r for r in reasons)
        assert rep.measurement_calls > 0
    assert out[0][1] == out[1][1]


def _p2p_dma(s):
    return str(s) == "p2p/dma/M"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_one_slowed_candidate_is_never_chosen_and_a_slow_rank_still_agrees(world):
    # the candidate is slow on the last rank only: the slowest rank per call decides
    out = run_ranks(world, _tune, False, _p2p_dma, world - 1, timeout_s=180)
    for ok, choices, _, rep in out:
        assert ok
        assert "p2p/dma/M" not in choices.values()
        assert any(c.schedule == "p2p/dma/M" for _, d in rep.decisions for c in d.candidates)
    assert all(o[1] == out[0][1] for o in out), "ranks chose differently"


def _cached_on(rank, world, paths):
    from plait import tuning

    tuning.configure(cache=paths[rank], calls=2)
    ok = _mlp_steps(rank, world, 8)
    rep = tuning.report()
    return ok, {d.key: d.choice for _, d in rep.decisions}, rep.measurement_calls, \
        list(rep.warnings)


@pytest.mark.slow
def test_ranks_with_different_caches_agree_and_a_full_cache_measures_nothing(tmp_path):
    paths = [str(tmp_path / f"r{r}.json") for r in range(2)]
    first = run_ranks(2, _cached_on, paths, timeout_s=120)
    assert all(o[0] for o in first) and first[0][1] == first[1][1] and first[0][2] > 0
    again = run_ranks(2, _cached_on, paths, timeout_s=120)
    assert again[0][1] == first[0][1] and [o[2] for o in again] == [0, 0]
    # rank 1's cache lost, then broken, then another machine's: one decision, the warning
    for broken in ("", "{torn", json.dumps({"format": "plait-tuning/1", "fingerprint":
                                                {"device": "elsewhere"}, "entries": {}})):
        (tmp_path / "r1.json").write_text(broken) if broken else (tmp_path / "r1.json").unlink()
        out = run_ranks(2, _cached_on, paths, timeout_s=120)
        assert all(o[0] for o in out) and out[0][1] == out[1][1]
        assert out[0][2] == out[1][2] > 0  # tuned afresh together
        if broken:
            assert any("r1.json" in w for w in out[1][3]), out[1][3]
        else:
            assert any("ranks hold different decisions" in w for w in out[0][3])


def _one_rank(rank, world):
    from plait import tuning

    ok = _mlp_steps(rank, world, 2)
    rep = tuning.report()
    return ok and rep.measurement_calls == 0 and {d.source for _, d in rep.decisions} == \
        {"one rank"}


@pytest.mark.slow
def test_a_group_of_one_rank_runs_the_baseline_without_measuring():
    assert run_ranks(1, _one_rank, timeout_s=60) == [True]


def _compiled(rank, world):
    from plait import ops, tuning

    tuning.configure(calls=1, warmup=0, candidates=2)
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    w1, w2 = torch.randn(6, 10), torch.randn(10, 4)

    def block(a):
        _, (h,) = ops.all_gather_matmul(a, [w1], schedule="auto")
        return ops.matmul_reduce_scatter(torch.relu(h), w2, schedule="auto")

    eager = block(x)
    torch._dynamo.reset()
    fn = torch.compile(block, fullgraph=True, backend="aot_eager")
    outs = [fn(x) for _ in range(6)]  # tuning happens inside the compiled graph's calls
    records = [r.schedule for r in __import__("plait").ops.runtime_of(None).records]
    return (all(torch.allclose(o, eager, atol=1e-5) for o in outs)
            and all(r.startswith("auto -> ") for r in records)
            and len(tuning.report().decisions) == 2)


@pytest.mark.slow
def test_compile_fullgraph_of_an_auto_block_tunes_at_run_time():
    assert run_ranks(2, _compiled, timeout_s=240) == [True, True]


def _beside_other_work(rank, world):
    from plait import tuning
    from plait.runtime import strands

    with strands.strand("F"):  # a strand without a turnstile: co-execution's calls
        ok = _mlp_steps(rank, world, 2)
    untuned = tuning.report()
    ok &= _mlp_steps(rank, world, 12)
    after = tuning.report()
    return (ok and untuned.measurement_calls == 0
            and {d.source for _, d in untuned.decisions} == {"not tuned"}
            and after.measurement_calls > 0
            and {d.source for _, d in after.decisions[len(untuned.decisions):]} ==
            {"measured"})


@pytest.mark.slow
def test_under_co_execution_the_baseline_runs_untimed_until_calls_run_alone():
    assert run_ranks(2, _beside_other_work, timeout_s=120) == [True, True]


def _layers_and_plans(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait import tuning
    from plait.nn import SequenceParallelMLP
    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel

    tuning.configure(calls=1, warmup=0, candidates=1)
    torch.manual_seed(0)
    mlp = SequenceParallelMLP(8, 16, plan={"fc1": "auto", "fc2": "seq/sm"})
    for _ in range(4):
        mlp(torch.randn(4, 8)).sum().backward()
    mesh = init_device_mesh("cpu", (world,))
    block = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False),
                                torch.nn.Linear(16, 8, bias=False))
    parallelize_module(block, mesh, {"0": PlaitColwiseParallel(schedule="auto"),
                                     "1": PlaitRowwiseParallel(schedule="auto")})
    for _ in range(4):
        block(torch.randn(4, 8)).sum().backward()
    return len(tuning.report().decisions) >= 3


@pytest.mark.slow
def test_layers_styles_and_plans_take_auto():
    assert run_ranks(2, _layers_and_plans, timeout_s=120) == [True, True]


def _different_settings(rank, world):
    from plait import tuning
    from plait.planner.propose import propose

    # rank 1 would propose fewer candidates, timed differently
    tuning.configure(candidates=3 if rank == 0 else 1, calls=1 if rank == 0 else 3)
    ok = _mlp_steps(rank, world, 10)
    rep = tuning.report()
    cluster = tuning.tuner().cluster()
    own = [[str(p.schedule) for p in propose(tuning.Signature(
        PairKind(d.key.split()[0]), *map(int, d.key.split()[1].split("x")), world,
        "fp32").pair(), cluster, tuning.tuner().settings.candidates)]
        for _, d in rep.decisions]
    return ok, [[c.schedule for c in d.candidates] for _, d in rep.decisions], own, \
        list(rep.warnings), [len(c.times_s) for _, d in rep.decisions for c in d.candidates]


@pytest.mark.slow
def test_ranks_set_up_differently_measure_rank_0s_candidates_alike():
    (ok0, measured0, own0, _, n0), (ok1, measured1, own1, warned1, n1) = run_ranks(
        2, _different_settings, timeout_s=120)
    assert ok0 and ok1 and measured0 == measured1 == own0 != own1
    assert set(n0) == set(n1) == {1}
    assert any("rank 0's candidates are measured" in w for w in warned1), warned1


def _autocast_checkpoint_inference(rank, world):
    from torch.utils.checkpoint import checkpoint

    from plait import ops, tuning

    tuning.configure(calls=1, warmup=0, candidates=1)
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    w1 = torch.randn(6, 10, requires_grad=True)
    w2 = torch.randn(10, 4, requires_grad=True)

    def block(a):
        _, (h,) = ops.all_gather_matmul(a, [w1], schedule="auto")
        return ops.matmul_reduce_scatter(torch.relu(h), w2, schedule="auto")

    ok = True
    for _ in range(4):  # tuned while checkpointed under autocast: the recomputation is a call
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(block, x.requires_grad_(), use_reentrant=False)
        y.float().sum().backward()
        ok &= y.dtype is torch.bfloat16
    want = ops.matmul_reduce_scatter(torch.relu(ops.all_gather_matmul(
        x.detach(), [w1.detach()])[1][0]), w2.detach())
    with torch.inference_mode():
        for _ in range(3):  # tuned in inference mode: fp32, its own signatures
            ok &= torch.allclose(block(x.detach()), want, atol=1e-5)
    rep = tuning.report()
    return bool(ok), sorted({d.key.split()[2] for _, d in rep.decisions})


@pytest.mark.slow
def test_auto_under_autocast_checkpointing_and_inference_mode():
    assert run_ranks(2, _autocast_checkpoint_inference, timeout_s=120) == \
        [(True, ["bf16", "fp32"])] * 2


def _expert_pairs(rank, world):
    from plait import ops, tuning

    tuning.configure(calls=1, warmup=0, candidates=2)
    torch.manual_seed(rank)
    x = torch.randn(8 * world, 6)
    w1 = torch.randn(2, 6, 4)  # two local experts
    w2 = torch.randn(2, 4, 6)
    want_r, want_y = ops.all_to_all_matmul(x, w1, schedule="seq/sm")
    want_z = ops.matmul_all_to_all(want_y, w2, schedule="seq/sm")
    ok = True
    for _ in range(8):  # tuned, then decided
        r, y = ops.all_to_all_matmul(x, w1, schedule="auto")
        z = ops.matmul_all_to_all(y, w2, schedule="auto")
        ok &= torch.equal(r, want_r) and torch.allclose(y, want_y, atol=1e-5) and \
            torch.allclose(z, want_z, atol=1e-5)
    kinds = sorted({d.key.split()[0] for _, d in tuning.report().decisions})
    return bool(ok), kinds


@pytest.mark.slow
def test_expert_parallel_pairs_take_auto():
    assert run_ranks(2, _expert_pairs, timeout_s=120) == [(True, ["a2a", "mm_a2a"])] * 2
