"""Where a device's time goes beyond exposure: its kernels by kind, its idle time by cause, and
which rank the others wait for.

- Kernels: every kernel (or CPU operator) by category (compute, communication, memory) and
  short name, with calls and summed duration, as shares of all kernel time (concurrent
  kernels each count, as in HTA's kernel breakdown).
- Idle: the gaps in the device's busy time (compute, communication or memory) within its span.
  A gap before a kernel the CPU had not launched yet when the gap began is `waiting for the
  CPU`: the host was late; any other gap is `waiting on a dependency` (another stream, an event,
  a synchronization). CPU traces have no launches: their gaps are `idle`.
- Straggler: of several ranks, the one that waits least for the others in collectives is the
  one they wait for.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from plait.analyze.exposure import DeviceExposure
from plait.analyze.kineto import Comm, DeviceTrace, Kernel
from plait.analyze.rules import display_name
from plait.intervals import union

HOST, DEPENDENCY, IDLE = "waiting for the CPU", "waiting on a dependency", "idle"


@dataclass(frozen=True, slots=True)
class KernelRow:
    device: str
    category: str  # compute, communication, memory
    kernel: str  # short name
    calls: int
    time_us: float
    share: float  # of all kernel time on the device


@dataclass(frozen=True, slots=True)
class IdleRow:
    device: str
    cause: str
    gaps: int
    time_us: float


def kernel_rows(d: DeviceTrace) -> list[KernelRow]:
    """Every kernel name on the device with its category, the most time first."""
    acc: dict[tuple[str, str], list[float]] = {}
    groups: tuple[tuple[str, Sequence[Comm | Kernel]], ...] = (
        ("communication", d.comms), ("compute", d.compute), ("memory", d.memory))
    for category, events in groups:
        for x in events:
            a = acc.setdefault((category, display_name(x.name)), [0, 0.0])
            a[0] += 1
            a[1] += x.duration
    total = sum(t for _, t in acc.values()) or 1.0
    return sorted((KernelRow(d.device, c, k, int(n), t, t / total)
                   for (c, k), (n, t) in acc.items()), key=lambda r: -r.time_us)


def category_rows(rows: Sequence[KernelRow]) -> list[KernelRow]:
    """The kernel rows summed by category."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        a = acc.setdefault((r.device, r.category), [0, 0.0, 0.0])
        a[0] += r.calls
        a[1] += r.time_us
        a[2] += r.share
    return sorted((KernelRow(dev, c, "(all)", int(n), t, s)
                   for (dev, c), (n, t, s) in acc.items()), key=lambda r: -r.time_us)


def idle_gaps(d: DeviceTrace) -> list[tuple[str, float, float]]:
    """The device's idle gaps as (cause, start, end), in time order (the rule in the module
    text: HTA's host wait, on the device's busy time rather than one stream's)."""
    events: list[Comm | Kernel] = sorted((*d.comms, *d.compute, *d.memory),
                                          key=lambda x: x.start)
    busy = union((x.start, x.end) for x in events)
    starts = [x.start for x in events]
    gaps = []
    for (_, gap_start), (gap_end, _) in pairwise(busy):
        nxt = events[bisect_left(starts, gap_end)]
        cause = (IDLE if nxt.launched is None
                 else HOST if nxt.launched > gap_start else DEPENDENCY)
        gaps.append((cause, gap_start, gap_end))
    return gaps


def idle_rows(d: DeviceTrace) -> list[IdleRow]:
    """The device's idle time by cause (`idle_gaps`)."""
    acc: dict[str, list[float]] = {}
    for cause, gap_start, gap_end in idle_gaps(d):
        a = acc.setdefault(cause, [0, 0.0])
        a[0] += 1
        a[1] += gap_end - gap_start
    return [IdleRow(d.device, c, int(n), t) for c, (n, t) in acc.items()]


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int | str  # the rank (or the trace's path when it names no rank)
    waiting_us: float  # its own waiting, per step
    others_us: float  # the others' mean waiting, per step
    bound: bool  # a partial rank set: waiting figures are lower bounds


def straggler(ranks: Sequence[tuple[int | str, DeviceExposure]], bound: bool
              ) -> Straggler | None:
    """The rank the others wait for: the one waiting least (None: fewer than two ranks, or
    waiting unknown)."""
    known = [(r, e.waiting_us / (e.steps or 1)) for r, e in ranks if e.waiting_us is not None]
    if len(known) < 2:
        return None
    rank, least = min(known, key=lambda x: x[1])
    others = [w for r, w in known if r != rank]
    return Straggler(rank, least, sum(others) / len(others), bound)
