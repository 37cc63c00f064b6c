"""Two strands (a forward and a backward) in two threads, their communication in one order.

While a `Turnstile` is active, every plait op called from a thread that names its strand
(`strand("F")`, `strand("B")`) runs in its turn, alone among the strands' ops: the strands'
calls go in the turnstile's order (each call a strand letter), or alternate (forward first)
when it has none, and a strand runs freely once the other has finished. Every rank of a group
runs the same strands, so every rank issues the group's collectives in the same order (two
threads communicating on one process group in a racing order would deadlock). Compute
between the calls runs in both threads at once. Calls outside any strand, or with no
turnstile active, never wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_local = threading.local()


class Turnstile:
    def __init__(self, order: Sequence[str] | None = None, timeout_s: float = 300.0) -> None:
        self.order = list(order) if order is not None else None
        self.timeout_s = timeout_s
        self.ran: list[tuple[str, str]] = []  # (strand, op) of every call, in turn order
        self._done: set[str] = set()
        self._busy = False  # a call is communicating
        self._cond = threading.Condition()

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
def turnstile(order: Sequence[str] | None = None) -> Iterator[Turnstile]:
    """Order the strands' calls while the block runs (see the module's docstring)."""
    t = Turnstile(order)
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)


@contextmanager
def strand(name: str) -> Iterator[None]:
    """This thread's calls belong to strand `name` until the block ends (then it finishes)."""
    before = getattr(_local, "strand", None)
    _local.strand = name
    try:
        yield
    finally:
        _local.strand = before
        for t in list(_active):
            t.finish(name)


@contextmanager
def turn(op: str) -> Iterator[None]:
    """Around each plait op's communication: with a turnstile active and a strand named on
    this thread, the op runs in its strand's turn, alone among the strands' ops."""
    name = getattr(_local, "strand", None)
    if name is None or not _active:
        yield
        return
    t = _active[-1]
    t.enter(name, op)
    try:
        yield
    finally:
        t.leave()
