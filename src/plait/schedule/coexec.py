"""Co-execution planning: align the forward of micro-batch n with the backward of micro-batch
n-1 (DHelix strand interleaving) by dynamic programming.

1. Each strand's operators are split into sublists at collectives (a collective is a sublist of
   its own; the compute between two collectives is one sublist). A segment is a contiguous run
   of operators inside one sublist.
2. A block runs one forward segment, one backward segment, or one of each at the same time.
   Two segments that both communicate on the same group cannot share a block; on different
   groups (the TP group and the CP ring, say) they can, and the block's cost says what their
   shared links cost. `Comm` tells a unit's group: falsy for compute, any equal truthy values
   clash (a plain predicate `collective(name) -> bool` puts every collective in one group).
3. The plan minimizes the sum of block times. The published method enumerates segmentations and
   runs an edit-distance DP per segmentation; here the DP ranges over operator positions and
   chooses the next segment of each strand itself, which finds the optimum over every
   segmentation in one pass (states: (forward ops done, backward ops done); O(n_f n_b s^2) for
   segments of at most s operators).

Block costs come from a callable (the simulator by default: `simulated_costs`), so a measured
cost table can replace it. A plan is a plain value: `CoexecPlan.blocks` of
`CoexecBlock(fwd, bwd)` names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.errors import InfeasibleError, SpecError

Comm = Callable[[str], object]  # unit name -> the group it communicates on (falsy: none)


@dataclass(frozen=True, slots=True)
class CoexecBlock:
    fwd: tuple[str, ...]
    bwd: tuple[str, ...]

    def __str__(self) -> str:
        return f"{','.join(self.fwd) or '-'} | {','.join(self.bwd) or '-'}"


@dataclass(frozen=True, slots=True)
class CoexecPlan:
    blocks: tuple[CoexecBlock, ...]
    predicted_s: float
    moved: tuple[str, ...] = ()  # backward operators it runs later than written

    def to_json(self) -> str:
        return json.dumps({"predicted_s": self.predicted_s,
                           "blocks": [[list(b.fwd), list(b.bwd)] for b in self.blocks],
                           "moved": list(self.moved)})

    @classmethod
    def from_json(cls, text: str) -> CoexecPlan:
        d = json.loads(text)
        return cls(tuple(CoexecBlock(tuple(f), tuple(b)) for f, b in d["blocks"]), d["predicted_s"],
                   tuple(d.get("moved", ())))

    def __str__(self) -> str:
        return "\n".join(f"{i:2d}  {b}" for i, b in enumerate(self.blocks))


def sublists(names: Sequence[str], collective: Comm) -> list[tuple[int, int]]:
    """[start, end) index ranges of the sublists of a strand."""
    out, start = [], 0
    for i, n in enumerate(names):
        if collective(n):
            if i > start:
                out.append((start, i))
            out.append((i, i + 1))
            start = i + 1
    if start < len(names):
        out.append((start, len(names)))
    return out


def segment_ends(names: Sequence[str], collective: Comm) -> list[list[int]]:
    """For each start position, the possible end positions of a segment starting there."""
    ends: list[list[int]] = [[] for _ in range(len(names) + 1)]
    for a, b in sublists(names, collective):
        for i in range(a, b):
            ends[i] = list(range(i + 1, b + 1))
    return ends


SoloCost = Callable[[str, tuple[str, ...]], float]  # (strand "F"/"B", ops) -> seconds
PairCost = Callable[[tuple[str, ...], tuple[str, ...]], float]  # (fwd ops, bwd ops) -> seconds


def groups(names: Sequence[str], collective: Comm) -> frozenset[object]:
    """The groups the units `names` communicate on."""
    return frozenset(g for n in names if (g := collective(n)))


def plan_dp(fwd: Sequence[str], bwd: Sequence[str], collective: Comm,
            solo: SoloCost, pair: PairCost) -> CoexecPlan:
    """The cheapest order-preserving alignment of the two strands (see module docstring)."""
    nf, nb = len(fwd), len(bwd)
    fe, be = segment_ends(fwd, collective), segment_ends(bwd, collective)
    f_comm = [groups(fwd[i:j], collective) for i in range(nf + 1) for j in range(nf + 1)]
    b_comm = [groups(bwd[i:j], collective) for i in range(nb + 1) for j in range(nb + 1)]
    best = [[math.inf] * (nb + 1) for _ in range(nf + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (nb + 1) for _ in range(nf + 1)]
    best[0][0] = 0.0
    for i in range(nf + 1):
        for j in range(nb + 1):
            t = best[i][j]
            if t == math.inf:
                continue

            def relax(k: int, m: int, cost: float, i: int = i, j: int = j, t: float = t) -> None:
                if t + cost < best[k][m] - 1e-15:
                    best[k][m] = t + cost
                    back[k][m] = (i, j)
            for k in fe[i]:
                relax(k, j, solo("F", tuple(fwd[i:k])))
            for m in be[j]:
                relax(i, m, solo("B", tuple(bwd[j:m])))
            for k in fe[i]:
                for m in be[j]:
                    if f_comm[i * (nf + 1) + k] & b_comm[j * (nb + 1) + m]:
                        continue  # both strands on the same group at once
                    relax(k, m, pair(tuple(fwd[i:k]), tuple(bwd[j:m])))
    if best[nf][nb] == math.inf:
        raise InfeasibleError("no legal co-execution plan")
    blocks = []
    k, m = nf, nb
    while (k, m) != (0, 0):
        prev = back[k][m]
        assert prev is not None
        i, j = prev
        blocks.append(CoexecBlock(tuple(fwd[i:k]), tuple(bwd[j:m])))
        k, m = i, j
    return CoexecPlan(tuple(reversed(blocks)), best[nf][nb])


def moved_later(bwd: Sequence[str], moved: Sequence[str]) -> tuple[str, ...]:
    """`bwd` with the operators of `moved` taken out and appended at the end, in order."""
    return tuple(n for n in bwd if n not in moved) + tuple(n for n in bwd if n in moved)


def plan_with_moves(fwd: Sequence[str], bwd: Sequence[str], collective: Comm,
                    solo: SoloCost, pair: PairCost, movable: Sequence[str]) -> CoexecPlan:
    """The best plan over every subset of `movable` operators (weight gradients,
    `Layer.weight_gradients`: nothing in the layer consumes them) moved to the end of the
    backward, where they can fill gaps beside the forward's last segments; the plan names the
    ones it moved (`CoexecPlan.moved`)."""
    movable = [n for n in movable if n in bwd]
    best: CoexecPlan | None = None
    for mask in range(1 << len(movable)):
        moved = tuple(m for i, m in enumerate(movable) if mask >> i & 1)
        p = plan_dp(fwd, moved_later(bwd, moved), collective, solo, pair)
        if best is None or p.predicted_s < best.predicted_s - 1e-15:
            best = replace(p, moved=moved)
    assert best is not None
    return best


def strand_orders(plan: CoexecPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The order in which `plan` runs each strand's operators."""
    return (tuple(n for b in plan.blocks for n in b.fwd),
            tuple(n for b in plan.blocks for n in b.bwd))


def validate(plan: CoexecPlan, fwd: Sequence[str], bwd: Sequence[str],
             collective: Comm, movable: Sequence[str] = ()) -> None:
    """Raise `InfeasibleError` with the plan shown, the failing block marked, when a plan does
    not run each strand's operators once and in order (operators of `movable` may run later
    than written), splits a collective's sublist, or pairs two collectives of one group."""
    planned = strand_orders(plan)[1]
    if movable and sorted(planned) == sorted(bwd) and _only_moved_later(bwd, planned, movable):
        bwd = planned
    fi = bi = 0
    fsub = {i: s for s in sublists(fwd, collective) for i in range(*s)}
    bsub = {i: s for s in sublists(bwd, collective) for i in range(*s)}
    for n, blk in enumerate(plan.blocks):
        problem = None
        if tuple(fwd[fi:fi + len(blk.fwd)]) != blk.fwd:
            problem = f"forward ops out of order (expected {list(fwd[fi:fi + len(blk.fwd)])})"
        elif tuple(bwd[bi:bi + len(blk.bwd)]) != blk.bwd:
            problem = f"backward ops out of order (expected {list(bwd[bi:bi + len(blk.bwd)])})"
        elif blk.fwd and fsub[fi] != fsub[fi + len(blk.fwd) - 1]:
            problem = "forward segment crosses a collective"
        elif blk.bwd and bsub[bi] != bsub[bi + len(blk.bwd) - 1]:
            problem = "backward segment crosses a collective"
        elif groups(blk.fwd, collective) & groups(blk.bwd, collective):
            problem = "both strands communicate on the same group"
        elif not blk.fwd and not blk.bwd:
            problem = "empty block"
        if problem:
            grid = "\n".join(f"{i:2d}  {b}" + ("   <-- ERROR HERE" if i == n else "")
                             for i, b in enumerate(plan.blocks))
            raise InfeasibleError(f"invalid plan: {problem}\n{grid}")
        fi += len(blk.fwd)
        bi += len(blk.bwd)
    if fi != len(fwd) or bi != len(bwd):
        raise InfeasibleError(f"invalid plan: {len(fwd) - fi} forward and {len(bwd) - bi} "
                              "backward ops never run")


class MeasuredCosts:
    """Block costs from a table written by `plait coexec profile` (seconds)."""

    def __init__(self, table: dict[str, Any]) -> None:
        for kind in ("solo", "pair"):
            if not isinstance(table.get(kind), dict):
                raise SpecError("costs", f"the cost table has no {kind!r} mapping",
                                "pass the file `plait coexec profile` wrote")
        self.table = table

    def solo(self, strand: str, ops: tuple[str, ...]) -> float:
        return self._get("solo", f"{strand}|{','.join(ops)}")

    def pair(self, fwd: tuple[str, ...], bwd: tuple[str, ...]) -> float:
        return self._get("pair", f"{','.join(fwd)}|{','.join(bwd)}")

    def _get(self, kind: str, key: str) -> float:
        value = self.table[kind].get(key)
        if value is None:
            raise InfeasibleError(f"the measured cost table has no {kind} entry {key!r}: "
                                  "profile the same layer (plait coexec profile)")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise SpecError(f"costs.{kind}.{key}", f"{value!r} is not a time in seconds",
                            "pass the file `plait coexec profile` wrote")
        return float(value)


def _only_moved_later(original: Sequence[str], planned: Sequence[str],
                      movable: Sequence[str]) -> bool:
    """`planned` keeps every other operator in order and runs each movable one after all the
    other operators that preceded it in `original` (so after its inputs exist)."""
    fixed = [n for n in original if n not in movable]
    if [n for n in planned if n not in movable] != fixed:
        return False
    pos = {n: i for i, n in enumerate(planned)}
    return all(pos[m] > pos[p] for i, m in enumerate(original) if m in movable
               for p in original[:i] if p not in movable)
