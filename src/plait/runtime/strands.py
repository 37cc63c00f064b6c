"""Two strands (a forward and a backward) in two threads, their communication kept apart.

A group given a twin by the active turnstile (`turnstile(twins=...)`: the same ranks, a
communicator of its own) is used by the forward strand, its twin by the backward: each
communicator sees one strand's collectives, in that strand's order, so the strands
communicate at once and every rank agrees on the order.
While a turnstile is active the strands also pass a baton: one computes at a time, and hands
it over while it waits on communication (`idle`, around every wait of plait's engines), which
is where the other strand's compute hides that wait.

For a group without a twin, while a `Turnstile` is active, every plait op called from a
thread that names its strand (`strand("F")`, `strand("B")`) runs in its turn, alone among the
strands' ops: the strands' calls go in the turnstile's order (each call a strand letter), or
alternate (forward first) when it has none, and a strand runs freely once the other has
finished. Every rank of a group runs the same strands, so every rank issues the group's
collectives in the same order (two threads communicating on one process group in a racing
order would deadlock). Compute between the calls runs in both threads at once. Calls outside
any strand, or with no turnstile active, never wait.

A strand's units (`units`) are its plait calls and its weight gradients (`weight_grad`), in
the order it makes them: timed, they are the profile a co-execution plan is made from
(`plait.pipelining`); under a turnstile with `Blocks` the strands run the plan's blocks, and
the weight gradients the plan moves are deferred and run where the plan puts them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class _State:
    """A thread's strand state: its strand, the baton it holds, its units, its filling work."""

    def __init__(self) -> None:
        self.strand: str | None = None
        self.baton: threading.Lock | None = None
        self.units: Units | None = None
        self.fill: Callable[[], object] | None = None
        self.own_fill: Callable[[], object] | None = None


_local = threading.local()
# The state of the thread running each strand, while it runs: a backward that strand starts
# may run on another thread (on CUDA the autograd engine runs a device's backward nodes on
# a thread of its own), which then acts for the strand (`_here`).
_running: dict[str, _State] = {}


def _own() -> _State:
    """This thread's own state."""
    state: _State | None = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _State()
    return state


def _here() -> _State:
    """The state this thread acts in: its own; or, on a thread with none that is running a
    backward (an autograd device thread), the backward strand's while it runs: the strand
    called the backward and waits for it, so the two never run at once. Only the backward
    strand runs backwards while strands run."""
    own = _own()
    if own.strand is not None or own.units is not None or "B" not in _running:
        return own
    if torch._C._current_graph_task_id() == -1:
        return own
    return _running["B"]


class Blocks:
    """Two strands in the blocks of a plan: a strand starts a unit of block b only once the
    other strand is done with its units of the blocks before b (it has arrived at a unit of a
    later block, or ended). `block_of[strand][unit]`: the block of each planned unit; a unit
    the plan does not name runs where it comes (it is listed in `stray`)."""

    def __init__(self, block_of: Mapping[str, Mapping[str, int]], timeout_s: float = 300.0
                 ) -> None:
        self.block_of = {k: dict(v) for k, v in block_of.items()}
        self.timeout_s = timeout_s
        self.at = {"F": -1.0, "B": -1.0}  # the block each strand has arrived at
        self.stray: list[tuple[str, str]] = []
        self._cond = threading.Condition()

    def arrive(self, strand: str, unit: str) -> None:
        b = self.block_of.get(strand, {}).get(unit)
        other = "B" if strand == "F" else "F"
        with self._cond:
            if b is None:
                self.stray.append((strand, unit))
                return
            self.at[strand] = max(self.at[strand], b)
            self._cond.notify_all()
            if self.at[other] >= b:
                return
        baton = _here().baton  # the other strand computes meanwhile
        if baton is not None:
            baton.release()
        try:
            with self._cond:
                if not self._cond.wait_for(lambda: self.at[other] >= b, self.timeout_s):
                    raise TimeoutError(f"strand {strand} waited {self.timeout_s:.0f} s at "
                                       f"{unit} (block {b}) for strand {other}")
        finally:
            if baton is not None:
                baton.acquire()

    def finish(self, strand: str) -> None:
        with self._cond:
            self.at[strand] = math.inf
            self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class TimedUnit:
    """One unit of a strand as it ran: `name` is "<op>#<k>" (the strand's k-th unit), `group`
    the group key a call communicates on (None: a weight gradient, compute only); its
    seconds since the previous unit ended, split into waiting on communication and the rest
    (the compute before the call counts to it); `deferrable`: a weight gradient that can run
    later (its weight is a view of a plain parameter)."""

    name: str
    group: str | None
    compute_s: float
    wait_s: float
    deferrable: bool = False


class Units:
    """One strand's units as it makes them: timed, counted, and placed in `blocks` if given.
    Weight gradients named in `deferred` are queued (`weight_grad`) until `flush`.

    `sync` waits for the device's queued work (`plait.runtime.timing.device_sync`): on a GPU
    the host only launches kernels, so without it a unit would be timed by its launches. It
    is called at every unit's boundary and around every wait on communication (`idle`),
    which serializes the device: give it only where the units are timed for a plan."""

    def __init__(self, strand: str, blocks: Blocks | None = None,
                 deferred: frozenset[str] = frozenset(),
                 sync: Callable[[], None] | None = None) -> None:
        self.strand, self.blocks, self.deferred, self.sync = strand, blocks, deferred, sync
        self.ran: list[TimedUnit] = []
        self.queue: list[tuple[str, Callable[[], Any], Any, Any]] = []
        self._count = 0
        self._wait = 0.0
        self._last = self.now()

    def now(self) -> float:
        """The time, once the device's queued work is done (with `sync`)."""
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def waited(self, seconds: float) -> None:
        """Count `seconds` of waiting on communication to the unit running."""
        self._wait += seconds

    def name(self, op: str) -> str:
        name = f"{op}#{self._count}"
        self._count += 1
        return name

    @contextmanager
    def unit(self, name: str, group: str | None, deferrable: bool = False) -> Iterator[None]:
        if self.blocks is not None:
            self.blocks.arrive(self.strand, name)
        try:
            yield
        finally:
            now = self.now()
            span = now - self._last
            self.ran.append(TimedUnit(name, group, max(0.0, span - self._wait), self._wait,
                                 deferrable))
            self._last, self._wait = now, 0.0

    def flush(self) -> None:
        """Run the deferred weight gradients, in the order they were deferred, each in its
        planned block, accumulating into their parameters' `.grad`."""
        queue, self.queue = self.queue, []
        for name, compute, param, view in queue:
            with self.unit(name, None, True), torch.no_grad():
                _accumulate(param, view, compute())

    def tail(self) -> None:
        """The strand's compute after its last unit, as a unit named "tail"."""
        with self.unit("tail", None):
            pass


@contextmanager
def units(strand: str, blocks: Blocks | None = None,
          deferred: frozenset[str] = frozenset(),
          sync: Callable[[], None] | None = None) -> Iterator[Units]:
    """This thread's units until the block ends (see `Units`); then its tail is timed and
    the deferred weight gradients run, after it (where a plan moves them)."""
    state = _here()
    before = state.units
    u = state.units = Units(strand, blocks, deferred, sync)
    try:
        yield u
        u.tail()
        u.flush()
    finally:
        state.units = before


def _parameter_of(weight: Any) -> Any:
    """The plain leaf parameter `weight` is, or is a strided view of all of, else None (a
    copy, as autocast makes, or a DTensor's local part)."""
    base = weight if weight._base is None else weight._base
    if (not isinstance(base, torch.nn.Parameter) or type(base) is not torch.nn.Parameter
            or base.grad_fn is not None or weight.numel() != base.numel()):
        return None
    return base


def _accumulate(param: Any, view: Any, g: Any) -> None:
    """Add `g`, the gradient of `view` (a strided view of `param`), into `param.grad` as
    autograd's AccumulateGrad would."""
    if view is not param:
        full = torch.empty_strided(param.shape, param.stride(), dtype=g.dtype, device=g.device)
        full.as_strided(view.shape, view.stride(),
                        view.storage_offset() - param.storage_offset()).copy_(g)
        g = full
    if param.grad is None:
        param.grad = g.detach()
    else:
        param.grad.add_(g)


def weight_grad(weight: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, the gradient of `weight`, as a unit of this thread's strand; None when the
    strand defers it (it then accumulates into the parameter's `.grad` at `flush`)."""
    u = _here().units
    if u is None:
        return compute()
    name = u.name("wgrad")
    param = _parameter_of(weight)
    if param is not None and name in u.deferred:
        u.queue.append((name, compute, param, weight))
        return None
    with u.unit(name, None, param is not None):
        return compute()


class Turnstile:
    def __init__(self, order: Sequence[str] | None = None,
                 twins: Mapping[str, str] | None = None, timeout_s: float = 300.0,
                 blocks: Blocks | None = None) -> None:
        self.order = list(order) if order is not None else None
        self.blocks = blocks
        self.twins = dict(twins or {})  # group key -> the backward strand's twin of it
        self.timeout_s = timeout_s
        self.ran: list[tuple[str, str]] = []  # (strand, op) of the calls that took turns
        self.own: list[tuple[str, str]] = []  # ... and of those on a communicator of their own
        self._done: set[str] = set()
        self._busy = False  # a call is communicating
        self._cond = threading.Condition()
        # the lock a strand holds while it computes (one computes at a time, as on one
        # issuing thread), given up while it waits on communication (`idle`)
        self.baton = threading.Lock()

    def _next(self) -> str | None:
        n = len(self.ran)
        if self.order is not None:
            return self.order[n] if n < len(self.order) else None
        return "F" if not self.ran or self.ran[-1][0] == "B" else "B"  # F first: every
        # rank must start the same way

    def enter(self, strand: str, op: str) -> None:
        """Wait until `strand` may make its next call (`op` names it in `ran`) and no other
        call is communicating; `leave` ends it."""
        with self._cond:
            ok = self._cond.wait_for(lambda: not self._busy and (
                self._next() in (None, strand) or (self._next() or "") in self._done),
                self.timeout_s)
            if not ok:
                raise TimeoutError(f"strand {strand} waited {self.timeout_s:.0f} s for its turn "
                                   f"to call {op} (the other strand never called)")
            self.ran.append((strand, op))
            self._busy = True

    def note(self, strand: str, op: str) -> None:
        """Record a call that needs no turn (its strand has a communicator of its own)."""
        with self._cond:
            self.own.append((strand, op))

    def leave(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def finish(self, strand: str) -> None:
        """`strand` makes no more calls: the other no longer waits for it."""
        with self._cond:
            self._done.add(strand)
            self._cond.notify_all()
        if self.blocks is not None:
            self.blocks.finish(strand)


_active: list[Turnstile] = []


@contextmanager
def turnstile(order: Sequence[str] | None = None,
              twins: Mapping[str, str] | None = None,
              blocks: Blocks | None = None) -> Iterator[Turnstile]:
    """Keep the strands' calls apart while the block runs: on `twins` (group key -> the key
    of a group of the same ranks, for the backward strand), else in turns (see the module's
    docstring); with `blocks`, each strand's units in the plan's blocks."""
    t = Turnstile(order, twins, blocks=blocks)
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)


@contextmanager
def strand(name: str) -> Iterator[None]:
    """This thread's calls belong to strand `name` until the block ends (then it finishes).
    While a turnstile is active the strand computes only holding the baton, which it gives
    up while it waits on communication (`idle`) and when it ends."""
    state = _own()
    before, before_running = state.strand, _running.get(name)
    baton = _active[-1].baton if _active else None
    state.strand = name
    _running[name] = state
    if baton is not None:
        baton.acquire()
        state.baton = baton
    try:
        yield
    finally:
        state.strand = before
        if before_running is None:
            _running.pop(name, None)
        else:
            _running[name] = before_running
        if baton is not None:
            state.baton = None
            baton.release()
        for t in list(_active):
            t.finish(name)


def beside_other_work() -> bool:
    """Whether this thread's calls now run beside other work or are being timed as units:
    on a strand, filling its waits with the other strand's compute, or inside `units`.
    Measurements taken there would time the other work too (`plait.tuning` does not tune
    there)."""
    state = _here()
    return any(x is not None for x in (state.strand, state.fill, state.units))


@contextmanager
def filling(work: Callable[[], object] | None, own: bool = False) -> Iterator[None]:
    """While the block runs, every wait on communication on this thread (`idle`) first calls
    `work` (itself without filling): on one issuing thread, the other strand's compute goes
    into the waits of a FiCCO call (co-execution + FiCCO, `plait.measure.coexec.trainer`). `own`:
    the call's own later work (a backward's weight gradients beside its reduce-scatter), not
    another strand's (`beside_other_work` does not count it; None pauses it)."""
    attr = "own_fill" if own else "fill"
    state = _here()
    before = getattr(state, attr)
    setattr(state, attr, work)
    try:
        yield
    finally:
        setattr(state, attr, before)


@contextmanager
def idle() -> Iterator[None]:
    """Around a wait on communication: first the filling work (`filling`), if any; then a
    strand holding the baton gives it to the other strand meanwhile and takes it back
    after."""
    state = _here()
    for attr in ("fill", "own_fill"):
        fill = getattr(state, attr)
        if fill is not None:
            setattr(state, attr, None)
            try:
                fill()
            finally:
                setattr(state, attr, fill)
    baton, u = state.baton, state.units
    t0 = time.perf_counter() if u is None else u.now()  # the compute before it is done
    if baton is not None:
        baton.release()
    try:
        yield
    finally:
        if baton is not None:
            baton.acquire()
        if u is not None:  # the wait's communication done too
            u.waited(u.now() - t0)


@contextmanager
def turn(op: str, key: str) -> Iterator[str]:
    """Around each plait op's communication on group `key`; yields the group to use. On a
    thread of the backward strand a group with a twin is swapped for its twin; a group with
    none, while a turnstile is active and this thread names a strand, is used in its
    strand's turn, alone among the strands' ops."""
    u = _here().units
    if u is None:
        with _turn(op, key) as k:
            yield k
        return
    with u.unit(u.name(op), key), _turn(op, key) as k:
        yield k


@contextmanager
def _turn(op: str, key: str) -> Iterator[str]:
    name = _here().strand
    if name is None or not _active:
        yield key
        return
    t = _active[-1]
    twin = t.twins.get(key)
    if twin is not None:  # recorded, never waits
        t.note(name, op)
        yield twin if name == "B" else key
        return
    with idle():  # the other strand computes (and reaches its call) while this one waits
        t.enter(name, op)
    try:
        yield key
    finally:
        t.leave()
