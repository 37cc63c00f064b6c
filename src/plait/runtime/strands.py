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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

_local = threading.local()


class Turnstile:
    def __init__(self, order: Sequence[str] | None = None,
                 twins: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> None:
        self.order = list(order) if order is not None else None
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


_active: list[Turnstile] = []


@contextmanager
def turnstile(order: Sequence[str] | None = None,
              twins: Mapping[str, str] | None = None) -> Iterator[Turnstile]:
    """Keep the strands' calls apart while the block runs: on `twins` (group key -> the key
    of a group of the same ranks, for the backward strand), else in turns (see the module's
    docstring)."""
    t = Turnstile(order, twins)
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
    before = getattr(_local, "strand", None)
    baton = _active[-1].baton if _active else None
    _local.strand = name
    if baton is not None:
        baton.acquire()
        _local.baton = baton
    try:
        yield
    finally:
        _local.strand = before
        if baton is not None:
            _local.baton = None
            baton.release()
        for t in list(_active):
            t.finish(name)


@contextmanager
def filling(work: Callable[[], object]) -> Iterator[None]:
    """While the block runs, every wait on communication on this thread (`idle`) first calls
    `work` (itself without filling): on one issuing thread, the other strand's compute goes
    into the waits of a FiCCO call (co-execution + FiCCO, `plait.coexec.execute`)."""
    before = getattr(_local, "fill", None)
    _local.fill = work
    try:
        yield
    finally:
        _local.fill = before


@contextmanager
def idle() -> Iterator[None]:
    """Around a wait on communication: first the filling work (`filling`), if any; then a
    strand holding the baton gives it to the other strand meanwhile and takes it back
    after."""
    fill = getattr(_local, "fill", None)
    if fill is not None:
        _local.fill = None
        try:
            fill()
        finally:
            _local.fill = fill
    baton = getattr(_local, "baton", None)
    if baton is None:
        yield
        return
    baton.release()
    try:
        yield
    finally:
        baton.acquire()


@contextmanager
def turn(op: str, key: str) -> Iterator[str]:
    """Around each plait op's communication on group `key`; yields the group to use. On a
    thread of the backward strand a group with a twin is swapped for its twin; a group with
    none, while a turnstile is active and this thread names a strand, is used in its
    strand's turn, alone among the strands' ops."""
    name = getattr(_local, "strand", None)
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
