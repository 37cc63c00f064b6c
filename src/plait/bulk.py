"""Bulk building of small acyclic objects with CPython's cyclic garbage collector paused.

The planner builds tens of thousands of tuples, ops and task shapes per exploration
(lowerings, folded programs, simulations). CPython runs its cyclic collector every few hundred
container allocations, and over such a build those passes took a quarter of the planner's time
while freeing nothing: these objects hold no reference cycles, so reference counting frees
them. `collector_paused` switches the collector off for the duration and restores whatever
state it found (it never enables a collector the caller had disabled).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block (or, as `@collector_paused()`, the function) without cyclic collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
