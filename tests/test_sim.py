"""Simulator invariants on random DAGs, trace export, and failure modes."""

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.report.sim_trace import chrome_trace
from plait.sim.engine import Task, critical_path, graph, simulate

STREAMS = ["compute", "comm", "dma0", "dma1"]
CATS = {"compute": "compute", "comm": "sm_comm", "dma0": "dma", "dma1": "dma"}


@st.composite
def dags(draw):
    n = draw(st.integers(1, 25))
    tasks = []
    for i in range(n):
        stream = draw(st.sampled_from(STREAMS))
        # Depend only on earlier tasks: dependency order agrees with stream order.
        deps = tuple(sorted(draw(st.sets(st.sampled_from([t.name for t in tasks]), max_size=3))
                            )) if tasks else ()
        uses = {"hbm": draw(st.floats(0, 1)), **({"compute": 1.0} if stream == "compute"
                                                 else {"link": draw(st.floats(0, 1))})}
        reserves = {"compute": draw(st.floats(0, 0.5))} if stream == "comm" else {}
        slow = {c: draw(st.floats(0.5, 1)) for c in ("compute", "sm_comm", "dma")}
        tasks.append(Task(f"t{i}", stream, draw(st.floats(0, 10)), CATS[stream], deps,
                          uses, reserves, slow))
    return tasks


@given(dags())
def test_makespan_bounds(tasks):
    tl = simulate(tasks)
    total = sum(t.duration for t in tasks)
    busiest = max(sum(t.duration for t in tasks if t.stream == s) for s in STREAMS)
    eps = 1e-9 * max(1.0, total)
    index = {t.name: i for i, t in enumerate(tasks)}
    full_speed = critical_path(graph([STREAMS.index(t.stream) for t in tasks],
                                     [[index[d] for d in t.deps] for t in tasks]),
                               [t.duration for t in tasks])
    assert tl.makespan >= full_speed - eps  # contention only slows
    assert tl.makespan >= busiest - eps
    assert tl.makespan <= total + eps
    assert simulate(tasks) == tl  # deterministic


@given(dags())
def test_dependencies_and_stream_order_respected(tasks):
    tl = simulate(tasks)
    span = {s.task.name: s for s in tl.spans}
    assert len(span) == len(tasks)
    for t in tasks:
        for d in t.deps:
            assert span[t.name].start >= span[d].end - 1e-12
        assert span[t.name].duration >= t.duration - 1e-9  # contention never speeds up
    for s in STREAMS:
        mine = [span[t.name] for t in tasks if t.stream == s]
        for a, b in itertools.pairwise(mine):
            assert b.start >= a.end - 1e-12


def test_contention_slows_both_sides():
    gemm = Task("g", "compute", 1.0, "compute", uses={"compute": 1.0, "hbm": 0.2},
                slowdowns={"sm_comm": 0.9})
    comm = Task("c", "comm", 1.0, "sm_comm", uses={"hbm": 0.1}, reserves={"compute": 0.2},
                slowdowns={"compute": 0.95})
    tl = simulate([gemm, comm])
    span = {s.task.name: s for s in tl.spans}
    c_end = 1 / 0.95  # the collective, slowed by the GEMM beside it all along
    assert span["c"].duration == pytest.approx(c_end, rel=1e-6)
    # the GEMM runs on 80% of the compute units, 10% slower, while the collective runs; the
    # rest of its work at full speed after
    assert span["g"].duration == pytest.approx(c_end + 1 - 0.8 * 0.9 * c_end, rel=1e-6)
    assert tl.exposed() == pytest.approx(0.0)


def test_deadlock_is_reported_not_hung():
    a = Task("a", "s", 1.0, "compute", deps=("b",))
    b = Task("b", "s", 1.0, "compute")
    with pytest.raises(ValueError, match="deadlock"):
        simulate([a, b])
    with pytest.raises(ValueError, match="unknown task"):
        simulate([Task("a", "s", 1.0, "compute", deps=("zz",))])


def test_exposed_comm():
    tl = simulate([Task("c", "comm", 2.0, "sm_comm"),
                   Task("g", "compute", 1.0, "compute")])
    assert tl.exposed() == pytest.approx(1.0)


def test_chrome_trace_has_a_track_per_stream_and_flows():
    tasks = [Task("x", "dma0", 1.0, "dma"), Task("g", "compute", 1.0, "compute", deps=("x",))]
    trace = chrome_trace({"plan": simulate(tasks)})
    json.dumps(trace)
    ev = trace["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"dma0", "compute"} <= names
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == 2 and all(e["dur"] == pytest.approx(1e6) for e in xs)
    s = [e for e in ev if e["ph"] == "s"]
    f = [e for e in ev if e["ph"] == "f"]
    assert len(s) == len(f) == 1 and s[0]["id"] == f[0]["id"] and s[0]["tid"] != f[0]["tid"]


@pytest.mark.parametrize("direction", ["in", "out"])
def test_local_experts_reordered_rows_are_charged_when_the_runtime_reorders(direction):
    """Several experts and c > 1 sub-chunks: the ops reorder rows before and after the executor
    (`plait.ops.expert_blocks`); the collective-kernel all-to-all packs its steps. The simulator
    charges these copies, and only then."""
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import layout_copy_time, simulate_pair
    from plait.spec.hardware import load_hardware
    from plait.workload.operators import OverlapPair

    h100 = load_hardware("h100")

    def pair(experts):
        return OverlapPair.build("a2a" if direction == "in" else "mm_a2a", 4096 * experts,
                                 1024, 2048, 8, experts=experts)

    fine = Schedule.parse("fine/dma/c2/g1/M")
    run = simulate_pair(pair(4), fine, h100)
    spans = {sp.task.name: sp for sp in run.timeline.spans}
    before, after = layout_copy_time(pair(4), h100, fine)
    assert before > 0 and after > 0
    assert spans["reorder.in"].start == 0 and spans["reorder.in"].task.duration == before
    assert spans["reorder.out"].end == pytest.approx(run.time_s, rel=1e-12)
    assert spans["reorder.out"].task.duration == after
    # input: every expert's rows x K; outputs: x N (and the received x K for a dispatch); each
    # copy is one memory-bound kernel: a launch plus its bytes
    launch = h100.gpu.launch_overhead_s
    assert (after - launch) / (before - launch) == pytest.approx(
        (1024 + (2048 if direction == "in" else 0)) / 2048, rel=1e-9)
    # the collective-kernel all-to-all packs each step's blocks (a combine also unpacks)
    before, after = layout_copy_time(pair(1), h100, Schedule.parse("fine/sm/c2/g1/M"))
    assert (before > 0, after > 0) == ((True, False) if direction == "in" else (False, True))
    for experts, s in ((1, fine), (4, Schedule.parse("fine/dma/c1/g1/M")),
                       (1, Schedule.parse("p2p/sm/M"))):
        names = {sp.task.name for sp in simulate_pair(pair(experts), s, h100).timeline.spans}
        assert not names & {"reorder.in", "reorder.out"}
        assert layout_copy_time(pair(experts), h100, s) == (0.0, 0.0)


@given(dags(), st.integers(2, 4))
def test_folding_symmetric_streams_is_exact(tasks, copies):
    """Streams repeated with their own private resource fold into one in `simulate`; the
    timeline equals the unfolded event loop's, span for span."""
    from dataclasses import replace

    from plait.sim.engine import _run

    extra = []
    for c in range(copies):  # the same stream again, on its own "link", waiting on the same
        for t in tasks:
            if t.stream == "dma0":
                extra.append(replace(t, name=f"{t.name}~{c}", stream=f"dma0~{c}",
                                     uses={**t.uses, f"link{c}": 0.7}))
    tasks = [replace(t, uses={**t.uses, "linkx": 0.7}) if t.stream == "dma0" else t
             for t in tasks] + extra
    reference: list = []
    _run(tasks, {t.name: 1 for t in tasks}, set(), reference)
    folded = simulate(tasks).spans
    by_name = {sp.task.name: sp for sp in folded}
    assert len(folded) == len(reference)
    for sp in reference:
        got = by_name[sp.task.name]
        assert got.start == pytest.approx(sp.start, rel=1e-9, abs=1e-12)
        assert got.end == pytest.approx(sp.end, rel=1e-9, abs=1e-12)


def test_a_non_finite_duration_fails_loudly():
    tasks = [Task("a", "s0", float("inf"), "compute"), Task("b", "s1", 1.0, "dma")]
    with pytest.raises(ValueError, match="non-finite"):
        simulate(tasks)


@pytest.mark.parametrize("op", ["ag", "rs", "a2a", "mm_a2a"])
@pytest.mark.parametrize("experts", [1, 4])
def test_the_heuristics_programs_time_what_the_simulator_simulates(op, experts):
    """`pair_makespan` (the folded index program the heuristics evaluate) equals the
    simulation of `pair_tasks` (the unfolded tasks, layout copies included) for every kind
    of schedule, on a mesh and a switch: one lowering, one layout-copy rule, two forms."""
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import PairCosts, check_feasible, pair_makespan, simulate_pair
    from plait.spec.hardware import load_hardware
    from plait.workload.operators import OverlapPair

    if experts > 1 and op in ("ag", "rs"):
        pytest.skip("local experts are an all-to-all pair's")
    for hw in ("mi300x", "h100"):
        cluster = load_hardware(hw)
        pair = OverlapPair.build(op, 4096 * experts, 2048, 4096, 4, experts=experts)
        costs = PairCosts(pair, cluster)
        for text in ("seq/sm", "seq/dma", "p2p/sm/M", "p2p/dma/M", "fine/sm/c2/g1/M",
                     "fine/dma/c4/peer/M", "fine/dma/c4/g2/M", "fine/sm/c8/peer/M"):
            s = Schedule.parse(text)
            check_feasible(pair, s)
            want = simulate_pair(pair, s, cluster, costs).time_s
            assert pair_makespan(pair, s, cluster, costs) == pytest.approx(want, rel=1e-9), (
                hw, text)


@pytest.mark.parametrize("seed", range(3))
def test_a_pair_runs_figures_from_folded_tasks_equal_its_full_timelines(seed):
    """`simulate_pair` takes its figures from the folded tasks and builds the timeline of
    every task only when asked: the figures equal those of that timeline, for every candidate
    of random pairs (all-gather, reduce-scatter, expert all-to-all) on every preset."""
    import random

    from plait.errors import InfeasibleError
    from plait.planner.scenarios import scenario
    from plait.schedule.lower import Compute
    from plait.schedule.schedule import candidate_schedules
    from plait.sim.pair import PairCosts, check_feasible, simulate_pair
    from plait.spec.hardware import load_hardware

    rng = random.Random(seed)
    for experts in (False, False, True):
        hw, pair = scenario(rng, experts)
        cluster = load_hardware(hw)
        costs = PairCosts(pair, cluster)
        for s in candidate_schedules(pair.axis):
            try:
                check_feasible(pair, s)
            except InfeasibleError:
                continue
            r = simulate_pair(pair, s, cluster, costs)
            tl = r.timeline
            gemm = [sp for sp in tl.spans if isinstance(sp.task.args.get("op"), Compute)]
            assert r.time_s == pytest.approx(tl.makespan, rel=1e-12), (pair, s)
            assert r.exposed_comm_s == pytest.approx(tl.exposed(), rel=1e-12, abs=1e-18)
            assert r.decomposition_loss == pytest.approx(
                sum(sp.task.duration for sp in gemm) / r.gemm_whole_s - 1, abs=1e-12)
            assert r.contention_loss == pytest.approx(max(0.0, sum(
                sp.duration - sp.task.duration for sp in gemm)) / r.gemm_whole_s, abs=1e-12)
