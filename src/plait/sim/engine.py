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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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
        return exposed(self.busy(comm), self.busy(compute))

    def shifted(self, offset: float, prefix: str = "") -> Timeline:
        """The same timeline starting `offset` seconds later, task names and labels prefixed
        (a pair's pieces then read `qkv:gemm.0`, `qkv:x0` in traces and plots)."""
        def rename(t: Task) -> Task:
            return Task(prefix + t.name, t.stream, t.duration, t.category,
                        tuple(prefix + d for d in t.deps), t.uses, t.reserves, t.slowdowns,
                        prefix + (t.label or t.name) if prefix else t.label, t.args)
        spans = tuple(Span(rename(s.task), s.start + offset, s.end + offset) for s in self.spans)
        return Timeline(spans, self.streams)


def exposed(comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]
            ) -> float:
    """Seconds of `comm`'s intervals that no interval of `compute` covers."""
    c = union(comm)
    return length(c) - length(intersect(c, union(compute)))


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


@dataclass(frozen=True, slots=True)
class Graph:
    """Tasks by index, as `run_graph` walks them: task i queues on stream `streams[i]`
    (numbered from 0; FIFO; ties break by number) and waits for the earlier tasks `deps[i]`
    (no repeats). `queues` (each stream's tasks, in order) and `dependents` (who waits for
    task i) are derived once by `graph`, so a structure evaluated with many durations pays
    for them once."""

    streams: tuple[int, ...]
    deps: tuple[tuple[int, ...], ...]
    queues: tuple[tuple[int, ...], ...]
    dependents: tuple[tuple[int, ...], ...]


def graph(streams: Sequence[int], deps: Sequence[Sequence[int]]) -> Graph:
    queues: list[list[int]] = [[] for _ in range(max(streams, default=-1) + 1)]
    dependents: list[list[int]] = [[] for _ in streams]
    for i, (s, ds) in enumerate(zip(streams, deps, strict=True)):
        queues[s].append(i)
        for d in ds:
            dependents[d].append(i)
    return Graph(tuple(streams), tuple(tuple(ds) for ds in deps),
                 tuple(tuple(q) for q in queues), tuple(tuple(d) for d in dependents))


def critical_path(g: Graph, durations: Sequence[float]) -> float:
    """The makespan of `run_graph` on `g` if each task ran at full speed: each stream runs its
    tasks in order, each as soon as its dependencies are done. Contention only slows tasks,
    so this bounds the simulated makespan from below."""
    end = [0.0] * len(durations)
    stream_end = [0.0] * len(g.queues)
    for i, s in enumerate(g.streams):
        t0 = stream_end[s]
        for d in g.deps[i]:
            if end[d] > t0:
                t0 = end[d]
        end[i] = stream_end[s] = t0 + durations[i]
    return max(stream_end, default=0.0)


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


def _run(tasks: list[Task], mult: Mapping[str, int], private: set[tuple[str, str]],
         spans: list[Span] | None = None) -> float:
    """`run_graph` on `tasks`, rates by `class_rates`: streams numbered in order of first
    appearance (ties break by it). Returns when the last task ends; appends to `spans` if
    given."""
    for t in tasks:
        if not (math.isfinite(t.duration) and t.duration >= 0):
            raise ValueError(f"non-finite or negative duration {t.duration!r} of task "
                             f"{t.name!r}: every time in the hardware and calibration must be "
                             "a finite positive number")
    index = {t.name: i for i, t in enumerate(tasks)}
    numbers: dict[str, int] = {}
    streams = [numbers.setdefault(t.stream, len(numbers)) for t in tasks]
    # Tasks of equal claims run at equal rates in equal company: one rate class for them.
    classes: dict[Share, int] = {}
    rate_class = [classes.setdefault(
        share(t.category, t.duration, t.uses, t.reserves, t.slowdowns, mult[t.name],
              {r for r in (*t.uses, *t.reserves) if (t.name, r) in private}),
        len(classes)) for t in tasks]
    members = list(classes)

    def rates(active: tuple[int, ...]) -> tuple[float, ...]:
        return class_rates([members[c] for c in active])

    ended: list[tuple[int, float, float]] = []
    end = run_graph(graph(streams, [tuple({index[d]: None for d in t.deps}) for t in tasks]),
                    [t.duration for t in tasks], rate_class, rates,
                    None if spans is None else ended)
    if spans is not None:
        spans.extend(Span(tasks[i], t0, t1) for i, t0, t1 in ended)
    return end


class Share(NamedTuple):
    """A rate class as the sharing rule reads it (`share`): `mult` identical tasks of one
    category, their claims on each resource (a shared resource's claim counted `mult` times, a
    resource each uses on its own once) and their slowdowns."""

    category: str
    mult: int
    positive: bool  # the tasks take time (a zero-duration task runs at rate 1)
    reserves: tuple[tuple[str, float], ...]  # (resource, the class's claim), served first
    uses: tuple[tuple[str, float], ...]  # (resource, the class's claim), shared elastically
    slowdowns: tuple[tuple[str, float], ...]  # (category, rate factor while one runs beside)


def share(category: str, seconds: float, uses: Mapping[str, float],
          reserves: Mapping[str, float], slowdowns: Mapping[str, float], mult: int = 1,
          private: Collection[str] = ()) -> Share:
    """The rate class of `mult` tasks of `category` that take `seconds` alone and hold these
    resources (`Task`'s fields); `private`: the resources each uses alone (a mesh peer's own
    link), whose claim is not multiplied."""
    return Share(category, mult, seconds > 0,
                 tuple((r, v * (1 if r in private else mult)) for r, v in reserves.items()),
                 tuple((r, v * (1 if r in private else mult)) for r, v in uses.items()),
                 tuple(slowdowns.items()))


def class_rates(members: Sequence[Share]) -> tuple[float, ...]:
    """The rates (standalone seconds of progress per second) of the tasks of `members` running
    together: the one sharing rule of plait's model.

    Reservations are served first; elastic uses share what is left (at least
    `_MIN_ELASTIC_SHARE`) in proportion; a slowdown applies while a task of its category runs
    beside; and the rates are work-conserving: when they sum below 1 over all the tasks, they
    are scaled up to sum to 1 (concurrent tasks never progress slower, together, than one
    after another). Written for speed: the heuristics call it for every new company."""
    reserved: dict[str, float] = {}
    elastic: dict[str, float] = {}
    categories: dict[str, int] = {}
    for m in members:
        for r, v in m.reserves:
            reserved[r] = reserved.get(r, 0.0) + v
        for r, v in m.uses:
            elastic[r] = elastic.get(r, 0.0) + v
        categories[m.category] = categories.get(m.category, 0) + m.mult
    rates = []
    total = 0.0
    for m in members:
        rate = 1.0
        if m.positive:
            for r, _ in m.reserves:
                if reserved[r] > 1.0 and 1.0 / reserved[r] < rate:
                    rate = 1.0 / reserved[r]
            for r, _ in m.uses:
                avail = 1.0 - min(reserved.get(r, 0.0), 1.0)
                if avail < _MIN_ELASTIC_SHARE:
                    avail = _MIN_ELASTIC_SHARE
                if elastic[r] > avail and avail / elastic[r] < rate:
                    rate = avail / elastic[r]
            for cat, factor in m.slowdowns:
                if categories.get(cat, 0) - (m.category == cat) > 0:
                    rate *= factor
        rates.append(rate)
        total += rate * m.mult
    if 0.0 < total < 1.0:
        return tuple(r / total for r in rates)
    return tuple(rates)


# One loop, kept whole: the simulator's semantics are easier to check in one place. It is the
# heuristics' inner loop too, so each event touches only the streams that can change, and it
# is written for CPython's speed (no zip in the hot loops, locals over attributes).
def run_graph(g: Graph, durations: Sequence[float], rate_class: Sequence[int],
              rates: Callable[[tuple[int, ...]], tuple[float, ...]],
              spans: list[tuple[int, float, float]] | None = None,
              above: float = math.inf) -> float:
    """The event loop over the tasks of `g`, task i running `durations[i]` standalone seconds.
    Start every ready stream head, advance to the next completion at the rates
    `rates(rate classes of the running tasks, by stream)` gives (tasks of one class run at
    equal rates in equal company; memoized), repeat. Returns when the last task ends;
    appends `(i, start, end)` to `spans` as task i ends, if given.

    `above`: when, as a task starts, its stream's work not yet done already ends past
    `above` (rates never exceed 1), that time is returned at once: a lower bound of the
    makespan, for a caller that only needs to know the makespan exceeds `above`."""
    streams, queues, dependents = g.streams, g.queues, g.dependents
    n = len(durations)
    n_streams = len(queues)
    qlen = [len(q) for q in queues]
    head = [0] * n_streams
    waiting = [len(d) for d in g.deps]  # dependencies not yet done
    bounded = above < math.inf
    queued = [sum(durations[i] for i in q) for q in queues] if bounded else []  # unstarted
    done_at = [1e-12 * (d if d > 1.0 else 1.0) for d in durations]  # what is left of a
    known: dict[tuple[int, ...], tuple[float, ...]] = {}            # finished task
    now = 0.0
    left = list(durations)
    start = [0.0] * n
    running = [-1] * n_streams  # each stream's running task
    active: list[int] = []  # the running tasks, by stream
    check: Iterable[int] = range(n_streams)  # streams whose head may start now
    finished = 0
    while finished < n:
        started = False
        for s in check:  # start every ready stream head
            if running[s] < 0 and head[s] < qlen[s]:
                i = queues[s][head[s]]
                if not waiting[i]:
                    running[s] = i
                    head[s] += 1
                    start[i] = now
                    started = True
                    if bounded:
                        if now + queued[s] > above:
                            return now + queued[s]
                        queued[s] -= durations[i]
        if started:
            active = [i for i in running if i >= 0]
        if not active:
            heads = {s: q[head[s]] for s, q in enumerate(queues) if head[s] < len(q)}
            raise ValueError(f"deadlock at t={now:.6g}s: stream heads (stream: task) {heads} "
                             "wait on tasks that cannot finish (dependency order contradicts "
                             "stream order)")
        key = tuple([rate_class[i] for i in active])
        step_rates = known.get(key)
        if step_rates is None:
            step_rates = known[key] = rates(key)
        dt = math.inf
        for k, i in enumerate(active):
            x = left[i] / step_rates[k]
            if x < dt:
                dt = x
        if not math.isfinite(dt) or dt < 0:
            raise ValueError(f"non-finite or negative step {dt!r} at t={now:.6g}s: a task's "
                             "duration or rate is not a finite positive number")
        now += dt
        check = []
        for k, i in enumerate(active):
            x = left[i] = left[i] - step_rates[k] * dt
            if x <= done_at[i]:
                s = streams[i]
                running[s] = -1
                check.append(s)
                finished += 1
                for j in dependents[i]:
                    waiting[j] -= 1
                    if not waiting[j]:
                        check.append(streams[j])
                if spans is not None:
                    spans.append((i, start[i], now))
        if check:  # (the order of `check` is free: every head it starts starts at `now`)
            active = [i for i in active if running[streams[i]] == i]
    return now
