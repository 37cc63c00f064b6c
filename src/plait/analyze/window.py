"""Which profiler steps an analysis covers, and what each step did.

Every figure is over a window of whole `ProfilerStep`s (events outside every step are left
out), divided by the steps in it. By default the window is every step the traces share, less
the last one and the first one when it is an outlier: with at least `MIN_STEPS` steps, its
communication time or its span is more than `OUTLIER` times the median of the other steps' on
some device. (The profiler's stop often flushes work into the last step: in real traces it
holds twice the communication of the others; GPU work that started before the profiler's first
events, whose launch the trace misses, lands in the first.) `--steps A:B` picks steps A to B
(ProfilerStep numbers, inclusive), `--steps all` every event of the trace (in a step or not:
totals, not per step); `--keep-last` / `--drop-last` and `--keep-first` / `--drop-first`
decide the edge steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.analyze.exposure import device_exposure
from plait.analyze.kineto import Comm, DeviceTrace, Kernel, RankTrace
from plait.errors import SpecError

MIN_STEPS = 3
OUTLIER = 1.5


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step on one device (no waiting: that needs every rank's window)."""

    device: str
    step: int
    span_us: float
    compute_us: float
    comm_us: float
    exposed_us: float
    in_window: bool


@dataclass(frozen=True, slots=True)
class Window:
    steps: tuple[int, ...]  # the ProfilerStep numbers analysed (empty: no steps, all events)
    note: str  # how they were chosen, for the report
    dropped_last: int | None = None  # the last step, left out as an outlier
    dropped_first: int | None = None  # the first step, left out as an outlier


WHOLE = Window((), "whole trace")


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`A:B`, `A:`, `:B` or `N` (ProfilerStep numbers, inclusive)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return n, n
        if len(parts) == 2:
            lo, hi = (int(p) if p.strip() else None for p in parts)
            if lo is None or hi is None or lo <= hi:
                return lo, hi
    except ValueError:
        pass
    raise SpecError("--steps", f"{text!r} is not a range of step numbers",
                    "pass A:B (ProfilerStep#A to #B, inclusive), A:, :B, one number N, or all")


def step_rows(d: DeviceTrace) -> list[StepRow]:
    """Each step's span, compute, communication and exposed time on device `d`."""
    comms: dict[int, list[Comm]] = {}
    compute: dict[int, list[Kernel]] = {}
    memory: dict[int, list[Kernel]] = {}
    for c in d.comms:
        if c.step is not None:
            comms.setdefault(c.step, []).append(c)
    for into, events in ((compute, d.compute), (memory, d.memory)):
        for g in events:
            if g.step is not None:
                into.setdefault(g.step, []).append(g)
    out = []
    for n in d.steps:
        e = device_exposure(replace(d, comms=tuple(comms.get(n, ())),
                                    compute=tuple(compute.get(n, ())),
                                    memory=tuple(memory.get(n, ())), steps=(n,)))
        out.append(StepRow(d.device, n, e.span_us, e.compute_us, e.comm_us, e.exposed_us, True))
    return out


def choose(traces: Sequence[RankTrace], rows: Sequence[StepRow], steps: str | None,
           drop_last: bool | None, drop_first: bool | None = None) -> Window:
    """The window over `traces` (whose per-step rows are `rows`): the steps they share (or
    `steps`), less an outlier first or last step (`drop_first`, `drop_last`: None decides by
    the outlier rule, True or False overrides it)."""
    if steps is not None and steps.strip().lower() == "all":
        return Window((), "whole trace: every event, in a profiler step or not (totals, not "
                      "per step)")
    marked = [set(t.step_numbers) for t in traces if t.step_numbers]
    if not marked:
        if steps is not None:
            raise SpecError("--steps", "the traces mark no ProfilerStep",
                            "record with torch.profiler's schedule and prof.step(), or leave "
                            "--steps out")
        return Window((), "whole trace (it marks no profiler steps)")
    common = sorted(set.intersection(*marked))
    if not common:
        raise SpecError("trace", "the traces share no ProfilerStep number: "
                        + "; ".join(f"{t.path}: {_span(t.step_numbers)}" for t in traces),
                        "pass traces of the same profiled steps of one job")
    chosen = common
    if steps is not None:
        lo, hi = parse_steps(steps)
        chosen = [n for n in common if (lo is None or n >= lo) and (hi is None or n <= hi)]
        if not chosen:
            raise SpecError("--steps", f"no step in {steps} (the traces have steps "
                            f"{_span(common)})", f"pass a range within {_span(common)}")
    notes: list[str] = []
    dropped: dict[str, int] = {}
    for end, flag, drop in (("last", "last", drop_last), ("first", "first", drop_first)):
        at = chosen[-1] if end == "last" else chosen[0]
        edge = common[-1] if end == "last" else common[0]
        if at != edge or len(chosen) < 2:
            continue
        why = outlier(rows, at, end)
        if drop or (drop is None and why):
            chosen = chosen[:-1] if end == "last" else chosen[1:]
            dropped[end] = at
            notes.append(f"step {at} left out: {why or f'--drop-{flag}'}"
                         + (f" (--keep-{flag} keeps it)" if drop is None else ""))
        elif why and drop is False:
            notes.append(f"step {at} kept (--keep-{flag}) though {why}")
    head = (f"steps {_span(chosen)}" if dropped else
            f"steps {_span(chosen)} ({len(chosen)} of {len(common)})")
    return Window(tuple(chosen), "; ".join([head, *notes]), dropped.get("last"),
                  dropped.get("first"))


CAUSE = {"last": "the profiler's stop often flushes work into the last step",
         "first": "the first step often holds warm-up, and work that started before the "
                  "profiler's first events"}


def outlier(rows: Sequence[StepRow], step: int, end: str = "last") -> str | None:
    """Why `step` (the window's `end`: "first" or "last") is an outlier on some device, or None
    (the rule in the module text)."""
    for device in dict.fromkeys(r.device for r in rows):
        mine = [r for r in rows if r.device == device]
        others = [r for r in mine if r.step != step]
        this = next((r for r in mine if r.step == step), None)
        if this is None or len(mine) < MIN_STEPS:
            continue
        for what, value, rest in (("communication", this.comm_us, [r.comm_us for r in others]),
                                  ("span", this.span_us, [r.span_us for r in others])):
            med = statistics.median(rest)
            if med > 0 and value > OUTLIER * med:
                return (f"its {what} on {device} is {value / med:.1f}x the median of the "
                        f"other steps (> {OUTLIER}x; {CAUSE[end]})")
    return None


def restrict(d: DeviceTrace, steps: Sequence[int]) -> DeviceTrace:
    """Device `d` with only the events of `steps` (all of them when `steps` is empty: the
    whole trace, whose figures are totals, not per step)."""
    if not steps:
        return replace(d, steps=())
    keep = set(steps)
    comms = tuple(c for c in d.comms if c.step in keep)
    compute = tuple(g for g in d.compute if g.step in keep)
    memory = tuple(m for m in d.memory if m.step in keep)
    every = [(x.start, x.end) for xs in (comms, compute, memory) for x in xs]
    lo, hi = (min(s for s, _ in every), max(e for _, e in every)) if every else (0.0, 0.0)
    return replace(d, comms=comms, compute=compute, memory=memory,
                   steps=tuple(n for n in d.steps if n in keep),
                   regions=tuple(r for r in d.regions if r[1] < hi and r[2] > lo))


def left_out(d: DeviceTrace, steps: Sequence[int]) -> int:
    """Events of `d` outside the window."""
    if not steps:
        return 0
    keep = set(steps)
    return sum(x.step not in keep for xs in (d.comms, d.compute, d.memory) for x in xs)


def _span(steps: Sequence[int]) -> str:
    s = sorted(steps)
    if not s:
        return "none"
    return str(s[0]) if len(s) == 1 else (
        f"{s[0]}-{s[-1]}" if s[-1] - s[0] == len(s) - 1 else ", ".join(map(str, s)))
