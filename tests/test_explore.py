"""The explorer reproduces the qualitative facts of the FiCCO brief without per-case tuning."""

import gc
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.bulk import collector_paused
from plait.planner.explore import explore, explore_pair
from plait.planner.heuristics import pick
from plait.schedule.schedule import SIMPLER_WITHIN, CommPattern, Engine, Schedule, complexity
from plait.sim.pair import simulate_pair
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.operators import CollectiveKind, OverlapPair


def ag_pair(m, n, k, ranks=8):
    return OverlapPair.build("ag", m, n // ranks, k, ranks)


def comm_only_time(hw, s, m=65536, k=8192):
    """Time to gather with schedule `s` when the GEMM is negligible (gather speed)."""
    pair = ag_pair(m, 8, k)
    return simulate_pair(pair, s, load_hardware(hw)).time_s


def test_mesh_shard_p2p_gathers_several_times_slower_than_fine():
    p2p = comm_only_time("mi300x", Schedule(CommPattern.P2P, Engine.DMA))
    fine = comm_only_time("mi300x", Schedule(CommPattern.FINE, Engine.DMA, 8, 1))
    assert p2p / fine > 3.0


def test_switch_shard_p2p_and_fine_gather_about_equally():
    p2p = comm_only_time("h100", Schedule(CommPattern.P2P, Engine.DMA))
    fine = comm_only_time("h100", Schedule(CommPattern.FINE, Engine.DMA, 8, 1))
    assert 0.8 < p2p / fine < 1.25


@pytest.mark.parametrize("hw", ["mi300x", "h100"])
@pytest.mark.parametrize("mnk", [(1048576, 57344, 8192), (1607680, 57344, 8192)])
def test_large_compute_bound_shapes_approach_ideal(hw, mnk):
    r = explore_pair(ag_pair(*mnk), load_hardware(hw))
    assert r.chosen.gemm_whole_s > 2 * r.chosen.comm_whole_s  # compute-bound
    assert r.chosen.time_s <= 1.05 * r.chosen.ideal_s


@pytest.mark.parametrize("hw", ["mi300x", "h100"])
def test_small_m_keeps_a_sequential_schedule(hw):
    r = explore_pair(ag_pair(512, 4096 * 3, 4096), load_hardware(hw))
    fine = r.best(CommPattern.FINE)
    assert r.chosen.schedule.comm is CommPattern.SEQ
    assert fine is not None and fine.decomposition_loss > 0.3


@given(m=st.sampled_from([1024, 4096, 16384, 65536]), n=st.sampled_from([1024, 8192, 28672]),
       k=st.sampled_from([1024, 8192]), hw=st.sampled_from(["mi300x", "h100", "a40"]))
def test_ideal_speedup_at_most_two_and_chosen_never_worse(m, n, k, hw):
    r = explore_pair(ag_pair(m, n, k), load_hardware(hw))
    ideal = r.chosen.gemm_whole_s + r.chosen.comm_whole_s
    assert ideal / r.chosen.ideal_s <= 2.0 + 1e-12
    assert r.chosen.time_s <= r.sequential.time_s
    # the simplest within SIMPLER_WITHIN of the fastest goes first, the rest fastest first
    rest = r.runs[1:]
    assert all(a.time_s <= b.time_s * (1 + 1e-8) for a, b in itertools.pairwise(rest))
    fastest = min(x.time_s for x in r.runs)
    assert r.chosen.time_s <= fastest * (1 + SIMPLER_WITHIN)
    assert all(x.time_s > fastest * (1 + SIMPLER_WITHIN) for x in rest
               if complexity(x.schedule) < complexity(r.chosen.schedule))


def test_default_exploration_improves_and_reports_named_tools():
    e = explore(load_model("llama3-70b"), ParallelSpec(), load_hardware("mi300x"))
    assert len(e.pairs) == 10
    seq, plan = e.totals("sequential"), e.totals("chosen")
    assert plan.step_s < seq.step_s and plan.step_exposed_s < seq.step_exposed_s
    assert set(e.plan) == {r.pair.name for r in e.pairs}
    for r in e.pairs:
        if r.pair.collective.kind in (CollectiveKind.AG, CollectiveKind.RS):
            assert r.named("pytorch") is not None and r.named("te") is not None
        assert Schedule.parse(e.plan[r.pair.name]) == r.chosen.schedule


def test_moe_expert_parallel_pairs_are_all_to_all():
    e = explore(load_model("mixtral-8x7b"), ParallelSpec(tp=2, ep=4, dp=4, seq_len=4096),
                load_hardware("h100"))
    a2a = [r for r in e.pairs if r.pair.collective.kind is CollectiveKind.A2A]
    assert len(a2a) == 4 and all(r.named("pytorch") is None for r in a2a)


def test_schedule_map_follows_the_pair_and_marks_the_operating_point(monkeypatch, tmp_path):
    from plait.report import schedule_map

    seen = {}

    def fake(cells, path, title, **kw):
        seen.update(cells=cells, title=title, **kw)
        return path

    monkeypatch.setattr(schedule_map, "plot_schedule_map", fake)
    e = explore(load_model("llama3-8b"), ParallelSpec(tp=8, seq_len=4096), load_hardware("h100"),
                fast=True)
    for name in ("fc2", "qkv_wgrad"):
        schedule_map.write_schedule_map(e, tmp_path / "m.png", name)
        r = next(r for r in e.pairs if r.pair.name == name)
        assert name in seen["title"] and seen["mark"] in seen["cells"]
        assert seen["cells"][seen["mark"]] == str(r.chosen.schedule)  # the layer's own choice


def test_the_readmes_planning_example_runs_as_written() -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "from plait.planner.explore import explore" in b)
    scope: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["e"].plan and scope["run"].time_s > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("hw", ["h100", "a100", "mi300x"])
@pytest.mark.parametrize("op,m,ranks", [("ag", 4096, 8), ("rs", 16384, 8), ("ag", 2048, 4)])
def test_the_explorers_heuristic_column_is_the_heuristics_own_pick(hw, op, m, ranks):
    """Explore hands its simulated times to the heuristics' search instead of simulating again:
    the pick and its estimate are what the search finds alone."""
    cluster = load_hardware(hw)
    pair = OverlapPair.build(op, m, 8192, 8192, ranks)
    alone = pick(pair, cluster)
    shown = explore_pair(pair, cluster).heuristic
    assert shown is not None
    assert (shown.schedule, shown.estimate_s) == (alone.schedule, alone.estimate_s)


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_pauses_the_cyclic_collector_and_restores_it(enabled):
    seen = []
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with collector_paused():
            seen.append(gc.isenabled())
            with collector_paused():
                seen.append(gc.isenabled())
            seen.append(gc.isenabled())
        explore_pair(OverlapPair.build("ag", 1024, 512, 512, 2), load_hardware("h100"))
        assert seen == [False, False, False]
        assert gc.isenabled() is enabled  # as found, after a block and after planning
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.parametrize("hw,model,regather", [("mi300x", "llama3-70b", True),
                                               ("h100", "llama3-70b", False),
                                               ("a100", "llama3-8b", True),
                                               ("l20", "llama3-8b", False)])
def test_the_layer_keeps_a_linear_plain_where_its_backward_overlaps_win(hw, model, regather):
    """A pair's fastest schedule alone can lose, in the layer, to Megatron-LM's backward
    overlaps of a column-parallel linear run plainly (the re-gather beside the data gradient,
    its reduce-scatter beside the weight gradient; plait's runtime fills the reduce-scatter's
    wait with the weight gradient too). The layer keeps such pairs plain, says why, and so is
    never slower than the `megatron` layer in either phase; the plan holds what the layer
    runs."""
    e = explore(load_model(model), ParallelSpec(tp=8, seq_len=8192, regather=regather),
                load_hardware(hw))
    for phase in ("forward_s", "backward_s"):
        assert getattr(e.totals("chosen"), phase) <= getattr(e.totals("megatron"), phase) * (
            1 + 1e-9)
    for r in e.pairs:
        if r.plain_in_layer:
            assert "plain in the layer" in r.plain_in_layer
            assert r.chosen.schedule == Schedule() != r.runs[0].schedule
        assert e.plan[r.pair.name] == str(r.chosen.schedule)
    if hw == "mi300x":  # the default exploration: the QKV linear's backward stays plain
        assert e.pairs[[r.pair.name for r in e.pairs].index("qkv_dgrad")].plain_in_layer
