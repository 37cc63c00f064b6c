"""plait's predictions next to published measurements of overlap on real GPUs.

    python bench/papers.py [--save] [--what-if]

Each row is a measurement someone else published (citation, configuration, figure), plait's
prediction of the same quantity with its uncalibrated presets, and the ratio. The rows and the
tolerance were written down before plait's output was looked at; a miss is reported with its
cause, never tuned away. Tolerance (`TOLERANCE`): a speedup's gain (speedup - 1) within 0.5x to
2x of the published gain; any other figure within 0.8x to 1.25x of the published one (of the
range's middle for a published range). Rows that plait cannot express yet say what is missing.
Three rows are where preset parameters come from (ConCCL's two, the MI300X contention; the
8x H100 all-reduce, its NVLink SHARP bandwidth): marked fitted, they are sources, not
checks. `--what-if` also prints the async TP rows under slower GEMMs and faster links. Writes
out/papers.json (bench/results/ with --save) and prints a markdown table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import results_io
from plait.cost.comm import collective_time, dma_copy
from plait.planner.explore import explore_pair, tool_run
from plait.schedule.named import NAMED
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.engine import simulate
from plait.sim.layer import simulate_layer
from plait.sim.pair import simulate_pair
from plait.spec.hardware import ClusterSpec, load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec, load_model
from plait.workload.operators import Collective, CollectiveKind, Gemm, OverlapPair
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
NCCL_1455 = ("NVIDIA/nccl issue #1455 (2024-09): all_reduce_perf on 8x H100 SXM, NVLS busbw "
             "365-370 GB/s for 2-4 GPUs, 420/440/460/480 for 5/6/7/8")
NCCL_H200 = ("NVIDIA/nccl-tests issue #272 (2024-11): all_reduce_perf on 8x H200, NCCL 2.20.3, "
             "peak busbw 475 GB/s")
FICCO = ("FiCCO, arXiv 2512.10236 (AMD), as summarized in shared/reference/techniques.md")
DHELIX = ("DHelix, arXiv 2411.15871 (ICCD'25), as summarized in "
          "shared/reference/techniques.md")
CONCCL = ("Agrawal et al., 'Optimizing ML Concurrent Computation and Communication with GPU "
          "DMA Engines', arXiv 2412.14335 (AMD), abstract: C3 realizes on average 21% of the "
          "ideal speedup with RCCL, 72% with DMA-engine collectives (ConCCL)")


PYTORCH_143160 = ("pytorch/pytorch PR #143160 (Dec 2024): fused_all_gather_matmul on 8x H100, "
                  "M=2048, N=3584, K=8192: NCCL + cuBLAS 301 us, decomposition-based async TP "
                  "354 us")
KRAKEN_19 = ("meta-pytorch/kraken PR #19 (Jul 2025): GEMM + reduce-scatter on 8x H100, bf16, "
             "(M, 4096, 14336): PyTorch async TP against Torch + NCCL 0.22x at M=512, 0.34x at "
             "1024, 0.56x at 2048")
FLUX_L20 = ("bytedance/flux docs/performance.md (dense MLP on 8x L20, PCIe, TP 8, fp16; "
            "M=4096, K=12288, N=49152): torch (cuBLAS + NCCL) 16.946 ms -> Flux 5.903 ms "
            "(AG+GEMM), 17.664 -> 5.730 ms (GEMM+RS)")
NCCL_1281 = ("NVIDIA/nccl issue #1281 (2024-05): nccl-tests on H100, reduce-scatter busbw 360 "
             "GB/s, all-gather 350 GB/s")
FA3_PAPER = ("FlashAttention-3 paper (Shah et al., arXiv 2407.08608, Figs. 5-6): cuDNN's fused "
             "attention (TransformerEngine's kernel on Hopper) on H100 SXM5, head dim 128, "
             "16k tokens a batch")
MAMF = ("Stas Bekman, ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
        "FLOPS comparison table' (mamf-finder.py: the best BF16 matmul over a search of shapes)")
NEMO_LONG = ("NVIDIA NeMo, docs/source/performance/performance_long_sequence.md, 'LLAMA2-7B "
             "(FP8) - H100' (NeMo 24.03.01, DGX-H100, Megatron-LM's ring attention): TFLOPS/GPU "
             "with CP, NeMo's model-FLOPs formula")
DHELLAM_CP = ("DHeLlam-502/dhellam (the DHelix authors' code), docs/task.A800.MoE.CP.svg: "
              "Megatron-LM / Wavelet+ / DHelix TFLOPS per GPU, 64 A800, bars and labels read "
              "from the figure's SVG (Megatron-LM 186 and 161, DHelix 200 and 200)")


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


def grand_teton(gemm_fraction: float | None = None, link_scale: float = 1.0) -> ClusterSpec:
    """torchtitan's H100s: HBM2e at 2.4 TB/s (the 500 W limit's clock is not published).
    `gemm_fraction`, `link_scale`: what-ifs (GEMM efficiency, faster links) for `--what-if`."""
    c = load_hardware("h100")
    c = c.with_(gpu=c.gpu.model_copy(update={"hbm_bytes_per_s": 2.4e12}).model_dump())
    if gemm_fraction is not None:
        c = c.with_(params=c.params.model_copy(
            update={"gemm_peak_fraction": gemm_fraction}).model_dump())
    return c.with_(topology=c.topology.model_copy(
        update={"link_bytes_per_s": c.topology.link_bytes_per_s * link_scale}).model_dump())


def async_tp_steps(model: str, micro_batch: int, recompute: bool,
                   cluster: ClusterSpec | None = None) -> tuple[float, float]:
    """One rank's step (every layer, forward twice with full activation checkpointing, plus
    backward) under vanilla TP (every collective exposed) and under PyTorch async TP (its
    schedule on every AG/RS pair), seconds. torchtitan's TP (DTensor) keeps each gathered input
    for the weight gradient: no re-gather in backward."""
    cluster = cluster or grand_teton()
    spec = load_model(model)
    layer = build_layer(spec, ParallelSpec(tp=8, seq_len=8192, micro_batch=micro_batch,
                                           regather=False))
    async_tp = {p.name: s for p in layer.pairs if (s := NAMED["pytorch"](p)) is not None}
    issued = {(p.name, str(async_tp[p.name])): run for p in layer.pairs if p.name in async_tp
              and (run := tool_run("pytorch", p, cluster)) is not None}  # by PyTorch

    def step(schedules: dict[str, Schedule]) -> float:
        f, b = simulate_layer(layer, cluster, schedules, issued)
        return ((2 if recompute else 1) * f.time_s + b.time_s) * spec.layers

    return step({}), step(async_tp)


def async_tp_speedup(model: str, micro_batch: int, recompute: bool,
                     cluster: ClusterSpec | None = None) -> float:
    vanilla, async_tp = async_tp_steps(model, micro_batch, recompute, cluster)
    return vanilla / async_tp


def nemo_tflops(seq_k: int, tp: int, cp: int) -> float:
    """Model TFLOP/s per GPU of Llama-2-7B's layers, FP8, on H100 nodes (8 GPUs), Megatron-LM's
    layer (`megatron`) with ring attention over `cp` ranks, as NeMo counts them: its llama2
    formula's per-layer FLOPs (attention counted without the causal mask) over plait's
    predicted forward + backward of one layer."""
    spec, s = load_model("llama2-7b"), seq_k * 1024
    par = ParallelSpec(tp=tp, cp=cp, seq_len=s, dtype="fp8")
    f, b = simulate_layer(build_layer(spec, par), load_hardware("h100"), {}, megatron=True)
    h = spec.hidden
    flops = s * h * h * (12 + 12 * spec.kv_heads / spec.heads + 18 * spec.ffn / h + 12 * s / h)
    return flops / (tp * cp) / (f.time_s + b.time_s) / 1e12


def nemo_ratio(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """TFLOP/s per GPU at configuration `b` over `a` ((sequence in k tokens, TP, CP) each)."""
    return nemo_tflops(*b) / nemo_tflops(*a)


def async_tp_pair_speedup(kind: str, m: int, n: int, k: int) -> float:
    """PyTorch async TP's schedule (shard level, copy engines), issued as PyTorch's executor
    issues it, on one pair over the plain collective + GEMM, 8x H100, bf16: plait's
    simulation of both."""
    c = load_hardware("h100")
    pair = OverlapPair.build(kind, m, n, k, 8, dtype="bf16")
    schedule = NAMED["pytorch"](pair)
    assert schedule is not None
    fused = tool_run("pytorch", pair, c)
    assert fused is not None
    return simulate_pair(pair, Schedule(), c).time_s / fused.time_s


def l20_overlap_speedup(kind: str) -> float:
    """plait's chosen schedule over the plain collective + GEMM on 8x L20 (PCIe), fp16, Flux's
    dense-MLP shapes: the first GEMM (4096 x 12288 @ 12288 x 6144 per rank) after an
    all-gather, the second (4096 x 6144 @ 6144 x 12288) before a reduce-scatter."""
    c = load_hardware("l20")
    m, k, n = 4096, 12288, 49152 // 8
    pair = (OverlapPair.build("ag", m, n, k, 8, dtype="fp16") if kind == "ag" else
            OverlapPair.build("rs", m, k, n, 8, dtype="fp16"))
    report = explore_pair(pair, c)
    return report.sequential.time_s / report.chosen.time_s


def all_reduce_busbw(hw: str, p: int = 8) -> float:
    """nccl-tests' bus bandwidth of a large all-reduce on `p` GPUs: 2 (P-1)/P S / t, GB/s."""
    nbytes = 1 << 30
    t = collective_time(Collective("ar", CollectiveKind.AR, nbytes, p), load_hardware(hw))
    return 2 * (p - 1) / p * nbytes / t / 1e9


def gather_scatter_busbw(kind: CollectiveKind, hw: str = "h100", p: int = 8) -> float:
    """nccl-tests' bus bandwidth of a large all-gather or reduce-scatter: (P-1)/P S / t, GB/s."""
    nbytes = 1 << 30
    t = collective_time(Collective("c", kind, nbytes, p), load_hardware(hw))
    return (p - 1) / p * nbytes / t / 1e9


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


def llama_66b() -> ModelSpec:
    """The figure's 'Llama-66B', whose shape it does not give: LLaMA-65B's (80 layers, hidden
    8192, 64 heads each with its own keys and values, FFN 22016; Touvron et al. 2023)."""
    return ModelSpec(name="llama-66b", layers=80, hidden=8192, heads=64, kv_heads=64,
                     ffn=22016, vocab=32000)


def dhelix_cp_speedup(seq: int, cp: int, dp: int) -> float:
    """Co-execution over `megatron`, Llama-66B on 64 A800 (TP 8 in a node, PP 2, the CP ring
    across nodes), 8 micro-batches (not published), the `a800` preset."""
    from plait.planner.coexec.variants import predict_coexec

    r = predict_coexec(llama_66b(), ParallelSpec(tp=8, cp=cp, pp=2, dp=dp, seq_len=seq,
                                                 num_micro_batches=8), load_hardware("a800"))
    return r.speedup(r.variant("co-execution"))


def attention_tflops(backward: bool, causal: bool, seq: int) -> float:
    """plait's H100 attention kernel throughput at the paper's sizes (bench/attention_check)."""
    from attention_check import plait_tflops

    return plait_tflops(load_hardware("h100"), backward, causal, seq)


def gemm_tflops(hw: str, m: int, n: int, k: int) -> float:
    """plait's BF16 GEMM throughput at one shape."""
    from plait.cost.gemm import gemm_time

    return 2 * m * n * k / gemm_time(Gemm("gemm", m, n, k), load_hardware(hw)) / 1e12


# Independent GEMM + all-gather pairs of LLM sizes, the transfer 0.5, 1 or 2 times the GEMM
# alone (fixed before looking at plait's output).
C3_GEMMS = ((4096, 8192, 8192), (8192, 8192, 8192), (16384, 14336, 4096), (8192, 28672, 8192))
C3_RATIOS = (0.5, 1.0, 2.0)


def c3_realized(engine: Engine) -> float:
    """Mean share of the ideal speedup that running a GEMM and an independent all-gather at
    once realizes on 8x MI300X: (serial / concurrent - 1) / (serial / max - 1), all times
    plait's simulation (the all-gather on RCCL's kernels, or on the copy engines)."""
    from plait.sim.optask import op_task
    from plait.sim.pair import pair_tasks

    c = load_hardware("mi300x")
    shares = []
    for m, n, k in C3_GEMMS:
        g = op_task(Gemm("gemm", m, n, k), c, "gemm", "compute")
        for ratio in C3_RATIOS:
            per_byte = collective_time(Collective("ag", CollectiveKind.AG, 1 << 30, 8), c) / (
                1 << 30)
            rows = int(ratio * g.duration / per_byte) // (2 * 8192) // 8 * 8  # bf16 x 8192
            pair = OverlapPair.build("ag", rows, 8, 8192, 8)  # its all-gather is what counts
            if engine is Engine.SM:
                comm = [op_task(pair.collective, c, "ag", "comm")]
            else:  # the copy commands of a sequential DMA all-gather, nothing to wait for
                comm = [replace(t, deps=()) for t in pair_tasks(
                    pair, Schedule(CommPattern.SEQ, Engine.DMA), c) if t.category == "dma"]
            t_c = simulate(comm).makespan
            both = simulate([g, *comm]).makespan
            serial, best = g.duration + t_c, max(g.duration, t_c)
            shares.append((serial / both - 1) / (serial / best - 1))
    return sum(shares) / len(shares)


ROWS = [
    # small M: the decomposition's per-step costs against the plain path (issue 27, item 1)
    Row("async TP all-gather -> GEMM over NCCL + cuBLAS, small M", PYTORCH_143160,
        "8x H100, bf16, M=2048 (gathered), N=3584, K=8192", 301 / 354, "speedup",
        lambda: async_tp_pair_speedup("ag", 2048, 3584, 8192),
        note="host issue (issue 27, item 1): 8 steps of 5 host calls each, as "
        "PyTorch's executor makes them, beside 32 µs GEMM pieces"),
    *(Row(f"async TP GEMM -> reduce-scatter over Torch + NCCL, M={m}", KRAKEN_19,
          f"8x H100, bf16, (M, N, K) = ({m}, 4096, 14336)", published, "speedup",
          functools.partial(async_tp_pair_speedup, "rs", m, 4096, 14336),
          note="the decomposition loss of 64-256-row pieces and host issue: 7 host calls a "
          "step as PyTorch's executor makes them (issue 27, item 1)")
      for m, published in ((512, 0.22), (1024, 0.34), (2048, 0.56))),
    *(Row(f"fine-grained overlap over cuBLAS + NCCL on PCIe, {what}", FLUX_L20,
          f"8x L20 (PCIe Gen4, no NVLink), TP 8, fp16, {shape}", published, "speedup",
          functools.partial(l20_overlap_speedup, kind),
          note="plait's own schedule (copy engines), not Flux's fused kernel; the L20 "
          "preset's GEMM efficiency and NCCL bus bandwidth come from this report's torch "
          "baseline (issue 27, item 2)")
      for what, kind, shape, published in (
          ("AG+GEMM", "ag", "(4096 x 12288) @ (12288 x 6144) per rank", 16.946 / 5.903),
          ("GEMM+RS", "rs", "(4096 x 6144) @ (6144 x 12288) per rank", 17.664 / 5.730))),
    Row("async TP step speedup, Llama 3.1 70B bf16", TITAN_ASYNC,
        "256 H100, FSDP 32 x TP 8, torch.compile, full AC, local batch 16, seq 8192; "
        "597.3 -> 652.4 tokens/s/GPU", 652.4 / 597.3, "speedup",
        lambda: async_tp_speedup("llama3-70b", 16, recompute=True),
        note="plait: one TP layer (FSDP, embedding, loss, optimizer left out), the gathered "
        "input kept for the weight gradient as DTensor does (1.27x with Megatron's re-gather)"),
    Row("async TP step speedup, Llama 3.1 8B bf16", TITAN_ASYNC,
        "64 H100, FSDP 8 x TP 8, torch.compile, per-op SAC, local batch 12, seq 8192; "
        "4378 -> 4809.4 tokens/s/GPU", 4809.4 / 4378, "speedup",
        lambda: async_tp_speedup("llama3-8b", 12, recompute=False),
        note="plait: one TP layer, no recompute for per-op SAC, the gathered input kept "
        "(1.30x with Megatron's re-gather)"),
    Row("interleaved 1F1B over 1F1B, Llama 3.1 405B", TITAN_2024,
        "512 H100, FSDP 8 x TP 8 x PP 8, fp8, async TP, local batch 32; 100 -> 128 TPS/GPU",
        128 / 100, "speedup", lambda: None,
        note="not one layer's figure: bench/plan_fidelity.py predicts both whole steps "
        "(torchtitan's default micro-batch counts, 8 and 16): 1.52x"),
    Row("all-reduce bus bandwidth, 8x H100 SXM (NVLink 4)", NCCL_BLOG, "1 GiB, 8 GPUs",
        (460.0, 480.0), "figure", lambda: all_reduce_busbw("h100"), "GB/s",
        note="fitted: the H100 preset's NVLink SHARP all-reduce bandwidth comes from NCCL's "
        "maintainer's ~480 GB/s (nccl-tests issue #212); 340 GB/s before, a ring"),
    Row("NVLS all-reduce bus bandwidth, 6 of 8 H100 SXM", NCCL_1455,
        "NCCL_ALGO=NVLS, 2-4 GiB, 6 GPUs", 440.0, "figure",
        lambda: all_reduce_busbw("h100", 6), "GB/s"),
    Row("NVLS all-reduce bus bandwidth, 4 of 8 H100 SXM", NCCL_1455,
        "NCCL_ALGO=NVLS, 2-4 GiB, 4 GPUs (as the ring below 5 GPUs)", (365.0, 370.0),
        "figure", lambda: all_reduce_busbw("h100", 4), "GB/s",
        note="plait's switch reduction already beats the ring at 4 GPUs; NCCL's does not"),
    Row("all-reduce bus bandwidth, 8x H200 (NVLink 4)", NCCL_H200, "64 KiB-4 GiB, 8 GPUs, "
        "peak", 475.0, "figure", lambda: all_reduce_busbw("h200"), "GB/s"),
    Row("all-reduce bus bandwidth, 8x A100 SXM4 (NVLink 3)", NCCL_BLOG, "1 GiB, 8 GPUs",
        (230.0, 250.0), "figure", lambda: all_reduce_busbw("a100"), "GB/s"),
    # the TP collectives of Megatron-LM's layer (issue 27, item 4)
    Row("all-gather bus bandwidth, 8x H100 SXM", NCCL_1281, "large messages, 8 GPUs", 350.0,
        "figure", functools.partial(gather_scatter_busbw, CollectiveKind.AG), "GB/s"),
    Row("reduce-scatter bus bandwidth, 8x H100 SXM", NCCL_1281, "large messages, 8 GPUs",
        360.0, "figure", functools.partial(gather_scatter_busbw, CollectiveKind.RS), "GB/s",
        note="fitted: the H100 preset charges a reduce-scatter no more than an all-gather "
        "from this figure (10% more before, an estimate: 325 GB/s)"),
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
    # Megatron-LM's ring attention at long context, its ring across nodes (issue 27, item 3)
    *(Row(f"TFLOPS/GPU, {b[0]}k over {a[0]}k tokens, Llama-2-7B FP8, H100 nodes", NEMO_LONG,
          f"TP {a[1]} CP {a[2]} -> TP {b[1]} CP {b[2]} ({what}); {pa} -> {pb} TFLOPS/GPU",
          pb / pa, "figure", functools.partial(nemo_ratio, a, b),
          note="a ratio: plait's layers alone (the published step adds the embedding, loss, "
          "optimizer and data-parallel reduction); plait's own level is 1.3-1.4x the "
          "published one")
      for a, b, pa, pb, what in (
          ((64, 4, 2), (128, 4, 4), 574, 555, "the ring enters the NIC"),
          ((128, 4, 4), (256, 4, 8), 555, 549, "CP doubles, 32k tokens a CP rank"),
          ((512, 8, 16), (1024, 8, 32), 549, 536, "CP doubles, 32k tokens a CP rank"))),
    # co-execution under long context, the ring across nodes (issue 27, item 3)
    *(Row(f"co-execution over Megatron-LM, Llama-66B, {seq // 1024}k tokens, CP {cp}, 64 A800",
          DHELLAM_CP, f"TP 8, PP 2, CP {cp}, DP {dp}, sequence {seq}", published, "speedup",
          functools.partial(dhelix_cp_speedup, seq, cp, dp),
          note="the model's shape is LLaMA-65B's (not given with the figure); the cluster's "
          "NICs are not given either: the a800 preset's 25 GB/s a GPU")
      for seq, cp, dp, published in ((16384, 2, 2, 1.07), (32768, 4, 1, 1.24))),
    # the layer's compute: the attention kernel and the sustained GEMM rate (issue 27, item 4)
    *(Row(f"attention {'backward' if bwd else 'forward'}, {mask}, {seq // 1024}k tokens, H100",
          FA3_PAPER, f"head dim 128, {mask}, sequence {seq}", published, "figure",
          functools.partial(attention_tflops, bwd, mask == "causal", seq), "TFLOP/s",
          note="fitted: the attention model's parameters come from these points (18 in all, "
          "bench/attention_check.py); a flat 0.7 x the GEMM rate (589 TFLOP/s) before")
      for bwd, mask, seq, published in ((False, "causal", 1024, 410.0),
                                        (False, "causal", 16384, 539.0),
                                        (True, "no mask", 1024, 408.0),
                                        (True, "no mask", 16384, 516.0))),
    Row("maximum achievable BF16 matmul, H100 SXM", MAMF, "best shape 6144x17920x2816, "
        "CUDA 12.1", 792.1, "figure", lambda: gemm_tflops("h100", 6144, 17920, 2816),
        "TFLOP/s", note="fitted: the H100 preset's sustained GEMM ceiling comes from this "
        "figure (the tile model alone: 817 TFLOP/s)"),
    Row("maximum achievable BF16 matmul, A100 SXM", MAMF, "best shape 6912x16384x2048, "
        "CUDA 12.1", 267.9, "figure", lambda: gemm_tflops("a100", 6912, 16384, 2048),
        "TFLOP/s", note="the A100 preset's GEMM efficiency is an estimate (75% of peak)"),
    Row("concurrent GEMM + RCCL all-gather, share of the ideal speedup, 8x MI300X", CONCCL,
        "ML GEMMs beside independent collectives (published: their average); plait: "
        f"{len(C3_GEMMS)} GEMMs x transfer/GEMM {C3_RATIOS}", 0.21, "figure",
        lambda: c3_realized(Engine.SM),
        note="fitted: the MI300X preset's SM contention comes from this figure (0.76 before)"),
    Row("concurrent GEMM + DMA all-gather, share of the ideal speedup, 8x MI300X", CONCCL,
        "the same with DMA-engine collectives (ConCCL)", 0.72, "figure",
        lambda: c3_realized(Engine.DMA),
        note="fitted: the MI300X preset's copy-engine transfer slowdown comes from this figure "
        "(0.93 before)"),
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


TITAN_STEPS = (("llama3-70b", 16, True, 597.3), ("llama3-8b", 12, False, 4378.0))  # model,
# local batch, full AC, published vanilla tokens/s/GPU (TP 8: a GPU's share is batch x 8192 / 8)


def what_if() -> None:
    """How the async TP rows move with slower GEMMs or faster links, and with plait's saving
    diluted by the measured step (the misses' causes)."""
    print("async TP what-ifs (70B full AC, 8B): GEMM efficiency x link speed")
    for frac, scale in ((None, 1.0), (0.4, 1.0), (None, 1.4), (0.45, 1.4), (None, 2.0)):
        c = grand_teton(frac, scale)
        print(f"  gemm_peak_fraction {frac or c.params.gemm_peak_fraction}, links x{scale}: "
              f"{async_tp_speedup('llama3-70b', 16, True, c):.3f}x, "
              f"{async_tp_speedup('llama3-8b', 12, False, c):.3f}x")
    print("plait's saving on the measured vanilla step (the rest of the step, FSDP, embedding, "
          "loss, optimizer, unchanged by async TP):")
    for model, batch, recompute, tokens_per_s in TITAN_STEPS:
        vanilla, async_tp = async_tp_steps(model, batch, recompute)
        measured = batch * 8192 / 8 / tokens_per_s
        print(f"  {model}: plait's TP layers {vanilla:.2f} s of the measured {measured:.2f} s "
              f"step ({vanilla / measured:.0%}); saving {vanilla - async_tp:.2f} s -> "
              f"{measured / (measured - (vanilla - async_tp)):.3f}x")


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--what-if", action="store_true",
                    help="also print the async TP rows under slower GEMMs / faster links")
    args = ap.parse_args()
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
    if args.what_if:
        what_if()
    hits = sum(x["verdict"] == "within" for x in rows)
    print(f"\n{hits} of {len(rows)} within tolerance")
    results_io.write("papers.json", {"tolerance": TOLERANCE, "rows": rows}, args.save)


if __name__ == "__main__":
    main()
