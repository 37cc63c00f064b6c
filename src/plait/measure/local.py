"""One device, one process: the clock and the stand-in transfers of `plait profile --local`.

One device cannot move data to a peer, so stand-ins play the transfers that run beside a GEMM:

- CUDA `dma`: a copy-engine copy from pinned host memory on a side stream (about the speed of
  one GPU-GPU link, and it takes no compute units, like a peer copy);
- CUDA `d2d`: a copy-engine copy device to device (HBM-bound; a measurement only);
- CUDA `sm`: an elementwise copy kernel on a side stream (it takes every compute unit it can,
  so it bounds a collective kernel's interference from above);
- CPU `dma`: a copier thread (torch releases the GIL inside the copy).

The `dma` stand-in is the emulated link of `plait.runtime.emulated`, the same one that
`plait bench --emulate-link` runs the schedules against.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.runtime.emulated import EmulatedLinkEngine
from plait.runtime.engines import Handle


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
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def mover(name: str, kb: int, device: str) -> Callable[[], Handle]:
    """Start function of stand-in transfer `name` moving `kb` KiB (see the module docstring).
    `dma` is the emulated link of `plait bench --emulate-link` (`EmulatedLinkEngine`: pinned
    host memory copied on a side stream, or a copier thread on a CPU)."""
    nbytes = kb << 10
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if name == "dma":
        link = EmulatedLinkEngine([torch.empty(nbytes, dtype=torch.uint8)],
                                  torch.device(device), timeout_s=600.0)
        return functools.partial(link.pull, 1, 0, 0, dst, "profile stand-in")
    if not device.startswith("cuda"):
        raise ValueError(f"no {name!r} stand-in on a CPU (only 'dma', a copier thread)")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device=device)
    move: Callable[[], Any] = {
        "d2d": lambda: dst.copy_(src),
        "sm": lambda: torch.mul(src, 1, out=dst),
    }[name]

    def start_cuda() -> Handle:
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            move()
        return _StreamHandle(side)
    return start_cuda
