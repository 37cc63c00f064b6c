"""The one timer of plait's measurements (profile, bench, emulate, coexec, tuning, the CLI).

`time_calls(fn, warmup, repeats)` returns the seconds of each timed call. On ranks (a process
group is up and `ranks` is not False) every timed call starts together (a barrier) and lasts as
long as its slowest rank; the device is synchronized before and after each call (CUDA), so the
time covers the work the call queued, not only its launch. `timed(fn, device)`: one call's
result and this rank's seconds (`plait.tuning` times the job's own calls with it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from plait.runtime.launch import rank_device

R = TypeVar("R")
Timer = Callable[[Callable[[], Any], int, int], list[float]]  # (fn, warmup, repeats) -> s


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device`'s queued work: CUDA synchronize, or nothing on a CPU."""
    d = torch.device(device)
    if d.type == "cuda":
        return functools.partial(torch.cuda.synchronize, d)
    return _nothing


def _nothing() -> None:
    return None


def slowest(seconds: float) -> float:
    """The largest of `seconds` over all ranks (any figure: the fullest rank's bytes too)."""
    x = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def rank_mean(value: float) -> float:
    """The mean of `value` over all ranks."""
    x = torch.tensor([value], dtype=torch.float64, device=rank_device())
    dist.all_reduce(x)
    return float(x) / dist.get_world_size()


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int, *,
               device: torch.device | str | None = None, ranks: bool | None = None
               ) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones.

    `device`: what to synchronize (default: this rank's device). `ranks`: start together and
    take the slowest rank (default: whenever torch.distributed is initialized)."""
    on_ranks = dist.is_available() and dist.is_initialized() if ranks is None else ranks
    sync = device_sync(rank_device() if device is None else device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        if on_ranks:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        times.append(slowest(dt) if on_ranks else dt)
    return times


def timed(fn: Callable[[], R], device: torch.device | str) -> tuple[R, float]:
    """`fn()` and the seconds it took on this rank, the device synchronized before and after
    (so the time covers the work the call queued)."""
    sync = device_sync(device)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def local_timer(device: torch.device | str) -> Timer:
    """`time_calls` on one device in this process (no ranks)."""
    return functools.partial(time_calls, device=device, ranks=False)
