"""plait's predictions next to published measurements of overlap on real GPUs.

    python bench/papers.py [--save]

Each row is a measurement someone else published (citation, configuration, figure), plait's
prediction of the same quantity with its uncalibrated presets, and the ratio. The rows and the
tolerance were written down before plait's output was looked at; a miss is reported with its
cause, never tuned away. Tolerance (`TOLERANCE`): a speedup's gain (speedup - 1) within 0.5x to
2x of the published gain; any other figure within 0.8x to 1.25x of the published one (of the
range's middle for a published range). Rows that plait cannot express yet say what is missing.
Writes out/papers.json (bench/results/ with --save) and prints a markdown table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import results_io
from plait.cost.comm import collective_time, dma_copy
from plait.schedule.named import NAMED
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.engine import simulate
from plait.sim.layer import simulate_layer
from plait.sim.pair import simulate_pair
from plait.spec.hardware import ClusterSpec, load_hardware
from plait.spec.model import load_model
from plait.spec.parallel import ParallelSpec
from plait.workload.ops import Collective, CollectiveKind, Gemm, OverlapPair
from plait.workload.transformer import build_layer

GAIN = (0.5, 2.0)  # predicted gain / published gain, for speedups
RATIO = (0.8, 1.25)  # predicted / published, for other figures
TOLERANCE = (f"speedups: gain within {GAIN[0]}-{GAIN[1]}x of the published gain; others: "
             f"within {RATIO[0]}-{RATIO[1]}x of the published figure (a range's middle)")

TITAN_ASYNC = ("PyTorch torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
               "(June 2025; Grand Teton H100 96 GB HBM2e, 2.4 TB/s, 500 W)")
TITAN_2024 = ("PyTorch torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024, "
              "Table 5)")
NCCL_BLOG = ("Alaya New tech blog, 'NCCL-tests in practice', 2026-05-06: reference busbw of "
             "all_reduce_perf at large sizes")
FICCO = ("FiCCO, arXiv 2512.10236 (AMD), as summarized in shared/reference/techniques.md")
DHELIX = ("DHelix, arXiv 2411.15871 (ICCD'25), as summarized in "
          "shared/reference/techniques.md")


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    config: str
    published: float | tuple[float, float] | None  # a value, a range, or None (not a number)
    kind: str  # "speedup" or "figure"
    predict: Callable[[], float | None]  # None: plait cannot express it
    unit: str = ""
    note: str = ""  # what the comparison leaves out, written with the row


def grand_teton() -> ClusterSpec:
    """torchtitan's H100s: HBM2e at 2.4 TB/s (the 500 W limit's clock is not published)."""
    c = load_hardware("h100")
    return c.with_(gpu=c.gpu.model_copy(update={"hbm_bytes_per_s": 2.4e12}).model_dump())


def async_tp_speedup(model: str, micro_batch: int, recompute: bool) -> float:
    """Step speedup of PyTorch async TP (its schedule on every AG/RS pair) over vanilla TP
    (every collective exposed), per layer: forward (twice with full activation checkpointing)
    plus backward."""
    cluster = grand_teton()
    layer = build_layer(load_model(model), ParallelSpec(tp=8, seq_len=8192,
                                                        micro_batch=micro_batch))
    async_tp = {p.name: s for p in layer.pairs if (s := NAMED["pytorch"](p)) is not None}

    def step(schedules: dict[str, Schedule]) -> float:
        f, b = simulate_layer(layer, cluster, schedules)
        return (2 if recompute else 1) * f.time_s + b.time_s

    return step({}) / step(async_tp)


def all_reduce_busbw(hw: str) -> float:
    """nccl-tests' bus bandwidth of a large all-reduce on 8 GPUs: 2 (P-1)/P S / t, GB/s."""
    nbytes, p = 1 << 30, 8
    t = collective_time(Collective("ar", CollectiveKind.AR, nbytes, p), load_hardware(hw))
    return 2 * (p - 1) / p * nbytes / t / 1e9


def p2p_vs_collective_gather() -> float:
    """Link time of a shard-level P2P all-gather over an RCCL all-gather, 8x MI300X, 1 GiB
    (a GEMM too small to matter)."""
    c = load_hardware("mi300x")
    pair = OverlapPair.build("ag", 65536, 8, 8192, 8)
    p2p = simulate_pair(pair, Schedule(CommPattern.P2P, Engine.DMA), c).time_s
    return p2p / simulate_pair(pair, Schedule(), c).time_s


def ficco_best_speedup() -> float:
    """The largest speedup of plait's chosen schedule over sequential on the brief's
    evaluation shapes (AG -> GEMM), 8x MI300X."""
    from facts import BRIEF_SHAPES, ag_pair
    from plait.planner.explore import explore_pair

    c = load_hardware("mi300x")
    return max(explore_pair(ag_pair(m, n, k), c).speedup for m, n, k in BRIEF_SHAPES)


def dma_fixed_share(nbytes: float) -> float:
    """Of one MI300X copy-engine copy of `nbytes`, the share its fixed per-command cost takes."""
    c = load_hardware("mi300x")
    return c.gpu.dma.command_overhead_s / dma_copy(c, 1, nbytes).duration


def coexec_effectiveness() -> float:
    """Overlap effectiveness (t_a + t_b - t_parallel) / min(t_a, t_b) of a GEMM co-run with an
    all-gather of another micro-batch on 8x H100 (both ~1 ms alone), plait's simulator."""
    from plait.sim.optask import op_task

    c = load_hardware("h100")
    g = op_task(Gemm("gemm", 8192, 7168, 8192), c, "gemm", "compute")
    a = op_task(Collective("ag", CollectiveKind.AG, 8192 * 8192 * 2 * 5, 8), c, "ag", "comm")
    both = simulate([g, a]).makespan
    return (g.duration + a.duration - both) / min(g.duration, a.duration)


ROWS = [
    Row("async TP step speedup, Llama 3.1 70B bf16", TITAN_ASYNC,
        "256 H100, FSDP 32 x TP 8, torch.compile, full AC, local batch 16, seq 8192; "
        "597.3 -> 652.4 tokens/s/GPU", 652.4 / 597.3, "speedup",
        lambda: async_tp_speedup("llama3-70b", 16, recompute=True),
        note="plait: one TP layer (FSDP, embedding, loss, optimizer left out)"),
    Row("async TP step speedup, Llama 3.1 8B bf16", TITAN_ASYNC,
        "64 H100, FSDP 8 x TP 8, torch.compile, per-op SAC, local batch 12, seq 8192; "
        "4378 -> 4809.4 tokens/s/GPU", 4809.4 / 4378, "speedup",
        lambda: async_tp_speedup("llama3-8b", 12, recompute=False),
        note="plait: one TP layer, no recompute for per-op SAC"),
    Row("interleaved 1F1B over 1F1B, Llama 3.1 405B", TITAN_2024,
        "512 H100, FSDP 8 x TP 8 x PP 8, fp8, async TP, local batch 32; 100 -> 128 TPS/GPU",
        128 / 100, "speedup", lambda: None,
        note="plait models the 1F1B and interleaved bubbles, but only equal stages: "
        "126 layers do not split over 8 stages (torchtitan splits them unevenly)"),
    Row("all-reduce bus bandwidth, 8x H100 SXM (NVLink 4)", NCCL_BLOG, "1 GiB, 8 GPUs",
        (460.0, 480.0), "figure", lambda: all_reduce_busbw("h100"), "GB/s"),
    Row("all-reduce bus bandwidth, 8x A100 SXM4 (NVLink 3)", NCCL_BLOG, "1 GiB, 8 GPUs",
        (230.0, 250.0), "figure", lambda: all_reduce_busbw("a100"), "GB/s"),
    Row("shard-level P2P gather vs RCCL, 8x MI300X", FICCO,
        "link time, all-gather of large tensors; published: up to 3.9x slower", 3.9, "figure",
        p2p_vs_collective_gather, "x slower", note="published is a maximum ('up to')"),
    Row("best FiCCO schedule over sequential, 8x MI300X", FICCO,
        "the paper's evaluation shapes; published: up to 1.6x", 1.6, "speedup",
        ficco_best_speedup, note="published is a maximum over its shapes"),
    Row("copy-engine fixed cost share, 1 KB copy, MI300X", FICCO, "one SDMA copy", 0.70,
        "figure", lambda: dma_fixed_share(1e3)),
    Row("copy-engine fixed cost share, 1 MB copy, MI300X", FICCO, "one SDMA copy", 0.20,
        "figure", lambda: dma_fixed_share(1e6)),
    Row("copy-engine fixed cost share, 8 MB copy, MI300X", FICCO, "one SDMA copy", 0.03,
        "figure", lambda: dma_fixed_share(8e6)),
    Row("co-execution overlap effectiveness, compute vs communication", DHELIX,
        "profiled operator pairs of two micro-batches; published 0.85-1.0", (0.85, 1.0),
        "figure", coexec_effectiveness, note="plait: one GEMM beside one all-gather, H100"),
]


def verdict(row: Row, predicted: float | None) -> tuple[float | None, str]:
    if predicted is None or row.published is None:
        return None, "not expressible"
    pub = row.published
    mid = sum(pub) / 2 if isinstance(pub, tuple) else pub
    if row.kind == "speedup":
        ratio = (predicted - 1) / (mid - 1)
        return ratio, "within" if GAIN[0] <= ratio <= GAIN[1] else "miss"
    ratio = predicted / mid
    return ratio, "within" if RATIO[0] <= ratio <= RATIO[1] else "miss"


def main() -> None:
    args = results_io.parser(__doc__).parse_args()
    rows: list[dict[str, Any]] = []
    print(f"tolerance: {TOLERANCE}\n")
    print("| measurement | source | configuration | published | plait | ratio | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in ROWS:
        got = r.predict()
        ratio, what = verdict(r, got)
        pub = (f"{r.published[0]:g}-{r.published[1]:g}" if isinstance(r.published, tuple)
               else f"{r.published:.3g}" if r.published is not None else "—")
        rows.append({"name": r.name, "source": r.source, "config": r.config,
                     "published": r.published, "kind": r.kind, "unit": r.unit,
                     "predicted": got, "ratio": ratio, "verdict": what, "note": r.note})
        print(f"| {r.name} | {r.source} | {r.config} | {pub} {r.unit} | "
              + ("—" if got is None else f"{got:.3g} {r.unit}") + " | "
              + ("—" if ratio is None else f"{ratio:.2f}") + f" | {what}"
              + (f" ({r.note})" if r.note else "") + " |")
    hits = sum(x["verdict"] == "within" for x in rows)
    print(f"\n{hits} of {len(rows)} within tolerance")
    results_io.write("papers.json", {"tolerance": TOLERANCE, "rows": rows}, args.save)


if __name__ == "__main__":
    main()
