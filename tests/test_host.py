"""Host issue (`plait.cost.host`): the host as a resource every op of a schedule holds."""

import pytest

from plait.cost.host import HOST, PLAIT, PYTORCH_ASYNC_TP, host_use
from plait.cost.resources import Cost
from plait.schedule.lower import Compute, Transfer, lower
from plait.schedule.schedule import Schedule
from plait.sim.pair import PairCosts, simulate_pair
from plait.spec.hardware import ClusterSpec, load_hardware
from plait.workload.operators import OverlapPair


def _with_host(cluster: ClusterSpec, seconds: float) -> ClusterSpec:
    return cluster.with_(params=cluster.params.model_copy(
        update={"host_call_s": seconds}).model_dump())


def test_an_op_takes_at_least_its_issue_and_holds_the_host_for_it():
    kernel = Cost(10e-6, {"compute": 1.0, "hbm": 0.5})
    c = host_use(kernel, 3e-6, 2e-6)  # issue shorter than the work (kernel and copies)
    assert c.duration == 10e-6
    assert c.uses[HOST] == pytest.approx(3e-6 / 12e-6) and c.uses["hbm"] == 0.5
    c = host_use(kernel, 24e-6, 2e-6)  # issue longer: the op waits for the host
    assert c.duration + 2e-6 == pytest.approx(24e-6)
    assert c.uses[HOST] == 1.0 and c.uses["hbm"] == pytest.approx(0.25)
    assert host_use(kernel, 0.0) == kernel


def test_a_host_bound_schedule_takes_the_host_time_of_its_calls():
    """Pieces and copies far shorter than their issue: the schedule runs at the host's pace,
    the sum of every op's calls, however many streams the ops spread over."""
    h = 50e-6
    cluster = _with_host(load_hardware("h100"), h)
    pair = OverlapPair.build("ag", 64, 256, 256, 4, dtype="bf16")
    s = Schedule.parse("p2p/dma/M")
    ops = lower(s, 4, "in", False)
    for ex in (PLAIT, PYTORCH_ASYNC_TP):
        calls = sum(ex.compute if isinstance(op, Compute) else ex.copy_in for op in ops
                    if isinstance(op, Compute | Transfer))
        t = simulate_pair(pair, s, cluster, PairCosts(pair, cluster, ex)).time_s
        assert t == pytest.approx(calls * h, rel=0.02), ex.name


def test_host_issue_only_slows_and_costs_nothing_at_zero():
    base = load_hardware("h100")
    pair = OverlapPair.build("rs", 2048, 4096, 14336, 8, dtype="bf16")
    for text in ("seq/sm", "p2p/dma/M", "fine/sm/c4/g1/M", "fine/dma/c2/peer/M"):
        s = Schedule.parse(text)
        free = simulate_pair(pair, s, _with_host(base, 0.0)).time_s
        issued = simulate_pair(pair, s, base).time_s
        slow = simulate_pair(pair, s, _with_host(base, 20e-6)).time_s
        assert free <= issued * (1 + 1e-12) and issued <= slow * (1 + 1e-12), text


def test_small_pieces_fall_back_to_the_plain_path_once_issue_counts():
    """The case issue 27 names: at small M the decomposed schedules' steps cost more to issue
    than they hide, so the explorer keeps the plain collective + GEMM; without host issue it
    predicted overlap faster there."""
    from plait.planner.explore import explore
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import load_model

    model, par = load_model("llama3-8b"), ParallelSpec(tp=8, seq_len=512)
    plans = {h: explore(model, par, _with_host(load_hardware("h100"), h)).plan
             for h in (0.0, 5e-6)}
    assert any(s != "seq/sm" for s in plans[0.0].values())
    assert all(s == "seq/sm" for s in plans[5e-6].values())


def test_pytorchs_point_is_issued_by_pytorchs_executor():
    """explore's PyTorch column runs its schedule with PyTorch's host calls: fewer than plait's
    executor makes per step, so faster where issue sets the pace, and the same run where the
    host costs nothing."""
    from plait.planner.explore import explore_pair, tool_run

    pair = OverlapPair.build("rs", 512, 4096, 1024, 8, dtype="bf16")
    for h in (0.0, 20e-6):
        cluster = _with_host(load_hardware("h100"), h)
        report = explore_pair(pair, cluster)
        theirs = report.named("pytorch")
        ours = report.run(Schedule.parse("p2p/dma/M"))
        assert theirs is not None and ours is not None
        assert theirs.time_s == pytest.approx(tool_run("pytorch", pair, cluster).time_s)
        if h:
            assert theirs.time_s < ours.time_s
        else:
            assert theirs.time_s == pytest.approx(ours.time_s, rel=1e-12)


def test_pytorchs_fused_op_is_predicted_beside_the_candidates_it_is_measured_with():
    """On CUDA, `schedule="auto"` measures PyTorch's fused op as a named candidate: its
    prediction is explore's PyTorch point, so its verdict compares like with like."""
    from plait.planner.explore import tool_run
    from plait.tuning.tuner import torch_fused_prediction

    cluster = load_hardware("h100")
    pair = OverlapPair.build("ag", 2048, 3584, 8192, 8, dtype="bf16")
    run = tool_run("pytorch", pair, cluster)
    assert run is not None and torch_fused_prediction(pair, cluster) == run.time_s
    assert torch_fused_prediction(OverlapPair.build("a2a", 4096, 1024, 2048, 8), cluster) is None
