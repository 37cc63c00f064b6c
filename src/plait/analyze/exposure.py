"""How much communication nothing hides, measured in a trace.

Per device: the union of its transfers, and how much of it no compute interval covers (exposed)
or does cover (overlapped). Per collective (kind, ranks, bytes): calls, time, exposed time.
Concurrent transfers count once in the device totals and each in their collective's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.analyze.kineto import Comm, DeviceTrace
from plait.intervals import Covered, Interval, length, uncovered


@dataclass(frozen=True, slots=True)
class DeviceExposure:
    device: str
    span_us: float  # first to last interval of the device
    compute_us: float  # busy computing (union)
    comm_us: float  # busy communicating (union)
    exposed_us: float  # communicating while not computing
    steps: int
    exposed: tuple[Interval, ...]  # where, for traces and plots
    waiting_us: float | None  # of the exposed time, waiting for other ranks (None: unknown)
    comm: Covered  # the device's transfers and compute, merged once for every later query
    compute: Covered

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
    waiting_us: float | None  # exposed waiting for other ranks (None: unknown)


def device_exposure(d: DeviceTrace) -> DeviceExposure:
    comm = Covered((c.start, c.end) for c in d.comms)
    compute = Covered((g.start, g.end) for g in d.compute)
    every = comm.spans + compute.spans
    span = max(e for _, e in every) - min(s for s, _ in every) if every else 0.0
    exposed = uncovered(comm.spans, compute.spans)
    waits = [exposed_waiting(c, compute) for c in d.comms]
    waiting = None if None in waits else sum(w for w in waits if w is not None)
    return DeviceExposure(d.device, span, length(compute.spans), length(comm.spans),
                          length(exposed), d.steps, tuple(exposed), waiting, comm, compute)


def exposed_of(c: Comm, compute: Covered) -> float:
    """Of one transfer, the time no compute interval covers."""
    return (c.end - c.start) - compute.of(c.start, c.end)


def exposed_waiting(c: Comm, compute: Covered) -> float | None:
    """Of one transfer's exposed time, the part spent waiting for other ranks: the wait comes
    first (the call cannot move data before every rank has joined)."""
    if c.wait is None:
        return None
    return c.wait - compute.of(c.start, c.start + c.wait)


def align_ranks(ranks: Sequence[Sequence[DeviceTrace]]) -> list[list[DeviceTrace]]:
    """The same devices with every transfer's `wait` set: its duration minus the shortest
    duration of the same call (same kind, group and size, same position among such calls) on
    any rank. The last rank to join waits least; the others wait for it. Needs the same
    number of devices per rank and the same calls on each; otherwise returned unchanged."""
    if len(ranks) < 2 or len({len(r) for r in ranks}) != 1:
        return [list(r) for r in ranks]
    out: list[list[DeviceTrace]] = [[] for _ in ranks]
    for i in range(len(ranks[0])):
        devices = [r[i] for r in ranks]
        calls = [_by_call(d.comms) for d in devices]
        if len({tuple(sorted((k, len(v)) for k, v in c.items())) for c in calls}) != 1:
            for o, d in zip(out, devices, strict=True):
                o.append(d)
            continue
        shortest = {k: [min(c[k][n].duration for c in calls) for n in range(len(v))]
                    for k, v in calls[0].items()}
        for o, d, c in zip(out, devices, calls, strict=True):
            order = {id(x): (k, n) for k, v in c.items() for n, x in enumerate(v)}
            comms = tuple(replace(x, wait=x.duration - shortest[k][n])
                          for x in d.comms for k, n in [order[id(x)]])
            o.append(replace(d, comms=comms))
    return out


def _by_call(comms: Sequence[Comm]) -> dict[tuple[str, int, int], list[Comm]]:
    calls: dict[tuple[str, int, int], list[Comm]] = {}
    for c in comms:
        calls.setdefault(c.key, []).append(c)
    return calls


def collective_rows(d: DeviceTrace, e: DeviceExposure) -> list[CollectiveRow]:
    """One row per (kind, ranks, bytes, dtype), the most exposed first."""
    compute = e.compute
    rows: dict[tuple[str, int, float, str | None], list[Comm]] = {}
    for c in d.comms:
        rows.setdefault((c.kind.value if c.kind else c.name, c.group, c.nbytes, c.dtype),
                        []).append(c)
    out = []
    for (k, g, b, dt), cs in rows.items():
        waits = [exposed_waiting(c, compute) for c in cs]
        out.append(CollectiveRow(d.device, k, g, b, dt, len(cs), sum(c.duration for c in cs),
                                 sum(exposed_of(c, compute) for c in cs),
                                 None if None in waits else sum(w or 0.0 for w in waits)))
    return sorted(out, key=lambda r: -r.exposed_us)


@dataclass(frozen=True, slots=True)
class RegionRow:
    """All record_function ranges of one name on one device, and the communication in them."""

    device: str
    region: str
    count: int
    span_us: float
    comm_us: float  # communicating (union) inside the ranges
    exposed_us: float  # of that, with nothing computing


def region_rows(d: DeviceTrace, e: DeviceExposure, prefix: str) -> list[RegionRow]:
    """One row per region name starting with `prefix`, in order of first appearance."""
    comm, exposed = e.comm, Covered(e.exposed)
    rows: dict[str, list[float]] = {}
    for name, start, end in d.regions:
        if name.startswith(prefix):
            acc = rows.setdefault(name, [0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += end - start
            acc[2] += comm.of(start, end)
            acc[3] += exposed.of(start, end)
    return [RegionRow(d.device, name, int(n), t, c, x) for name, (n, t, c, x) in rows.items()]
