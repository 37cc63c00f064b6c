"""Heuristics: pick a schedule in a fraction of a millisecond, with a one-line reason.

The heuristics hold no model of their own: a candidate's estimate is the simulator's makespan
of the very tasks it would simulate (`plait.sim.pair.pair_tasks`, the lowered ops costed by
the one cost model, folded where peers are symmetric). What they add is the search policy:

1. A group of one rank has nothing to overlap: sequential.
2. The candidates: sequential on either engine; shard-level P2P except on a full mesh (where a
   step would use one link of P-1); finer grain with c = 1, 2, 4, 8, 16 sub-chunks, a piece per
   step, per (step, peer) or per g = 2, 4, ... steps, on either engine.
3. Branch and bound: every candidate first gets a cheap lower bound from its tasks (the compute
   stream's work, or one engine queue's, alone and at full speed: contention only slows); they
   are simulated in order of that bound, until the next bound exceeds the best time found by
   more than `SIMPLER_WITHIN` (nothing later could be chosen).
4. The simplest schedule within `SIMPLER_WITHIN` of the fastest wins (`simplest_within`, as
   the explorer chooses), so overlap only when it beats sequential by more than that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from plait.cost.comm import collective_time
from plait.errors import InfeasibleError
from plait.schedule.lower import lowering_id
from plait.schedule.schedule import (
    PER_PEER,
    SIMPLER_WITHIN,
    CommPattern,
    Engine,
    Schedule,
    complexity,
    simplest_within,
)
from plait.sim.pair import PairCosts, check_feasible, pair_makespan
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import OverlapPair

CHUNKS = (1, 2, 4, 8, 16)
GROUPS = (1, PER_PEER, 2, 4, 8, 16)
ENGINE_MARGIN = 0.05  # an engine this much slower at one piece per step is not searched further


@dataclass(frozen=True, slots=True)
class Pick:
    schedule: Schedule
    estimate_s: float
    reason: str


def pick(pair: OverlapPair, cluster: ClusterSpec,
         candidates: Iterable[Schedule] | None = None) -> Pick:
    """The heuristic's schedule for `pair` on `cluster`, its estimate and a one-line reason.

    `candidates` restricts the choice (default: the search of rules 2-3)."""
    costs = PairCosts(pair, cluster)
    if pair.ranks == 1:
        return Pick(Schedule(), costs.gemm(pair.gemm).duration, "one rank: nothing to overlap")
    search = _Search(pair, cluster, costs)
    if candidates is None:
        search.policy()
    else:
        for s in candidates:
            search.estimate(s)
    search.settle()
    estimates = [(s, t) for s, t in search.times.items() if s not in search.bounded] or [
        (Schedule(), search.estimate(Schedule(), exact=True))]
    near = [e for e in estimates if e[1] <= search.fastest * (1 + SIMPLER_WITHIN)] or estimates
    chosen = simplest_within(near, lambda e: e[1], lambda e: e[0])
    slower = [e for e in estimates if e[1] > chosen[1] * (1 + 1e-6)]
    runner_up = min(slower, key=lambda e: e[1]) if slower else None
    return Pick(chosen[0], chosen[1], _reason(pair, cluster, costs, chosen, runner_up))


class _Search:
    """The estimates of one pick, each candidate simulated at most once. A candidate that
    cannot change the choice is not simulated (a lower bound of its time stands in): one that
    cannot come within `SIMPLER_WITHIN` of the fastest, or one no simpler than the current
    choice that cannot be the fastest. `settle` simulates the ones passed over that became
    relevant as the choice moved."""

    def __init__(self, pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts) -> None:
        self.pair, self.cluster, self.costs = pair, cluster, costs
        self.times: dict[Schedule, float] = {}
        self.bounded: set[Schedule] = set()  # times that may be lower bounds only
        self.fastest = math.inf
        self._same: dict[int, tuple[float, bool]] = {}  # equal lowerings take equal time
        self._choice: Schedule | None = None
        self._choice_stale = True  # an exact time came in since `choice` was last worked out

    def choice(self) -> Schedule | None:
        if self._choice_stale:
            band = self.fastest * (1 + SIMPLER_WITHIN)
            near = [(s, t) for s, t in self.times.items()
                    if t <= band and s not in self.bounded]
            self._choice = (simplest_within(near, lambda e: e[1], lambda e: e[0])[0]
                            if near else None)
            self._choice_stale = False
        return self._choice

    def estimate(self, s: Schedule, exact: bool = False) -> float:
        if s not in self.times or (exact and s in self.bounded):
            try:
                check_feasible(self.pair, s)
            except InfeasibleError:
                return math.inf
            p = self.pair
            sig = lowering_id(s, p.ranks, p.direction, p.reduces)
            known = self._same.get(sig)
            if known is None or (exact and not known[1]):
                above = math.inf if exact else self.fastest * (1 + SIMPLER_WITHIN)
                ch = None if exact else self.choice()
                if ch is not None and complexity(s) > complexity(ch):
                    above = self.fastest  # it matters only if it is the fastest
                elif ch is not None and complexity(s) == complexity(ch):
                    above = self.times[ch]  # equally simple: only if it is faster
                t = pair_makespan(p, s, self.cluster, self.costs, above=above)
                known = self._same[sig] = (t, t <= above)
            self.times[s] = known[0]
            if known[1]:
                self.bounded.discard(s)
                self.fastest = min(self.fastest, known[0])
                self._choice_stale = True
            else:
                self.bounded.add(s)
        return self.times[s]

    def settle(self) -> None:
        """Simulate every candidate passed over that could now be chosen: its bound within
        `SIMPLER_WITHIN` of the fastest and it simpler than the choice."""
        while True:
            ch = self.choice()
            band = self.fastest * (1 + SIMPLER_WITHIN)
            late = [s for s in self.bounded if self.times[s] <= band and (
                ch is None or complexity(s) < complexity(ch)
                or (complexity(s) == complexity(ch) and self.times[s] < self.times[ch]))]
            if not late:
                return
            for s in late:
                self.estimate(s, exact=True)

    def family(self, engine: Engine, group: int) -> float:
        """Finer grain with `group`, sub-chunks doubling until the estimate rose twice (the
        per-piece costs now outgrow the shrinking exposed step; twice, as a candidate far from
        the best has only its lower bound); the family's best."""
        lowest, rises = math.inf, 0
        for c in CHUNKS:
            if group != PER_PEER and group > c:
                continue
            t = self.estimate(Schedule(CommPattern.FINE, engine, c, group, self.pair.axis))
            rises = rises + 1 if t > lowest else 0
            lowest = min(lowest, t)
            if rises == 2:
                break
        return lowest

    def policy(self) -> None:
        """Sequential on both engines; shard-level P2P except on a mesh (one link of P-1 per
        step); finer grain with a piece per step; then, on each engine within `ENGINE_MARGIN`
        of the best so far, the other groupings."""
        mesh = self.cluster.topology.kind == "mesh" and self.pair.ranks > 2
        best: dict[Engine, float] = {}
        seq = {e: self.estimate(Schedule(CommPattern.SEQ, e)) for e in Engine}
        for engine in sorted(Engine, key=seq.__getitem__):  # the likelier winner first: a
            times = [seq[engine]]                            # tight bound sooner
            if not mesh:
                times.append(self.estimate(Schedule(CommPattern.P2P, engine,
                                                    axis=self.pair.axis)))
            times.append(self.family(engine, 1))
            best[engine] = min(times)
        top = min(best.values())
        for engine in Engine:
            if best[engine] <= top * (1 + ENGINE_MARGIN):
                for g in GROUPS[1:]:
                    self.family(engine, g)


def _reason(pair: OverlapPair, cluster: ClusterSpec, costs: PairCosts,
            best: tuple[Schedule, float], runner_up: tuple[Schedule, float] | None) -> str:
    s, est = best
    g_whole = costs.gemm(pair.gemm).duration
    comm = costs.collective_s
    ratio = g_whole / comm if comm > 0 else math.inf
    head = (f"GEMM {g_whole * 1e6:,.0f} us vs transfer {comm * 1e6:,.0f} us "
            f"(x{ratio:.2f}) on {pair.ranks} ranks, {cluster.topology.kind}")
    nxt = "" if runner_up is None else (
        f"; next best {runner_up[0]} est. {runner_up[1] * 1e6:,.0f} us "
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
