"""How much communication nothing hides, measured in a trace.

Per device: the union of its transfers, and how much of it no compute interval covers (exposed)
or does cover (overlapped). Per collective (kind, ranks, bytes): calls, time, exposed time.
Concurrent transfers count once in the device totals and each in their collective's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.analyze.kineto import Comm, DeviceTrace
from plait.intervals import Covered, Interval, length, uncovered, union


@dataclass(frozen=True, slots=True)
class DeviceExposure:
    device: str
    span_us: float  # first to last interval of the device
    compute_us: float  # busy computing (union)
    comm_us: float  # busy communicating (union)
    exposed_us: float  # communicating while not computing
    steps: int  # ProfilerSteps in the window (0: the trace marks none)
    exposed: tuple[Interval, ...]  # where, for traces and plots
    # Of the exposed time, waiting for other ranks (None: unknown): the union of every
    # transfer's wait (its start, before the last rank joined) that no compute covers, so a
    # part of `exposed_us`; the rest of it is transferring.
    waiting_us: float | None
    comm: Covered  # the device's transfers and compute, merged once for every later query
    compute: Covered
    memory_us: float = 0.0  # memcopies and memsets while neither computing nor communicating
    plait_us: float = 0.0  # communicating for plait's own shape check (part of comm_us)

    @property
    def overlapped_us(self) -> float:
        return self.comm_us - self.exposed_us

    @property
    def idle_us(self) -> float:
        return max(0.0, self.span_us - self.compute_us - self.exposed_us - self.memory_us)

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
    rule: str = ""  # the rule that made its kernels communication


@dataclass(frozen=True, slots=True)
class RuleRow:
    """What one communication rule found on one device."""

    device: str
    rule: str
    kernels: int
    time_us: float  # their durations, summed
    exposed_us: float  # of that, with nothing computing


def device_exposure(d: DeviceTrace) -> DeviceExposure:
    comm = Covered((c.start, c.end) for c in d.comms)
    compute = Covered((g.start, g.end) for g in d.compute)
    memory = union((m.start, m.end) for m in d.memory)
    every = comm.spans + compute.spans + memory
    span = max(e for _, e in every) - min(s for s, _ in every) if every else 0.0
    exposed = uncovered(comm.spans, compute.spans)
    return DeviceExposure(d.device, span, length(compute.spans), length(comm.spans),
                          length(exposed), len(d.steps), tuple(exposed),
                          waiting_of(d.comms, compute), comm, compute,
                          length(uncovered(memory, union(comm.spans + compute.spans))),
                          length(union((c.start, c.end) for c in d.comms if c.plaits_own)))


def waiting_of(comms: Sequence[Comm], compute: Covered) -> float | None:
    """Of the transfers' exposed time, the part spent waiting for other ranks: the union of
    their waits (each at its transfer's start: a call cannot move data before every rank has
    joined) that no compute covers. None when a wait is unknown."""
    if any(c.wait is None for c in comms):
        return None
    waits = union((c.start, c.start + (c.wait or 0.0)) for c in comms)
    return length(uncovered(waits, compute.spans))


def exposed_of(c: Comm, compute: Covered) -> float:
    """Of one transfer, the time no compute interval covers."""
    return (c.end - c.start) - compute.of(c.start, c.end)


def exposed_waiting(c: Comm, compute: Covered) -> float | None:
    """Of one transfer's exposed time, the part spent waiting for other ranks."""
    return waiting_of((c,), compute)


def align_ranks(ranks: Sequence[Sequence[DeviceTrace]]
                ) -> tuple[list[list[DeviceTrace]], str | None]:
    """The same devices with every transfer's `wait` set: its duration minus the shortest
    duration of the same call (same kind, group and size, same position among such calls) on
    any rank. The last rank to join waits least; the others wait for it. Needs the same
    number of devices per rank and the same calls on each; otherwise the devices come back
    unchanged, with the reason."""
    unchanged = [list(r) for r in ranks]
    if len(ranks) < 2:
        return unchanged, None
    if len({len(r) for r in ranks}) != 1:
        return unchanged, "the ranks' traces hold different numbers of devices"
    out: list[list[DeviceTrace]] = [[] for _ in ranks]
    for i in range(len(ranks[0])):
        devices = [r[i] for r in ranks]
        calls = [_by_call(d.comms) for d in devices]
        if len({tuple(sorted((k, len(v)) for k, v in c.items())) for c in calls}) != 1:
            return unchanged, (f"the ranks' traces do not hold the same collective calls on "
                               f"{devices[0].device} (a sampled trace, or different windows)")
        shortest = {k: [min(c[k][n].duration for c in calls) for n in range(len(v))]
                    for k, v in calls[0].items()}
        for o, d, c in zip(out, devices, calls, strict=True):
            order = {id(x): (k, n) for k, v in c.items() for n, x in enumerate(v)}
            comms = tuple(replace(x, wait=x.duration - shortest[k][n])
                          for x in d.comms for k, n in [order[id(x)]])
            o.append(replace(d, comms=comms))
    return out, None


def _by_call(comms: Sequence[Comm]) -> dict[tuple[str, int, int], list[Comm]]:
    calls: dict[tuple[str, int, int], list[Comm]] = {}
    for c in comms:
        calls.setdefault(c.key, []).append(c)
    return calls


def collective_rows(d: DeviceTrace, e: DeviceExposure) -> list[CollectiveRow]:
    """One row per (kind, ranks, bytes, dtype), the most exposed first; each row's exposed
    and waiting times are those of the union of its calls."""
    compute = e.compute
    rows: dict[tuple[str, int, float, str | None], list[Comm]] = {}
    for c in d.comms:
        rows.setdefault((c.label, c.group, c.nbytes, c.dtype), []).append(c)
    out = []
    for (k, g, b, dt), cs in rows.items():
        spans = union((c.start, c.end) for c in cs)
        out.append(CollectiveRow(d.device, k, g, b, dt, len(cs), sum(c.duration for c in cs),
                                 length(uncovered(spans, compute.spans)),
                                 waiting_of(cs, compute), cs[0].rule))
    return sorted(out, key=lambda r: -r.exposed_us)


def rule_rows(d: DeviceTrace, e: DeviceExposure) -> list[RuleRow]:
    """One row per communication rule that matched on the device, the most time first."""
    found: dict[str, list[Comm]] = {}
    for c in d.comms:
        found.setdefault(c.rule, []).append(c)
    return sorted((RuleRow(d.device, rule, len(cs), sum(c.duration for c in cs),
                           length(uncovered(union((c.start, c.end) for c in cs),
                                            e.compute.spans)))
                   for rule, cs in found.items()), key=lambda r: -r.time_us)


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
