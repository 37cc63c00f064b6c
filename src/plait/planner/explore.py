"""Explore: enumerate every legal schedule of each dependent pair, simulate, rank.

The chosen schedule is the simplest one simulated within `SIMPLER_WITHIN` (2%) of the fastest;
sequential is always a candidate, so a pair where decomposition and contention cost more than
overlap gains keeps the plain schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from plait.bulk import collector_paused
from plait.cost.host import EXECUTORS
from plait.errors import InfeasibleError
from plait.planner.heuristics import Pick, pick
from plait.schedule.lower import lowering_id
from plait.schedule.named import NAMED
from plait.schedule.schedule import (
    CommPattern,
    Schedule,
    candidate_schedules,
    simplest_within,
)
from plait.sim.layer import PhaseTimeline, megatron_group_pairs, simulate_layer, simulate_phase
from plait.sim.pair import PairCosts, PairRun, check_feasible, simulate_pair
from plait.sim.pipeline import idle_slots_s, stage_step_s
from plait.spec.hardware import ClusterSpec
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec
from plait.workload.operators import Layer, OverlapPair
from plait.workload.transformer import build_layer


@dataclass(frozen=True, slots=True)
class PairReport:
    """Every simulated schedule of one pair, ranked, with the named tools' points."""

    pair: OverlapPair
    runs: tuple[PairRun, ...]  # fastest first
    infeasible: dict[str, str] = field(default_factory=dict)  # schedule -> why
    heuristic: Pick | None = None  # what the heuristics pick, without simulating
    # the named tools' points as each tool runs them (`tool_run`); None: no point on this pair
    tools: dict[str, PairRun | None] = field(default_factory=dict)
    # why the layer runs this pair plainly although a schedule beats it alone ("": it does not)
    plain_in_layer: str = ""

    @property
    def heuristic_run(self) -> PairRun | None:
        return None if self.heuristic is None else self.run(self.heuristic.schedule)

    @property
    def chosen(self) -> PairRun:
        """The schedule the layer runs: the fastest alone, or the plain one where the layer
        overlaps it with its neighbours better (`plain_in_layer`)."""
        return self.sequential if self.plain_in_layer else self.runs[0]

    def run(self, s: Schedule) -> PairRun | None:
        return next((r for r in self.runs if r.schedule == s), None)

    @property
    def sequential(self) -> PairRun:
        run = self.run(Schedule())
        assert run is not None  # sequential is always feasible
        return run

    def best(self, comm: CommPattern) -> PairRun | None:
        return next((r for r in self.runs if r.schedule.comm is comm), None)

    def named(self, name: str) -> PairRun | None:
        if name in self.tools:
            return self.tools[name]
        s = NAMED[name](self.pair)
        return None if s is None else self.run(s)

    @property
    def speedup(self) -> float:
        return self.sequential.time_s / self.chosen.time_s


def tool_run(name: str, pair: OverlapPair, cluster: ClusterSpec,
             simulated: Callable[[Schedule], PairRun | None] | None = None) -> PairRun | None:
    """Named tool `name`'s point on `pair` as that tool runs it: its schedule, issued by its
    own executor where `cost.host.EXECUTORS` has it (PyTorch's async TP), else as plait
    issues it (`simulated(schedule)` where that run exists already); None where it has no
    point."""
    s = NAMED[name](pair)
    if s is None:
        return None
    try:
        check_feasible(pair, s)
    except InfeasibleError:  # the tool cannot cut this pair's shape as it would
        return None
    if name in EXECUTORS:
        return simulate_pair(pair, s, cluster, PairCosts(pair, cluster, EXECUTORS[name]))
    known = simulated(s) if simulated is not None else None
    return known if known is not None else simulate_pair(pair, s, cluster)


@collector_paused()
def explore_pair(pair: OverlapPair, cluster: ClusterSpec,
                 schedules: list[Schedule] | None = None, fast: bool = False) -> PairReport:
    """Simulate every candidate schedule of `pair` on `cluster`; fastest first.

    `fast`: only the heuristics' pick, sequential and the named tools' points are simulated."""
    costs = PairCosts(pair, cluster)
    if fast:
        heuristic = pick(pair, cluster, costs=costs)
        named = [f(pair) for f in NAMED.values()]
        schedules = list(dict.fromkeys([Schedule(), heuristic.schedule,
                                        *(s for s in named if s is not None)]))
    runs: list[PairRun] = []
    infeasible: dict[str, str] = {}
    order = {}
    same: dict[int, PairRun] = {}  # schedules that lower to the same ops
    for i, s in enumerate(schedules or candidate_schedules(pair.axis)):
        try:
            check_feasible(pair, s)
        except InfeasibleError as exc:
            infeasible[str(s)] = str(exc)
            continue
        order[s] = i
        sig = lowering_id(s, pair.ranks, pair.direction, pair.reduces)
        if sig in same:
            runs.append(replace(same[sig], schedule=s))
            continue
        same[sig] = simulate_pair(pair, s, cluster, costs)
        runs.append(same[sig])
    if not fast:  # the heuristics' own search, reading the times just simulated
        heuristic = pick(pair, cluster, costs=costs,
                         simulated={r.schedule: r.time_s for r in runs})
    # Fastest first; among equals (1e-9 relative) the simpler schedule, as enumerated. The
    # chosen one goes first: the simplest within SIMPLER_WITHIN of the fastest.
    runs.sort(key=lambda r: (round(r.time_s / max(r.ideal_s, 1e-30), 9), order[r.schedule]))
    chosen = (heuristic.schedule if fast  # the heuristics choose; the others are shown beside
              else simplest_within(runs, lambda r: r.time_s, lambda r: r.schedule).schedule)
    runs.sort(key=lambda r: r.schedule != chosen)
    report = PairReport(pair, tuple(runs), infeasible, heuristic)
    return replace(report, tools={name: tool_run(name, pair, cluster, report.run)
                                  for name in NAMED})


def explore_layer(layer: Layer, cluster: ClusterSpec, fast: bool = False,
                  progress: Callable[[str], None] | None = None) -> tuple[PairReport, ...]:
    """Every pair of the layer explored; `progress(pair name)` after each."""
    reports = []
    for p in layer.pairs:
        reports.append(explore_pair(p, cluster, fast=fast))
        if progress is not None:
            progress(p.name)
    return tuple(reports)


@dataclass(frozen=True, slots=True)
class Totals:
    """Per-layer and whole-step time and exposed communication of one set of schedules."""

    forward_s: float
    backward_s: float
    exposed_forward_s: float
    exposed_backward_s: float
    layers: int  # layers per pipeline stage
    micro_batches: int
    bubble_slots: float = 0.0  # idle micro-batch slots of the pipeline (ParallelSpec)

    @property
    def layer_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def layer_exposed_s(self) -> float:
        return self.exposed_forward_s + self.exposed_backward_s

    @property
    def step_s(self) -> float:
        """Every micro-batch's layers on one stage, plus the pipeline's bubble."""
        return stage_step_s(self.forward_s, self.backward_s, self.layers, self.micro_batches,
                            self.bubble_slots)

    @property
    def bubble_s(self) -> float:
        return idle_slots_s(self.forward_s, self.backward_s, self.layers, self.bubble_slots)

    @property
    def step_exposed_s(self) -> float:
        return self.layer_exposed_s * self.layers * self.micro_batches


@dataclass(frozen=True, slots=True)
class Exploration:
    """The explorer's answer for one model, parallel layout and cluster."""

    model: ModelSpec
    parallel: ParallelSpec
    cluster: ClusterSpec
    layer: Layer
    pairs: tuple[PairReport, ...]
    sequential: tuple[PhaseTimeline, PhaseTimeline]
    chosen: tuple[PhaseTimeline, PhaseTimeline]
    # what Megatron-LM runs with sequence parallelism and no --tp-comm-overlap (`sim.layer`)
    megatron: tuple[PhaseTimeline, PhaseTimeline] | None = None

    @property
    def plan(self) -> dict[str, str]:
        """Pair name -> chosen schedule text: the plan file the runtime reads."""
        return {r.pair.name: str(r.chosen.schedule) for r in self.pairs}

    def phases(self, which: str) -> tuple[PhaseTimeline, PhaseTimeline]:
        """The forward and backward timelines of `which`: "sequential", "megatron" (what
        Megatron-LM overlaps without --tp-comm-overlap), "chosen" (plait's plan), or a named
        tool of `NAMED` ("pytorch": PyTorch's async TP; `tool_phases`)."""
        if which == "chosen":
            return self.chosen
        if which == "megatron" and self.megatron is not None:
            return self.megatron
        if which == "sequential":
            return self.sequential
        if which in NAMED:
            return self.tool_phases(which)
        raise KeyError(which)

    def tool_phases(self, name: str) -> tuple[PhaseTimeline, PhaseTimeline]:
        """The layer as named tool `name` runs it: its point on each pair where it has one
        (as its own executor issues it: `tool_run`), the rest sequential, nothing else
        overlapped (simulated on each call)."""
        tools = {r.pair.name: run for r in self.pairs
                 if (run := r.tools.get(name)) is not None}
        return simulate_layer(self.layer, self.cluster,
                              {n: run.schedule for n, run in tools.items()},
                              {(n, str(run.schedule)): run for n, run in tools.items()})

    def totals(self, which: str) -> Totals:
        fwd, bwd = self.phases(which)
        return Totals(fwd.time_s, bwd.time_s, fwd.exposed_comm_s, bwd.exposed_comm_s,
                      self.model.layers // self.parallel.pp, self.parallel.num_micro_batches,
                      self.parallel.bubble_slots)

    @property
    def baseline(self) -> str:
        """What plait's speedups are against: Megatron-LM's own overlaps for training with
        Megatron's layer (the workload has a backward that re-gathers); plain sequential
        otherwise: inference, or a stack that keeps the gathered input (PyTorch's DTensor TP,
        whose vanilla backward overlaps nothing)."""
        training = self.megatron is not None and self.layer.backward
        return "megatron" if training and self.parallel.regather else "sequential"


def plain_where_overlaps_win(layer: Layer, cluster: ClusterSpec,
                             chosen: dict[str, Schedule],
                             runs: dict[tuple[str, str], PairRun]) -> dict[str, str]:
    """The pairs the layer runs plainly although a schedule beats each alone, and why: in the
    backward of a column-parallel linear run plainly, the re-gather runs beside the data
    gradient and the data gradient's reduce-scatter beside the weight gradient (Megatron-LM's
    overlaps, and plait's runtime's: `ops.dense._ag_backward`). Where that beats the linear's pairs
    under their own best schedules, its pairs run plainly (greedily, linear by linear)."""
    out: dict[str, str] = {}
    for ops, names in megatron_group_pairs(layer.backward, layer):
        if all(chosen[n] == Schedule() for n in names):
            continue
        trial = chosen | {n: Schedule() for n in names}
        # the phase is its blocks one after another: comparing the group's block suffices
        before, after = (simulate_phase("backward", ops, layer, cluster, plan, runs,
                                        plain_overlaps=True).time_s for plan in (chosen, trial))
        if after < before * (1 - 1e-9):
            why = (f"plain in the layer: run plainly, {' and '.join(names)} overlap as "
                   f"Megatron-LM's backward does (the reduce-scatter beside the weight "
                   f"gradient), {(before - after) * 1e6:,.0f} us faster")
            out |= {n: why for n in names if chosen[n] != Schedule()}
            chosen = trial
    return out


@collector_paused()
def explore(model: ModelSpec, parallel: ParallelSpec, cluster: ClusterSpec,
            fast: bool = False, progress: Callable[[str], None] | None = None) -> Exploration:
    """Explore every dependent pair of one layer and simulate the layer before and after.

    `fast`: schedules come from the heuristics instead of exhaustive simulation. `progress`:
    called with each pair's name once it is explored."""
    layer = build_layer(model, parallel)
    reports = explore_layer(layer, cluster, fast, progress)
    runs = {(r.pair.name, str(run.schedule)): run for r in reports for run in r.runs}
    chosen = {r.pair.name: r.chosen.schedule for r in reports}
    plain = plain_where_overlaps_win(layer, cluster, chosen, runs)
    reports = tuple(replace(r, plain_in_layer=plain[r.pair.name]) if r.pair.name in plain
                    else r for r in reports)
    chosen |= dict.fromkeys(plain, Schedule())
    return Exploration(model, parallel, cluster, layer, reports,
                       simulate_layer(layer, cluster, {}, runs),
                       simulate_layer(layer, cluster, chosen, runs, plain_overlaps=True),
                       simulate_layer(layer, cluster, {}, runs, megatron=True))
