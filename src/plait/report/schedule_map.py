"""The schedule map: which schedule wins over tokens (M) x communication bytes, for one
dependent pair of an exploration's layer on its hardware (the first all-gather pair, or the
one `--pair` names), with the layer's own operating point marked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from plait.planner.explore import Exploration, explore_pair
from plait.report.plots import plot_schedule_map

TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
WIDTHS = (1024, 2048, 4096, 8192, 16384)  # elements per token moved (bytes = tokens x width x b)


def write_schedule_map(e: Exploration, path: str | Path, pair: str | None = None) -> Path:
    reports = {r.pair.name: r for r in e.pairs}
    base = (reports[pair].pair if pair is not None
            else next((r.pair for r in e.pairs if r.pair.direction == "in"), e.pairs[0].pair))
    # the moved tensor's dimensions in the pair's GEMM: tokens, and the width per token
    tok, wid = (("k", "n") if base.direction == "in" and base.axis.value == "K"
                else ("m", "k") if base.direction == "in" else ("m", "n"))
    t0, w0 = getattr(base.gemm, tok), getattr(base.gemm, wid)
    b = base.collective.bytes / (t0 * w0)  # bytes per element moved
    here = (t0, w0 * b)
    cells = {here: str(reports[base.name].chosen.schedule)}
    for t in sorted({*TOKENS, t0}):
        for w in sorted({*WIDTHS, w0}):
            if (t, w * b) in cells:
                continue
            cand = replace(base, gemm=replace(base.gemm, **{tok: t, wid: w}),
                           collective=replace(base.collective, bytes=t * w * b))
            cells[(t, w * b)] = str(explore_pair(cand, e.cluster).chosen.schedule)
    g = base.gemm
    return plot_schedule_map(
        cells, path, f"fastest schedule for {base.name} (GEMM {g.m}x{g.n}x{g.k}, {base.ranks} "
        f"ranks) on {e.cluster.name}; bytes moved = tokens x bytes per token; boxed: this "
        f"layer", xlabel=f"tokens ({tok.upper()} of the GEMM)",
        ylabel=f"communication bytes per token ({wid.upper()} x element)",
        fmt_y=lambda v: f"{v / 1024:.0f} KiB", mark=here)
