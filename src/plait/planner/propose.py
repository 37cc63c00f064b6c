"""The simulator's candidates for a pair that the user's own job measures (`plait.tuning`).

`propose(pair, cluster, k)` returns the plain baseline `seq/sm` and the `k` schedules the
simulator predicts fastest, one per family of the design space (shard-level or finer grain,
collective kernels or copy engines, and the whole collective on copy engines): a measurement
separates families far better than neighbours of one family, whose differences are below
the measurement's noise. Each family's best comes from the heuristics' branch and bound
(`planner.heuristics.pick`, restricted to the family), so a proposal costs a few of its
searches, not an exhaustive exploration, and stays cheap at the group sizes users run.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.bulk import collector_paused
from plait.errors import InfeasibleError
from plait.planner.heuristics import pick
from plait.schedule.lower import lowering_id
from plait.schedule.schedule import (
    DEFAULT_CANDIDATES,
    FAMILIES,
    SEQUENTIAL,
    Schedule,
    candidate_schedules,
)
from plait.sim.pair import PairCosts
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import OverlapPair


@dataclass(frozen=True, slots=True)
class Proposal:
    schedule: Schedule
    predicted_s: float  # the simulator's time of the pair under it on the cluster


@collector_paused()
def propose(pair: OverlapPair, cluster: ClusterSpec, k: int = DEFAULT_CANDIDATES
            ) -> tuple[Proposal, ...]:
    """The baseline `seq/sm` first, then up to `k` other schedules, fastest predicted first.
    A group of one rank has nothing to overlap: the baseline alone."""
    if k < 0:
        raise ValueError(f"propose: k={k} candidates; use 0 or more")
    costs = PairCosts(pair, cluster)
    baseline = Proposal(SEQUENTIAL, pick(pair, cluster, [SEQUENTIAL], costs).estimate_s)
    if pair.ranks == 1 or k == 0:
        return (baseline,)
    best, lowerings = [], {_lowering(pair, SEQUENTIAL)}
    for comm, engine in FAMILIES:
        family = [s for s in candidate_schedules(pair.axis)
                  if s.comm is comm and s.engine is engine]
        try:
            chosen = pick(pair, cluster, family, costs)
        except InfeasibleError:  # no schedule of the family splits this shape
            continue
        same = _lowering(pair, chosen.schedule)  # another family's schedule under a new
        if same not in lowerings:  # name (fine/c1/g1 is p2p at two ranks): measured once
            lowerings.add(same)
            best.append(Proposal(chosen.schedule, chosen.estimate_s))
    best.sort(key=lambda p: p.predicted_s)
    return (baseline, *best[:k])


def _lowering(pair: OverlapPair, s: Schedule) -> int:
    return lowering_id(s, pair.ranks, pair.direction, pair.reduces)
