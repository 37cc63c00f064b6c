"""Event-driven simulation of a task DAG on one GPU's resources, with rate sharing.

Tasks sit in streams (FIFO queues: the compute stream, a communication stream, one queue per copy
engine). A task starts when it heads its stream and its dependencies are done. While tasks run
concurrently they share resources (compute units, HBM, links, the NIC) and slow each other:

- `reserves` are served first (compute units a collective kernel holds);
- `uses` share what is left proportionally when over-subscribed;
- `slowdowns` multiply a task's rate while a task of another category runs (interference);
- a work-conserving floor: concurrent tasks never progress slower, together, than running them one
  after another would.

Progress is measured in standalone seconds, so a task running at rate r for dt seconds advances by
r * dt. The simulation is deterministic: ties break by stream order of first appearance.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from plait.intervals import intersect, length, union

_MIN_ELASTIC_SHARE = 0.05  # what elastic users keep when reservations claim a whole resource


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    stream: str
    duration: float  # standalone seconds
    category: str  # "compute", "sm_comm" or "dma" (see plait.cost.contention)
    deps: tuple[str, ...] = ()
    uses: Mapping[str, float] = field(default_factory=dict)
    reserves: Mapping[str, float] = field(default_factory=dict)
    slowdowns: Mapping[str, float] = field(default_factory=dict)
    label: str = ""  # the plan op this task executes, for traces
    args: Mapping[str, object] = field(default_factory=dict)  # shown in the trace's detail pane


@dataclass(frozen=True, slots=True)
class Span:
    task: Task
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Timeline:
    spans: tuple[Span, ...]
    streams: tuple[str, ...]

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    def busy(self, categories: Iterable[str]) -> list[tuple[float, float]]:
        """Union of the intervals in which a task of `categories` runs."""
        cats = set(categories)
        return union((s.start, s.end) for s in self.spans if s.task.category in cats)

    def exposed(self, comm: Iterable[str] = ("sm_comm", "dma"),
                compute: Iterable[str] = ("compute",)) -> float:
        """Seconds in which communication runs and no compute does."""
        c = self.busy(comm)
        return length(c) - length(intersect(c, self.busy(compute)))

    def shifted(self, offset: float, prefix: str = "") -> Timeline:
        """The same timeline starting `offset` seconds later, task names and labels prefixed
        (a pair's pieces then read `qkv:gemm.0`, `qkv:x0` in traces and plots)."""
        def rename(t: Task) -> Task:
            return Task(prefix + t.name, t.stream, t.duration, t.category,
                        tuple(prefix + d for d in t.deps), t.uses, t.reserves, t.slowdowns,
                        prefix + (t.label or t.name) if prefix else t.label, t.args)
        spans = tuple(Span(rename(s.task), s.start + offset, s.end + offset) for s in self.spans)
        return Timeline(spans, self.streams)


def simulate(tasks: Iterable[Task]) -> Timeline:
    """Run `tasks` to completion; returns when each started and ended."""
    tasks = list(tasks)
    reduced = _Symmetry(tasks)
    folded: list[Span] = []
    _run(reduced.tasks, reduced.mult, reduced.private, folded)
    spans = [Span(member, sp.start, sp.end) for sp in folded
             for member in reduced.members[sp.task.name]]
    spans.sort(key=lambda s: (s.start, s.end, s.task.name))
    return Timeline(tuple(spans), tuple(dict.fromkeys(t.stream for t in tasks)))


def uncontended_makespan(tasks: list[Task]) -> float:
    """The makespan if no task ever slowed another: each stream runs its tasks in order, each
    as soon as its dependencies are done, at full speed. Contention only slows tasks, so this
    bounds `simulate(tasks).makespan` from below."""
    end: dict[str, float] = {}
    stream_end: dict[str, float] = {}
    pending = list(tasks)
    while pending:
        later: list[Task] = []
        blocked: set[str] = set()  # streams whose head waits: the rest of them waits too
        for t in pending:
            if t.stream not in blocked and all(d in end for d in t.deps):
                start = max(stream_end.get(t.stream, 0.0),
                            max((end[d] for d in t.deps), default=0.0))
                end[t.name] = stream_end[t.stream] = start + t.duration
            else:
                blocked.add(t.stream)
                later.append(t)
        if len(later) == len(pending):
            raise ValueError("deadlock: dependency order contradicts stream order")
        pending = later
    return max(end.values(), default=0.0)


def folded_makespan(tasks: list[Task], mult: Mapping[str, int],
                    private: set[tuple[str, str]]) -> float:
    """The makespan of tasks already folded by their builder: each task stands for `mult` of
    its name (default 1); (task, resource) pairs in `private` are each member's own resource."""
    return _run(tasks, {t.name: mult.get(t.name, 1) for t in tasks}, private)


class _Symmetry:
    """`tasks` with symmetric streams folded into one: streams whose task sequences agree in
    duration, category, dependencies and resource use (a resource that only one stream uses, a
    mesh peer's own link, counts as the same for every stream) progress identically, so one of
    them stands for all (`mult` of them). Shared resources and categories are counted `mult`
    times in the rate rule, a stream's own resources once. The peers of a finer-grain step on
    the copy engines are the case that matters: their streams fold into one or two."""

    def __init__(self, tasks: list[Task]) -> None:
        by_name = {t.name: t for t in tasks}
        if len(by_name) != len(tasks):
            raise ValueError("task names must be unique")
        for t in tasks:
            for d in t.deps:
                if d not in by_name:
                    raise ValueError(f"task {t.name!r} depends on unknown task {d!r}")
        streams: dict[str, list[Task]] = {}
        for t in tasks:
            streams.setdefault(t.stream, []).append(t)
        users: dict[str, set[str]] = {}
        for t in tasks:
            for r in (*t.uses, *t.reserves):
                users.setdefault(r, set()).add(t.stream)
        own = {r for r, us in users.items() if len(us) == 1}
        groups: dict[tuple[object, ...], list[str]] = {}
        for name, ts in streams.items():
            key = tuple((t.duration, t.category, t.deps, _shape(t.uses, own),
                         _shape(t.reserves, own), tuple(sorted(t.slowdowns.items())))
                        for t in ts)
            groups.setdefault(key, []).append(name)
        alias: dict[str, str] = {}
        self.members: dict[str, list[Task]] = {}
        self.mult: dict[str, int] = {}
        kept: set[str] = set()
        for names in groups.values():
            lead = streams[names[0]]
            kept.add(names[0])
            for k, t in enumerate(lead):
                self.members[t.name] = [streams[n][k] for n in names]
                self.mult[t.name] = len(names)
                for n in names:
                    alias[streams[n][k].name] = t.name
        self.tasks = [t if all(alias[d] == d for d in t.deps) else
                      _with_deps(t, tuple(dict.fromkeys(alias[d] for d in t.deps)))
                      for t in tasks if t.stream in kept]
        self.private = {(t.name, r) for t in self.tasks for r in (*t.uses, *t.reserves)
                        if r in own}


def _shape(use: Mapping[str, float], own: set[str]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(("(own)" if r in own else r, v) for r, v in use.items()))


def _with_deps(t: Task, deps: tuple[str, ...]) -> Task:
    return Task(t.name, t.stream, t.duration, t.category, deps, t.uses, t.reserves,
                t.slowdowns, t.label, t.args)


# One loop, kept whole: the simulator's semantics are easier to check in one place.
def _run(tasks: list[Task], mult: Mapping[str, int], private: set[tuple[str, str]],
         spans: list[Span] | None = None) -> float:
    """The event loop: start every ready stream head, advance to the next completion at the
    rates of `_rates`, repeat. Returns when the last task ends; appends to `spans` if given."""
    for t in tasks:
        if not (math.isfinite(t.duration) and t.duration >= 0):
            raise ValueError(f"non-finite or negative duration {t.duration!r} of task "
                             f"{t.name!r}: every time in the hardware and calibration must be "
                             "a finite positive number")
    n = len(tasks)
    index = {t.name: i for i, t in enumerate(tasks)}
    waiting = [len(set(t.deps)) for t in tasks]  # dependencies not yet done
    dependents: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for d in set(t.deps):
            dependents[index[d]].append(i)
    queues: dict[str, deque[int]] = {}
    for i, t in enumerate(tasks):
        queues.setdefault(t.stream, deque()).append(i)
    order = list(queues)  # streams in order of first appearance: ties break by it
    # Tasks of equal cost hold the very same resource maps, so identity names their rate class;
    # the rates of a recurring set of classes are computed once.
    classes: dict[tuple[object, ...], int] = {}
    rate_class = [classes.setdefault(
        (id(t.uses), id(t.reserves), id(t.slowdowns), t.category, t.duration > 0,
         mult[t.name], tuple(r for r in t.uses if (t.name, r) in private)), len(classes))
        for t in tasks]
    single = [mult[t.name] == 1 for t in tasks]
    shared: dict[tuple[int, ...], tuple[float, ...]] = {}
    now = 0.0
    left = [t.duration for t in tasks]
    start = [0.0] * n
    running: dict[str, int] = {}  # stream -> its running task
    finished = 0
    while finished < n:
        for stream in order:  # start every ready stream head
            q = queues[stream]
            if stream not in running and q and waiting[q[0]] == 0:
                i = q.popleft()
                running[stream] = i
                start[i] = now
        if not running:
            heads = {s: tasks[q[0]].name for s, q in queues.items() if q}
            raise ValueError(f"deadlock at t={now:.6g}s: stream heads {heads} wait on tasks "
                             "that cannot finish (dependency order contradicts stream order)")
        active = list(running.values())
        if len(active) == 1 and single[active[0]]:
            rates: tuple[float, ...] = (1.0,)
        else:
            key = tuple(rate_class[i] for i in active)
            known = shared.get(key)
            if known is None:
                by_name = _rates([tasks[i] for i in active], mult, private)
                known = shared[key] = tuple(by_name[tasks[i].name] for i in active)
            rates = known
        dt = min(left[i] / r for i, r in zip(active, rates, strict=True))
        if not math.isfinite(dt) or dt < 0:
            raise ValueError(f"non-finite or negative step {dt!r} at t={now:.6g}s: a task's "
                             "duration or rate is not a finite positive number")
        now += dt
        for (stream, i), r in zip(list(running.items()), rates, strict=True):
            left[i] -= r * dt
            t = tasks[i]
            if left[i] <= 1e-12 * max(1.0, t.duration):
                del running[stream]
                finished += 1
                for k in dependents[i]:
                    waiting[k] -= 1
                if spans is not None:
                    spans.append(Span(t, start[i], now))
    return now


def _rates(active: list[Task], mult: Mapping[str, int] | None = None,
           private: set[tuple[str, str]] | None = None) -> dict[str, float]:
    """The rate of each running task (standalone seconds of progress per second): the one
    sharing rule of plait's model. `mult`: how many identical tasks each stands for; `private`:
    (task, resource) pairs each of those uses on its own (their count is not multiplied)."""
    mult = mult or {}
    private = private or set()
    reserved: dict[str, float] = {}
    elastic: dict[str, float] = {}
    categories: dict[str, int] = {}
    for t in active:
        m = mult.get(t.name, 1)
        for r, v in t.reserves.items():
            reserved[r] = reserved.get(r, 0.0) + v * (1 if (t.name, r) in private else m)
        for r, v in t.uses.items():
            elastic[r] = elastic.get(r, 0.0) + v * (1 if (t.name, r) in private else m)
        categories[t.category] = categories.get(t.category, 0) + m
    rates: dict[str, float] = {}
    for t in active:
        rate = 1.0
        for r in t.reserves:
            if reserved[r] > 1.0:
                rate = min(rate, 1.0 / reserved[r])
        for r in t.uses:
            avail = max(1.0 - min(reserved.get(r, 0.0), 1.0), _MIN_ELASTIC_SHARE)
            if elastic[r] > avail:
                rate = min(rate, avail / elastic[r])
        for cat, factor in t.slowdowns.items():
            if categories.get(cat, 0) - (t.category == cat) > 0:
                rate *= factor
        rates[t.name] = rate if t.duration > 0 else 1.0
    return work_conserving(rates, {t.name: mult.get(t.name, 1) for t in active})


def work_conserving(rates: dict[str, float], mult: Mapping[str, int] | None = None
                    ) -> dict[str, float]:
    """Concurrent tasks never progress slower, together, than one after another: when the
    rates sum below 1 they are scaled up to sum to 1 (`mult`: tasks each rate stands for)."""
    total = sum(v * (mult or {}).get(k, 1) for k, v in rates.items())
    if 0.0 < total < 1.0:
        return {k: v / total for k, v in rates.items()}
    return rates
