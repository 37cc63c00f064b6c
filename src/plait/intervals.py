"""Interval arithmetic on timelines, shared by the simulator (`sim.engine.Timeline`) and the
trace analysis (`analyze.exposure`): unions, intersections, what one set leaves uncovered."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]


def union(spans: Iterable[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering exactly what `spans` cover."""
    out: list[Interval] = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def length(spans: Iterable[Interval]) -> float:
    return sum(e - s for s, e in spans)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def uncovered(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of `a` that `b` does not cover (both disjoint and sorted)."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def covered_span(start: float, end: float, b: Sequence[Interval],
                 starts: Sequence[float] | None = None) -> float:
    """Length of [start, end) that disjoint sorted intervals `b` cover, in O(log n + hits);
    `starts`: b's start times, if at hand (a bisect index)."""
    starts = starts if starts is not None else [s for s, _ in b]
    i = max(0, bisect_right(starts, start) - 1)
    total = 0.0
    while i < len(b) and b[i][0] < end:
        total += max(0.0, min(end, b[i][1]) - max(start, b[i][0]))
        i += 1
    return total


def clip(b: Sequence[Interval], starts: Sequence[float], start: float, end: float
         ) -> list[Interval]:
    """The parts of disjoint sorted intervals `b` (whose start times are `starts`) inside
    [start, end), in O(log n + hits)."""
    i = max(0, bisect_right(starts, start) - 1)
    out = []
    while i < len(b) and b[i][0] < end:
        s, e = max(start, b[i][0]), min(end, b[i][1])
        if s < e:
            out.append((s, e))
        i += 1
    return out


class Covered:
    """A set of intervals (merged once), queried for how much of a span it covers."""

    def __init__(self, spans: Iterable[Interval]) -> None:
        self.spans = union(spans)
        self.starts = [s for s, _ in self.spans]

    def of(self, start: float, end: float) -> float:
        return covered_span(start, end, self.spans, self.starts)
