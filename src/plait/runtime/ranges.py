"""Profiler ranges that cost nothing while no profiler records.

`record_function` costs several microseconds even with no profiler running, and plait opens
one per call and per op of its schedule; `traced(name, *args)` opens it only while a
profiler records, and builds the name only then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

_this_thread: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled",
                                           lambda: True)  # unknown: always record
_profiler = torch.autograd.profiler


def _recording() -> bool:
    """Whether a profiler records here: one started by `torch.profiler.profile` (its Python
    flag, also set when it follows every thread, where the thread-local state says no), or
    one started on this thread by other means."""
    return bool(getattr(_profiler, "_is_profiler_enabled", False)) or _this_thread()


def traced(name: Callable[..., str], *args: Any) -> contextlib.AbstractContextManager[Any]:
    """`record_function(name(*args))` while a profiler records, else nothing."""
    return record_function(name(*args)) if _recording() else contextlib.nullcontext()
