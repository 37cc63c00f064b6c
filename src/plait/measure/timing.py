"""Timing on ranks: all start together (barrier); a call lasts as long as its slowest rank. On
GPU ranks (NCCL) the device is synchronized around each timed call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.launch import rank_device

Timer = Callable[[Callable[[], Any], int, int], list[float]]  # (fn, warmup, repeats) -> s


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device`'s queued work: CUDA synchronize, or nothing on a CPU."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def slowest(seconds: float) -> float:
    """The largest of `seconds` over all ranks."""
    x = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones."""
    sync = device_sync(rank_device())
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(slowest(time.perf_counter() - t0))
    return times
