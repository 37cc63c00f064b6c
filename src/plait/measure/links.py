"""Transfer time versus bytes for each engine, on the local ranks, and a latency+bandwidth fit.

The all-gather of a (rows x 1024) fp32 shard is timed through the runtime with a GEMM of zero
columns, so exactly what an overlapped schedule pays for its transfers is measured: the library
collective (`seq/sm`) and the peer-copy engine (`seq/dma`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plait import ops
from plait.measure.timing import time_calls
from plait.runtime.context import close_all, runtime_for

SIZES_KB = (64, 256, 1024, 4096, 8192)


def transfer_times_rank(rank: int, world: int, sizes_kb: tuple[int, ...] = SIZES_KB,
                        repeats: int = 7) -> dict[str, dict[int, float]]:
    """Fastest of `repeats` all-gathers of of `kb` KiB per rank, per engine (slowest rank)."""
    rt = runtime_for(None)
    rt.verify_shapes = False
    out: dict[str, dict[int, float]] = {"sm": {}, "dma": {}}
    for kb in sizes_kb:
        x = torch.randn(max(1, kb * 1024 // 4 // 1024), 1024)
        w0 = torch.empty(1024, 0)
        for engine in out:
            def call(engine: str = engine, x: torch.Tensor = x, w0: torch.Tensor = w0) -> None:
                ops.all_gather_matmul(x, [w0], rt, schedule=f"seq/{engine}",
                                      return_gathered=False)
            # The least disturbed run: noise only adds.
            out[engine][kb] = min(time_calls(call, warmup=2, repeats=repeats))
    close_all()
    return out


def fit_latency_bandwidth(times: dict[int, float], world: int) -> dict[str, Any]:
    """Least-squares t = latency + received_bytes / bandwidth over the measured sizes."""
    kbs = sorted(times)
    received = np.array([kb * 1024 * (world - 1) for kb in kbs], dtype=float)
    t = np.array([times[kb] for kb in kbs])
    slope, intercept = np.polyfit(received, t, 1) if len(kbs) > 1 else (0.0, 0.0)
    if slope <= 0:  # noise swamped the size dependence: bound the bandwidth by the largest point
        slope, intercept = t[-1] / received[-1], 0.0
    return {"latency_s": max(float(intercept), 0.0), "bytes_per_s": float(1.0 / slope),
            "points": {int(kb): times[kb] for kb in kbs}}
