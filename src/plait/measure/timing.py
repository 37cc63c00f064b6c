"""Timing on ranks: all start together (barrier); a call lasts as long as its slowest rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def slowest(seconds: float) -> float:
    """The largest of `seconds` over all ranks."""
    x = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(slowest(time.perf_counter() - t0))
    return times
