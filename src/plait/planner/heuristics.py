"""Heuristics: pick a schedule in a fraction of a millisecond, with a one-line reason.

The heuristics hold no model of their own: a candidate's time is the simulator's makespan of
the very tasks it would simulate (`plait.sim.pair`, the lowered ops costed by the one cost
model, folded where peers are symmetric). What they add is the search, a branch and bound
over the explorer's own candidates (`candidate_schedules`) that simulates few of them and
still chooses what exhaustive simulation chooses:

1. A group of one rank has nothing to overlap: sequential.
2. Every feasible candidate gets a lower bound from its costed tasks alone: the busiest
   stream's work at full speed (contention only slows a task). Schedules that lower to the
   same ops share one evaluation.
3. Best first: the candidate with the lowest bound is taken next. A bound from the stream's
   work is first refined to the critical path at full speed (and the candidate goes back in
   line); a critical-path bound is then simulated, the simulation stopping as soon as it
   cannot matter. The search ends when the lowest bound left exceeds the fastest time found
   by more than `SIMPLER_WITHIN`: nothing left could be chosen.
4. A candidate that cannot change the choice is not simulated: one no simpler than the
   current choice that cannot be the fastest, or one as simple that cannot be faster. When
   the choice moves, those passed over that became relevant are simulated (`settle`).
5. The simplest schedule within `SIMPLER_WITHIN` of the fastest wins (`simplest_within`, as
   the explorer chooses), so overlap only when it beats sequential by more than that.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from plait.bulk import collector_paused
from plait.cost.comm import collective_time
from plait.errors import InfeasibleError
from plait.schedule.lower import lowering_id
from plait.schedule.schedule import (
    SIMPLER_WITHIN,
    CommPattern,
    Engine,
    Schedule,
    candidate_schedules,
    complexity,
    simplest_within,
)
from plait.sim.engine import critical_path
from plait.sim.pair import (
    LAYOUT_OUT,
    PairCosts,
    Program,
    TaskShape,
    check_feasible,
    layout_copy_time,
    pair_program,
    program_makespan,
    work_floor,
)
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import OverlapPair


@dataclass(frozen=True, slots=True)
class Pick:
    schedule: Schedule
    estimate_s: float
    reason: str
    simulated: int = 0  # candidates the search simulated (in full or until they lost)


@collector_paused()
def pick(pair: OverlapPair, cluster: ClusterSpec,
         candidates: Iterable[Schedule] | None = None, costs: PairCosts | None = None,
         simulated: Mapping[Schedule, float] | None = None) -> Pick:
    """The heuristic's schedule for `pair` on `cluster`, its estimate and a one-line reason.

    `candidates` restricts the choice (default: the explorer's candidates); `costs`: the
    pair's memoized costs to use and fill (the explorer shares them with its simulations);
    `simulated`: makespans already simulated with these costs (the explorer's), read instead
    of simulating again: the same numbers, so the same search and the same choice."""
    if costs is None:
        costs = PairCosts(pair, cluster)
    elif costs.pair != pair or costs.cluster is not cluster:
        raise ValueError("pick: `costs` were worked out for another pair or cluster")
    if pair.ranks == 1:
        return Pick(Schedule(), costs.whole().duration, "one rank: nothing to overlap")
    search = _Search(pair, cluster, costs, _space(pair, cluster, costs) if candidates is None
                     else _build_space(pair, cluster, costs, list(candidates)), simulated)
    search.run()
    search.settle()
    estimates = search.estimates()
    if not estimates:
        raise InfeasibleError(f"no candidate schedule can run on pair {pair.name}: its split "
                              f"dimension does not divide into {pair.ranks} shards of the "
                              "candidates' sub-chunks")
    near = [e for e in estimates if e[1] <= search.fastest * (1 + SIMPLER_WITHIN)]
    chosen = simplest_within(near, lambda e: e[1], lambda e: e[0])
    slower = [e for e in estimates if e[1] > chosen[1] * (1 + 1e-6)]
    runner_up = min(slower, key=lambda e: e[1]) if slower else None
    return Pick(chosen[0], chosen[1], _reason(pair, cluster, costs, chosen, runner_up),
                search.simulated)


@dataclass(frozen=True, slots=True)
class _Candidate:
    schedule: Schedule
    lowering: int  # its lowering's number: equal lowerings take equal time
    complexity: tuple[int, int, int]
    program: Program
    costs: tuple[int, ...]  # per shape of the program: its entry in `_Space.costs`
    work: tuple[tuple[tuple[int, int], ...], ...]  # `Program.work` by entries


@dataclass(frozen=True, slots=True)
class _Space:
    """The feasible candidates of a pair and what they need costed: each distinct (sub-chunks,
    task shape) once, a layout copy as (its schedule, 0 before or 1 after)."""

    candidates: tuple[_Candidate, ...]
    costs: tuple[tuple[int, TaskShape] | tuple[Schedule, int], ...]


_SPACES: dict[tuple[object, ...], _Space] = {}


def _space(pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts) -> _Space:
    """The explorer's candidates for `pair`, built once per structure: which schedules can run,
    what they lower to and which of their tasks cost the same depend on the group, the
    direction, the axis, which sub-chunk counts divide the split dimension, the kind of pair
    (the layout copies) and the routes, not on the sizes."""
    divides = tuple(c for c in (1, 2, 4, 8, 16) if pair.split_extent % (pair.ranks * c) == 0)
    key = (pair.ranks, pair.direction, pair.reduces, pair.axis, divides, pair.collective.kind,
           pair.gemm.count > 1, cluster.gpu.dma.engines, costs.routes)
    space = _SPACES.get(key)
    if space is None:
        space = _SPACES[key] = _build_space(pair, cluster, costs,
                                            list(candidate_schedules(pair.axis)))
    return space


def _build_space(pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts,
                 schedules: Sequence[Schedule]) -> _Space:
    candidates = []
    entries: dict[object, int] = {}
    what: list[tuple[int, TaskShape] | tuple[Schedule, int]] = []
    for s in schedules:
        try:
            check_feasible(pair, s)
        except InfeasibleError:
            continue
        prog = pair_program(pair, s, cluster, costs.routes)
        index = []
        for sh in prog.shapes:
            entry: tuple[int, TaskShape] | tuple[Schedule, int]
            key: tuple[object, ...]
            if isinstance(sh, str):
                entry, key = (s, int(sh == LAYOUT_OUT)), (s, sh)
            else:
                entry, key = (s.steps, sh), (s.steps, sh.cost)
            if key not in entries:
                entries[key] = len(what)
                what.append(entry)
            index.append(entries[key])
        work = tuple(tuple((index[k], n) for k, n in stream) for stream in prog.work)
        candidates.append(_Candidate(s, lowering_id(s, pair.ranks, pair.direction, pair.reduces),
                                     complexity(s), prog, tuple(index), work))
    return _Space(tuple(candidates), tuple(what))


class _Search:
    """The times of one pick over `space`, each lowering simulated at most once, best first
    (see the module's rules 2-4). `times` holds every candidate taken up, by its index: its
    simulated time, or a lower bound of it for those in `bounded`."""

    def __init__(self, pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts,
                 space: _Space, simulated: Mapping[Schedule, float] | None = None) -> None:
        self.pair, self.cluster, self.costs, self.space = pair, cluster, costs, space
        self._known = simulated or {}  # makespans simulated before the search
        self.times: dict[int, float] = {}
        self.bounded: set[int] = set()  # times that may be lower bounds only
        self.fastest = math.inf
        self.simulated = 0
        self._same: dict[int, tuple[float, bool]] = {}  # lowering -> (time or bound, exact)
        self._choice: int | None = None
        self._choice_stale = True  # an exact time came in since `choice` was last worked out
        self._seconds: list[float] = []  # per entry of `space.costs`
        self._by_lowering: dict[int, tuple[list[float], list[float]]] = {}  # `_costed`

    def estimates(self) -> list[tuple[Schedule, float]]:
        """The simulated candidates and their times."""
        return [(self.space.candidates[i].schedule, t) for i, t in self.times.items()
                if i not in self.bounded]

    def choice(self) -> int | None:
        """The candidate chosen from the times so far."""
        if self._choice_stale:
            band = self.fastest * (1 + SIMPLER_WITHIN)
            near = [(i, t) for i, t in self.times.items() if t <= band and i not in self.bounded]
            cands = self.space.candidates
            self._choice = (simplest_within(near, lambda e: e[1],
                                            lambda e: cands[e[0]].schedule)[0]
                            if near else None)
            self._choice_stale = False
        return self._choice

    def run(self) -> None:
        """Rules 2-4."""
        costs, pair, cluster, space = self.costs, self.pair, self.cluster, self.space
        seconds = [costs.seconds(e[1], e[0]) if isinstance(e[1], TaskShape) else
                   layout_copy_time(pair, cluster, e[0])[e[1]] for e in space.costs]
        self._seconds = seconds
        line = [(work_floor(cand.work, seconds), 0, i)  # (bound, refined, index)
                for i, cand in enumerate(space.candidates)]
        heapq.heapify(line)
        while line:
            bound, refined, i = heapq.heappop(line)
            if bound > self.fastest * (1 + SIMPLER_WITHIN):
                break  # every bound left is at least as high
            cand = space.candidates[i]
            if not refined:
                path = critical_path(cand.program.graph, self._costed(cand)[1])
                if path > bound:
                    heapq.heappush(line, (path, 1, i))
                    continue
            known = self._same.get(cand.lowering)
            if known is None or not known[1]:
                above = self._above(cand.complexity)
                if bound > above:
                    known = (max(bound, known[0]) if known else bound, False)
                elif known is None or known[0] <= above:
                    known = self._simulate(cand, above)
                self._same[cand.lowering] = known
            self._record(i, known)

    def _costed(self, cand: _Candidate) -> tuple[list[float], list[float]]:
        """The seconds of `cand`'s program shapes and of its tasks (once per lowering)."""
        costed = self._by_lowering.get(cand.lowering)
        if costed is None:
            costed = self._by_lowering[cand.lowering] = (
                shapes := [self._seconds[j] for j in cand.costs],
                cand.program.durations(shapes))
        return costed

    def _simulate(self, cand: _Candidate, above: float = math.inf) -> tuple[float, bool]:
        self.simulated += 1
        t = self._known.get(cand.schedule)
        if t is None:  # (a simulation stopped past `above` returns a lower bound past it)
            shapes, durations = self._costed(cand)
            t = program_makespan(cand.program, cand.schedule, shapes, durations, self.costs,
                                 above)
        return t, t <= above

    def _above(self, cx: tuple[int, int, int]) -> float:
        """The time past which a candidate of complexity `cx` cannot change the choice."""
        ch = self.choice()
        if ch is None or cx < self.space.candidates[ch].complexity:
            return self.fastest * (1 + SIMPLER_WITHIN)
        if cx > self.space.candidates[ch].complexity:
            return self.fastest  # it matters only if it is the fastest
        return self.times[ch]  # equally simple: only if it is faster

    def _record(self, i: int, known: tuple[float, bool]) -> None:
        self.times[i] = known[0]
        if known[1]:
            self.bounded.discard(i)
            if known[0] < self.fastest:
                self.fastest = known[0]
            self._choice_stale = True
        else:
            self.bounded.add(i)

    def settle(self) -> None:
        """Simulate every candidate passed over that could now be chosen: its bound within
        `SIMPLER_WITHIN` of the fastest and it simpler than the choice (or as simple and
        faster)."""
        cands = self.space.candidates
        while True:
            ch = self.choice()
            band = self.fastest * (1 + SIMPLER_WITHIN)
            late = [i for i in self.bounded if self.times[i] <= band and (
                ch is None or cands[i].complexity < cands[ch].complexity
                or (cands[i].complexity == cands[ch].complexity
                    and self.times[i] < self.times[ch]))]
            if not late:
                return
            for i in late:
                known = self._same[cands[i].lowering]
                if not known[1]:
                    known = self._same[cands[i].lowering] = self._simulate(cands[i])
                self._record(i, known)


def _reason(pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts,
            best: tuple[Schedule, float], runner_up: tuple[Schedule, float] | None) -> str:
    s, est = best
    g_whole = costs.whole().duration
    comm = costs.collective_s
    ratio = g_whole / comm if comm > 0 else math.inf
    head = (f"GEMM {g_whole * 1e6:,.0f} us vs transfer {comm * 1e6:,.0f} us "
            f"(x{ratio:.2f}) on {pair.ranks} ranks, {cluster.topology.kind}")
    nxt = "" if runner_up is None else (
        f"; next best simulated {runner_up[0]} est. {runner_up[1] * 1e6:,.0f} us "
        f"(+{runner_up[1] / est - 1:.1%})")
    if s.comm is CommPattern.SEQ:
        return (f"{head}: no overlap beats sequential (piece and step overheads exceed the "
                f"{min(g_whole, comm) * 1e6:,.0f} us it could hide); {s.engine} moves it "
                f"faster{nxt}")
    how = "one peer per step" if s.comm is CommPattern.P2P else \
        f"{s.chunks} sub-chunk step(s) with all peers at once"
    eng = ("copy engines: no compute units taken, command overhead amortized"
           if s.engine is Engine.DMA else
           "collective kernels: cheaper than per-peer copy commands here")
    seq = g_whole + collective_time(pair.collective, cluster)
    gain = seq / est if est > 0 else 1.0
    return f"{head}: {how}; {eng}; est. {est * 1e6:,.0f} us (x{gain:.2f} vs seq/sm){nxt}"
