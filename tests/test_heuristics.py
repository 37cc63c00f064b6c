"""Heuristics: feasible, explained, fast mode, and close to exhaustive search."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.explore import explore, explore_pair
from plait.planner.heuristics import pick
from plait.planner.scenarios import HARDWARE, scenario
from plait.schedule.lower import lower, signature
from plait.schedule.schedule import CommPattern, Schedule
from plait.sim.pair import check_feasible, simulate_pair
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.operators import OverlapPair


@given(rows=st.integers(1, 1 << 14), ranks=st.sampled_from([1, 2, 3, 4, 8]),
       hw=st.sampled_from(["mi300x", "h100", "a40", "cpu"]), out=st.booleans())
def test_pick_is_feasible_and_explained(rows, ranks, hw, out):
    m = rows * ranks  # a pair's gathered dimension always splits into shards
    pair = OverlapPair.build("rs" if out else "ag", m, 1024, 2048, ranks)
    h = pick(pair, load_hardware(hw))
    check_feasible(pair, h.schedule)
    assert h.estimate_s > 0 and h.reason
    if ranks == 1:
        assert h.schedule == Schedule()


def test_candidates_restrict_the_choice():
    pair = OverlapPair.build("ag", 8192, 1024, 8192, 8)
    allowed = [Schedule(), Schedule.parse("p2p/dma/M")]
    assert pick(pair, load_hardware("mi300x"), allowed).schedule in allowed


def test_mesh_never_gets_shard_level_p2p():
    pair = OverlapPair.build("ag", 65536, 1024, 8192, 8)
    assert pick(pair, load_hardware("mi300x")).schedule.comm is not CommPattern.P2P


@pytest.mark.parametrize("experts", [False, True])
def test_the_pick_is_what_exhaustive_search_chooses(experts):
    """The search prunes with lower bounds only, so it chooses what simulating every
    candidate chooses (or a schedule that lowers to the same ops), on every kind of pair.
    (bench/heuristics_eval.py measures it on 1000 scenarios per seed.)"""
    rng = random.Random(7)
    clusters = {h: load_hardware(h) for h in HARDWARE}
    for _ in range(30):
        hw, pair = scenario(rng, experts)
        report = explore_pair(pair, clusters[hw])
        h = pick(pair, clusters[hw])
        ops = [lower(s, pair.ranks, pair.direction, pair.reduces)
               for s in (h.schedule, report.chosen.schedule)]
        assert signature(ops[0]) == signature(ops[1]), (hw, pair, h.schedule)
        assert h.estimate_s == pytest.approx(report.chosen.time_s, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(["ag", "rs", "a2a", "mm_a2a"]), rows=st.sampled_from([64, 512, 4096]),
       n=st.sampled_from([256, 4096]), k=st.sampled_from([512, 8192]),
       ranks=st.sampled_from([2, 3, 4, 6, 8]), experts=st.sampled_from([1, 2]),
       hw=st.sampled_from(["mi300x", "h100", "a40", "cpu", "cpu-calibrated", "h100x2"]))
def test_the_pick_is_exhaustive_searchs_on_any_pair_and_cluster(op, rows, n, k, ranks, experts,
                                                                 hw):
    """Odd group sizes, groups across nodes (a NIC route), a measured GEMM grid in place of
    the GEMM model, all four pair kinds: the search still chooses what simulating every
    candidate chooses, with the same estimate."""
    from pathlib import Path

    from plait.spec.calibration import load_calibration

    if hw == "cpu-calibrated":
        cluster = load_calibration(Path(__file__).resolve().parents[1] / "data"
                                   / "calibrations" / "cpu-ci.yaml").apply(load_hardware("cpu"))
    elif hw == "h100x2":
        cluster = load_hardware("h100").with_(nodes=2, gpus_per_node=4)
    else:
        cluster = load_hardware(hw)
    experts = experts if op in ("a2a", "mm_a2a") else 1
    pair = OverlapPair.build(op, rows * ranks * experts, n, k, ranks, experts=experts)
    report = explore_pair(pair, cluster)
    h = pick(pair, cluster)
    ops = [lower(s, pair.ranks, pair.direction, pair.reduces)
           for s in (h.schedule, report.chosen.schedule)]
    assert signature(ops[0]) == signature(ops[1]), (h.schedule, report.chosen.schedule)
    assert h.estimate_s == pytest.approx(report.chosen.time_s, rel=1e-9)


def test_fast_explore_simulates_only_the_pick_and_references():
    full = explore(load_model("llama3-8b"), ParallelSpec(seq_len=4096), load_hardware("h100"))
    fast = explore(load_model("llama3-8b"), ParallelSpec(seq_len=4096), load_hardware("h100"),
                   fast=True)
    for f, e in zip(fast.pairs, full.pairs, strict=True):
        assert f.heuristic is not None and f.runs[0].schedule == f.heuristic.schedule
        assert f.chosen.schedule == (Schedule() if f.plain_in_layer else f.heuristic.schedule)
        assert len(f.runs) <= 4 < len(e.runs)
        assert f.runs[0].time_s >= e.runs[0].time_s * (1 - 1e-9)  # never better than exhaustive
    assert fast.totals("chosen").step_s == pytest.approx(full.totals("chosen").step_s, rel=0.1)


@given(m=st.sampled_from([2048, 8192, 65536]), n=st.sampled_from([1024, 8192]),
       k=st.sampled_from([1024, 8192]), ranks=st.sampled_from([2, 3, 4, 8]),
       op=st.sampled_from(["ag", "rs", "a2a", "mm_a2a"]), experts=st.sampled_from([1, 2]),
       hw=st.sampled_from(["mi300x", "h100", "a40", "cpu"]),
       s=st.sampled_from(["seq/dma", "p2p/dma/M", "p2p/sm/M", "fine/sm/c4/g1/M",
                          "fine/sm/c8/peer/M", "fine/dma/c2/g1/M", "fine/dma/c16/g1/M",
                          "fine/dma/c4/peer/M", "fine/dma/c8/g2/M"]))
def test_the_estimate_is_the_simulators_time(m, n, k, ranks, op, experts, hw, s):
    """One performance model: a heuristic estimate is the simulated time of the very tasks
    the explorer simulates (folded where peers are symmetric), on every topology."""
    cluster = load_hardware(hw)
    experts = experts if op in ("a2a", "mm_a2a") else 1
    pair = OverlapPair.build(op, m * ranks * experts, n, k, ranks, experts=experts)
    schedule = Schedule.parse(s)
    simulated = simulate_pair(pair, schedule, cluster).time_s
    assert pick(pair, cluster, [schedule]).estimate_s == pytest.approx(simulated, rel=1e-9)
