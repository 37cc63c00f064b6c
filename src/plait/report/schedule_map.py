"""The schedule map: which schedule wins over tokens (M) x communication bytes, for the
first all-gather pair of an exploration's layer on its hardware."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from plait.planner.explore import Exploration, explore_pair
from plait.report.plots import plot_schedule_map

TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
WIDTHS = (1024, 2048, 4096, 8192, 16384)  # gathered row width K: bytes = M x K x dtype


def write_schedule_map(e: Exploration, path: str | Path) -> Path:
    base = next((r.pair for r in e.pairs if r.pair.direction == "in"), e.pairs[0].pair)
    b = base.collective.bytes / (base.gemm.m * base.gemm.k)
    cells = {}
    for m in TOKENS:
        for k in WIDTHS:
            pair = replace(base, gemm=replace(base.gemm, m=m, k=k),
                           collective=replace(base.collective, bytes=m * k * b))
            cells[(m, k * b)] = str(explore_pair(pair, e.cluster).chosen.schedule)
    return plot_schedule_map(
        cells, path, f"fastest schedule for {base.name} (N={base.gemm.n}, {base.ranks} ranks) "
        f"on {e.cluster.name}; bytes moved = M x bytes per token",
        ylabel="communication bytes per token", fmt_y=lambda v: f"{v / 1024:.0f} KiB")
