"""One device, one process: timers and the stand-in transfers of `plait profile --local`.

One device cannot move data to a peer, so stand-ins play the transfers that run beside a GEMM:

- CUDA `dma`: a copy-engine copy from pinned host memory on a side stream (about the speed of
  one GPU-GPU link, and it takes no compute units, like a peer copy);
- CUDA `d2d`: a copy-engine copy device to device (HBM-bound; a measurement only);
- CUDA `sm`: an elementwise copy kernel on a side stream (it takes every compute unit it can,
  so it bounds a collective kernel's interference from above);
- CPU `dma`: a copier thread (torch releases the GIL inside the copy).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from plait.measure.timing import Timer, device_sync
from plait.runtime.engines import Handle


def wall_timer(device: str) -> Timer:
    """Seconds of each of `repeats` calls of a function after `warmup` untimed ones, the device
    synchronized before and after each."""
    sync = device_sync(device)

    def timer(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return times
    return timer


def gemm_clock(device: str) -> Callable[[Callable[[], Any]], Callable[[], float]]:
    """Run a function on the current stream; return how to read its seconds once the device is
    synchronized (CUDA events on a GPU, the wall clock on a CPU)."""
    if device.startswith("cuda"):
        def clock(fn: Callable[[], Any]) -> Callable[[], float]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            return lambda: a.elapsed_time(b) / 1e3
        return clock

    def wall(fn: Callable[[], Any]) -> Callable[[], float]:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return lambda: dt
    return wall


class _StreamHandle:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def wait(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


class _FutureHandle:
    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


def mover(name: str, kb: int, device: str) -> Callable[[], Handle]:
    """Start function of stand-in transfer `name` moving `kb` KiB (see the module docstring)."""
    nbytes = kb << 10
    if device.startswith("cuda"):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if name == "dma" else
               torch.empty(nbytes, dtype=torch.uint8, device=device))
        side = torch.cuda.Stream(device=device)
        move: Callable[[], Any] = {
            "dma": lambda: dst.copy_(src, non_blocking=True),
            "d2d": lambda: dst.copy_(src),
            "sm": lambda: torch.mul(src, 1, out=dst),
        }[name]

        def start_cuda() -> Handle:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                move()
            return _StreamHandle(side)
        return start_cuda
    if name != "dma":
        raise ValueError(f"no {name!r} stand-in on a CPU (only 'dma', a copier thread)")
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    pool = ThreadPoolExecutor(1, thread_name_prefix="plait-profile-copier")

    def start_cpu() -> Handle:
        return _FutureHandle(pool.submit(dst.copy_, src))
    return start_cpu
