"""What a pair of stages' first actions measure: the trial of PyTorch's order against the overlap
(`Verdict`, by `schedule="auto"`'s rule) and, with `plan=True`, the co-execution plan made from
the strands' timed units (`StagePlan`), alike on every rank of the stages' groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait.nn import plait_groups
from plait.runtime import strands
from plait.schedule.coexec import CoexecPlan
from plait.tuning.decide import Candidate, decide

if TYPE_CHECKING:
    from plait.pipelining.overlap import Overlap


@dataclass(frozen=True)
class StagePlan:
    """The co-execution plan of one (forward stage, backward stage) pair and the timed units
    it was made from (the slowest rank's)."""

    plan: CoexecPlan
    fwd: tuple[strands.TimedUnit, ...]
    bwd: tuple[strands.TimedUnit, ...]
    deferred: frozenset[str]  # the weight gradients the plan moves

    @property
    def sequential_s(self) -> float:
        """Forward then backward, as timed."""
        return sum(u.compute_s + u.wait_s for u in (*self.fwd, *self.bwd))

    def block_of(self) -> dict[str, dict[str, int]]:
        return {"F": {n: i for i, b in enumerate(self.plan.blocks) for n in b.fwd},
                "B": {n: i for i, b in enumerate(self.plan.blocks) for n in b.bwd}}


@dataclass(frozen=True)
class Verdict:
    """What one pair of stages runs after its measured actions: the overlap, or PyTorch's
    order (forward then backward), and why."""

    overlap: bool
    overlapped_s: float  # median action time, the slowest rank of the stages' groups
    sequential_s: float  # the same in PyTorch's order
    reason: str


@dataclass
class _ActionTrial:
    """A pair of stages' first actions: PyTorch's order and the overlap alternately, the
    first of each untimed (set-up), then timed."""

    measure: int  # timed actions of each kind
    count: int = 0
    sequential: list[float] = field(default_factory=list)
    overlapped: list[float] = field(default_factory=list)

    @property
    def sequential_next(self) -> bool:
        return self.count % 2 == 0

    @property
    def timed_next(self) -> bool:
        return self.count >= 2

    @property
    def total(self) -> int:
        return 2 + 2 * self.measure


IN_ORDER, OVERLAPPED = "PyTorch's order", "the overlap"  # the two candidates of an action


def _maybe_decide(overlap: Overlap, key: tuple[int, int], trial: _ActionTrial,
                  stages: list[Any]) -> None:
    """After the trial's last action: the faster way for this pair of stages, from the
    slowest rank's times, alike on every rank of the stages' groups, by `schedule="auto"`'s
    rule (`plait.tuning.decide`: the overlap must win by more than the spread)."""
    if trial.count < trial.total:
        return
    n = trial.measure
    times = _slowest(stages, [*trial.sequential, *trial.overlapped])
    order, ovl = Candidate(IN_ORDER, None, tuple(times[:n])), \
        Candidate(OVERLAPPED, None, tuple(times[n:]))
    d = decide(f"stages {key[0]} and {key[1]}", [order, ovl], baseline=IN_ORDER)
    win = d.choice == OVERLAPPED
    reason = f"{d.key} (an action each, median of {n}): {d.reason}" + (
        "" if win else ": run forward then backward")
    overlap.verdicts[key] = Verdict(win, ovl.measured_s or 0.0, order.measured_s or 0.0,
                                    reason)
    del overlap.trials[key]


def _slowest(stages: list[Any], values: list[float]) -> list[float]:
    """`values` as their largest over every rank the stages' plait groups connect (as many
    rounds as groups, so a rank two groups away counts too)."""
    import torch.distributed as dist

    from plait.ops import group_key, runtime_of

    table = torch.tensor(values, dtype=torch.float64)
    keys = sorted({group_key(g) for st in stages for g in plait_groups(st.submod)})
    for _ in keys:
        for key in keys:
            rt = runtime_of(key)
            moved = table.to(rt.device)
            dist.all_reduce(moved, dist.ReduceOp.MAX, group=rt.group)
            table = moved.cpu()
    return [float(v) for v in table]


def _plan(fwd: list[strands.TimedUnit], bwd: list[strands.TimedUnit], stages: list[Any]
          ) -> StagePlan:
    """The plan of two stages' strands from their timed units, the same on every rank: each
    unit's times are the slowest of the ranks that share the stages' groups, and a weight
    gradient is moved only if every rank can defer it."""
    from plait.schedule.coexec import plan_with_moves

    units = [*fwd, *bwd]
    flat = _slowest(stages, [x for u in units for x in (u.compute_s, u.wait_s,
                                                         0.0 if u.deferrable else 1.0)])
    agreed = [strands.TimedUnit(u.name, u.group, c, w, not nd)  # nd: any rank cannot defer
              for u, (c, w, nd) in zip(units, zip(flat[::3], flat[1::3], flat[2::3],
                                                  strict=True), strict=True)]
    f_units, b_units = tuple(agreed[:len(fwd)]), tuple(agreed[len(fwd):])
    by_name = {("F", u.name): u for u in f_units} | {("B", u.name): u for u in b_units}
    group = {u.name: u.group for u in agreed}

    def total(strand: str, names: tuple[str, ...]) -> float:
        return sum(by_name[strand, n].compute_s + by_name[strand, n].wait_s for n in names)

    def compute(strand: str, names: tuple[str, ...]) -> float:
        return sum(by_name[strand, n].compute_s for n in names)

    def pair(f: tuple[str, ...], b: tuple[str, ...]) -> float:
        return max(compute("F", f) + compute("B", b), total("F", f), total("B", b))

    movable = [u.name for u in b_units if u.group is None and u.deferrable]
    plan = plan_with_moves([u.name for u in f_units], [u.name for u in b_units], group.get,
                           total, pair, movable)
    return StagePlan(plan, f_units, b_units, frozenset(plan.moved))
