"""Checking that several traces are the ranks of one job, and how much of it they cover.

- The same content twice (one file passed twice, or copied) is read once, and the report says so.
- Two different traces of the same rank, different world sizes or backends, profiled steps
  with no number in common, or times more than `APART_S` apart (clocks are wall clock since
  the epoch) are traces of different jobs: refused.
- Fewer ranks than the job's world size: every "waiting for other ranks" figure is a lower
  bound (the slowest rank may be one not given), and is labelled so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.analyze.kineto import RankTrace
from plait.errors import SpecError

APART_S = 600.0
_EPOCH_US = 1e15  # later timestamps are wall clock (since 2001); earlier ones are relative


@dataclass(frozen=True, slots=True)
class RankSet:
    traces: tuple[RankTrace, ...]  # distinct, in the order given
    notes: tuple[str, ...]  # what was skipped, for the report
    world: int | None
    complete: bool  # every rank of the job is here (so waiting is exact)

    @property
    def waiting_is_bound(self) -> bool:
        return len(self.traces) > 1 and not self.complete


def rank_set(traces: Sequence[RankTrace]) -> RankSet:
    seen: dict[str, RankTrace] = {}
    notes = []
    for t in traces:
        if t.digest and t.digest in seen:
            notes.append(f"{t.path} is the same trace as {seen[t.digest].path}: read once")
            continue
        seen[t.digest or t.path] = t
    distinct = list(seen.values())
    if len(distinct) > 1:
        _one_job(distinct)
    worlds = {t.world for t in distinct if t.world}
    world = next(iter(worlds)) if worlds else None
    ranks = {t.rank for t in distinct if t.rank is not None}
    complete = world is not None and len(ranks) == len(distinct) == world
    if len(distinct) > 1 and not complete:
        notes.append(f"{len(distinct)} of {world if world else 'an unknown number of'} ranks "
                     "given: waiting for other ranks is a lower bound (≥), the slowest rank "
                     "may be one not given")
    return RankSet(tuple(distinct), tuple(notes), world, complete)


def _one_job(traces: Sequence[RankTrace]) -> None:
    first = traces[0]
    by_rank: dict[int, RankTrace] = {}
    for t in traces:
        if t.rank is not None and t.rank in by_rank:
            raise SpecError("trace", f"{by_rank[t.rank].path} and {t.path} are both rank "
                            f"{t.rank}, with different content (two runs?)",
                            "pass one trace per rank, all of one job")
        if t.rank is not None:
            by_rank[t.rank] = t
        for what, a, b in (("world size", first.world, t.world),
                           ("backend", first.backend, t.backend)):
            if a is not None and b is not None and a != b:
                raise SpecError("trace", f"{first.path} ({what} {a}) and {t.path} ({what} {b}) "
                                "are traces of different jobs",
                                "pass the traces of one job's ranks")
        if _apart(first.span, t.span):
            raise SpecError("trace", f"{first.path} and {t.path} were recorded "
                            f"{abs(t.span[0] - first.span[0]) / 1e6:,.0f} s apart: traces of "
                            "different jobs or runs",
                            "pass the traces that one profiled run wrote")


def _apart(a: tuple[float, float], b: tuple[float, float]) -> bool:
    if min(a[0], b[0]) < _EPOCH_US:  # relative clocks: nothing to compare
        return False
    gap = max(a[0], b[0]) - min(a[1], b[1])
    return gap > APART_S * 1e6
