"""How much communication nothing hides, measured in a trace.

Per device: the union of its transfers, and how much of it no compute interval covers (exposed)
or does cover (overlapped). Per collective (kind, ranks, bytes): calls, time, exposed time.
Concurrent transfers count once in the device totals and each in their collective's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from plait.analyze.kineto import Comm, DeviceTrace

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


def length(spans: Sequence[Interval]) -> float:
    return sum(e - s for s, e in spans)


def covered(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


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


@dataclass(frozen=True, slots=True)
class DeviceExposure:
    device: str
    span_us: float  # first to last interval of the device
    compute_us: float  # busy computing (union)
    comm_us: float  # busy communicating (union)
    exposed_us: float  # communicating while not computing
    steps: int
    exposed: tuple[Interval, ...]  # where, for traces and plots

    @property
    def overlapped_us(self) -> float:
        return self.comm_us - self.exposed_us

    @property
    def exposed_fraction(self) -> float:
        """Of the device's span: the share a perfect overlap could at most save."""
        return self.exposed_us / self.span_us if self.span_us > 0 else 0.0


@dataclass(frozen=True, slots=True)
class CollectiveRow:
    """All calls of one collective shape on one device."""

    device: str
    kind: str
    group: int
    nbytes: float
    dtype: str | None
    calls: int
    comm_us: float
    exposed_us: float


def device_exposure(d: DeviceTrace) -> DeviceExposure:
    comm = union((c.start, c.end) for c in d.comms)
    compute = union((g.start, g.end) for g in d.compute)
    every = comm + compute
    span = max(e for _, e in every) - min(s for s, _ in every) if every else 0.0
    exposed = uncovered(comm, compute)
    return DeviceExposure(d.device, span, length(compute), length(comm), length(exposed),
                          d.steps, tuple(exposed))


def exposed_of(c: Comm, compute: Sequence[Interval]) -> float:
    """Of one transfer, the time no compute interval covers."""
    return (c.end - c.start) - covered([(c.start, c.end)], compute)


def collective_rows(d: DeviceTrace) -> list[CollectiveRow]:
    """One row per (kind, ranks, bytes, dtype), the most exposed first."""
    compute = union((g.start, g.end) for g in d.compute)
    rows: dict[tuple[str, int, float, str | None], list[float]] = {}
    for c in d.comms:
        key = (c.kind.value if c.kind else c.name, c.group, c.nbytes, c.dtype)
        acc = rows.setdefault(key, [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += c.duration
        acc[2] += exposed_of(c, compute)
    out = [CollectiveRow(d.device, k, g, b, dt, int(n), t, x)
           for (k, g, b, dt), (n, t, x) in rows.items()]
    return sorted(out, key=lambda r: -r.exposed_us)
