"""The layouts `plait plan` searches: one value per way to run the job (`Layout`), and the
enumeration of those that the model and the machine allow (`layouts`).

A layout is Megatron-LM's vocabulary: TP x CP x PP x DP ranks (EP carved from DP x CP x TP),
`micro_batch` sequences per micro-batch, `micro_batches` of them per step and rank, activation
checkpointing (`ac`, on `ac_layers` of a rank's layers or all of them), how the data-parallel
state is sharded (`zero`: 1, the distributed optimizer; 3, FSDP: parameters too), the
pipeline schedule, and the overlap it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from plait.spec.hardware import ClusterSpec
from plait.spec.model import ModelSpec

AC = Literal["none", "selective", "full"]
AC_MODES: tuple[AC, ...] = ("none", "selective", "full")
PipelineKind = Literal["none", "1F1B", "interleaved", "DualPipeV"]
PIPELINE_KINDS: tuple[PipelineKind, ...] = ("none", "1F1B", "interleaved", "DualPipeV")
Overlap = Literal["plain", "ficco", "coexec", "asynctp"]
Kernels = Literal["fused", "eager"]  # how the memory-bound operators run
OVERLAPS: tuple[Overlap, ...] = ("plain", "ficco", "coexec")  # what the search tries
# and what a layout may name: PyTorch's async TP (torchtitan's enable_async_tensor_parallel)
OVERLAP_KINDS: tuple[Overlap, ...] = (*OVERLAPS, "asynctp")
ZERO_STAGES = (1, 3)
MICRO_BATCHES = (1, 2, 4)
VIRTUAL = (2, 4, 8)
MIN_CP_TOKENS = 2048  # a CP rank keeps at least this many tokens of a sequence


COEXEC_NEEDS = "co-execution needs micro_batches of 2 or more and a schedule other than interleaved"


def can_overlap(layout: Layout, overlap: Overlap) -> bool:
    """Whether `layout` can run `overlap`: co-execution needs a second micro-batch and a
    schedule other than interleaved 1F1B (whose chunks it does not pair)."""
    return overlap != "coexec" or (layout.micro_batches >= 2
                                   and layout.schedule != "interleaved")


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int = 1  # model chunks per pipeline rank (interleaved 1F1B; 2 for DualPipeV's V)
    ep: int = 1
    dp: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    ac: AC = "none"
    zero: int = 1
    schedule: PipelineKind = "none"
    overlap: Overlap = "plain"
    # layers of a rank under `ac`, the first of them (Megatron-LM's recompute_method=block,
    # recompute_num_layers); 0: all; the others save everything
    ac_layers: int = 0

    @property
    def ac_label(self) -> str:
        """`non`, `sel`, `ful`, or `ful5` for full recomputation of 5 layers of a rank."""
        return self.ac[:3] + (str(self.ac_layers) if self.ac != "none" and self.ac_layers
                              else "")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """What one layer's operators depend on: (tp, cp, ep, micro_batch)."""
        return self.tp, self.cp, self.ep, self.micro_batch

    def label(self) -> str:
        parts = [f"tp{self.tp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"vp{self.vp}"] if self.vp > 1 and self.schedule == "interleaved" else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"dp{self.dp}"]
        return " ".join(parts)


def stage_layers(model: ModelSpec, layout: Layout) -> int:
    """Layers on the busiest pipeline rank: an even split rounded up to whole chunks."""
    chunks = layout.pp * layout.vp
    return -(-model.layers // chunks) * layout.vp


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (in O(sqrt n): a billion GPUs or experts answer at
    once)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tensor_sizes(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """TP sizes inside one NVLink domain that split the heads, the key/value heads and the
    MLP evenly."""
    out = []
    for t in divisors(min(cluster.gpus_per_node, model.heads)):
        if model.heads % t or model.ffn % t or (model.kv_heads % t and t % model.kv_heads):
            continue
        if model.moe is not None and model.moe.expert_ffn % t:
            continue
        out.append(t)
    return out


def pipeline_sizes(model: ModelSpec, gpus: int) -> list[int]:
    """PP sizes: those that divide the GPUs and leave a stage at least two layers (the first
    and last stages may hold one layer fewer, as Megatron-LM's uneven split does)."""
    return [p for p in divisors(gpus) if p == 1 or 2 * p <= model.layers]


def interleaves(pp: int, layers: int, v: int) -> bool:
    """Whether interleaved 1F1B can run `v` chunks on each of `pp` ranks: the layers split
    into pp x v equal chunks (Megatron-LM's num_layers_per_virtual_pipeline_stage), the
    embedding and the loss counted as a layer each where that makes them split
    (`account_for_embedding_in_pipeline_split`, `..._loss_...`: Megatron-Bridge's 405B runs
    126 layers as 128 in pp 8 x vp 8)."""
    return pp > 1 and v >= 2 and any((layers + extra) % (pp * v) == 0 for extra in (0, 1, 2))


def schedules(pp: int, layers: int, vp: int | None = None) -> list[tuple[PipelineKind, int]]:
    """(schedule, chunks per rank) for `pp` stages; interleaved 1F1B with `vp` chunks when
    given (any that `interleaves`), else with those of `VIRTUAL` that do."""
    if pp == 1:
        return [("none", 1)]
    out: list[tuple[PipelineKind, int]] = [("1F1B", 1)]
    out += [("interleaved", v) for v in ((vp,) if vp is not None else VIRTUAL)
            if interleaves(pp, layers, v)]
    if 2 * pp <= layers:
        out.append(("DualPipeV", 2))
    return out


def layouts(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq_len: int,
            global_batch: int, *, fixed: dict[str, object] | None = None) -> Iterator[Layout]:
    """Every layout of `gpus` GPUs for `global_batch` sequences of `seq_len` tokens (the
    overlap left `plain`: the step model tries the others), restricted to `fixed` fields (a
    pinned `ac_layers` leaves full checkpointing only, on that many layers)."""
    fixed = fixed or {}
    pinned = fixed.get("ac_layers", 0)
    ac_layers = pinned if isinstance(pinned, int) else 0

    def allowed(name: str, value: object) -> bool:
        return name not in fixed or fixed[name] == value

    experts = model.moe.experts if model.moe is not None else 1
    for tp in tensor_sizes(model, cluster):
        if not allowed("tp", tp) or gpus % tp:
            continue
        for cp in (c for c in divisors(gpus // tp) if c & (c - 1) == 0):
            if not allowed("cp", cp) or seq_len % cp or (cp > 1 and seq_len // cp
                                                         < MIN_CP_TOKENS):
                continue
            if cp > 1 and (seq_len // cp) % tp:
                continue
            for pp in pipeline_sizes(model, gpus // (tp * cp)):
                if not allowed("pp", pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if not allowed("dp", dp):
                    continue
                for ep in divisors(experts):
                    if not allowed("ep", ep) or ep > dp * cp * tp or (dp * cp * tp) % ep:
                        continue
                    yield from _per_batch(model, tp, cp, pp, dp, ep, seq_len, global_batch,
                                          allowed, ac_layers, fixed)


def _per_batch(model: ModelSpec, tp: int, cp: int, pp: int, dp: int, ep: int, seq_len: int,
               global_batch: int, ok: Callable[[str, object], bool],
               ac_layers: int, fixed: dict[str, object]) -> Iterator[Layout]:
    """The layouts of one (tp, cp, pp, dp, ep): micro-batch sizes of `MICRO_BATCHES` (any
    size that divides a data-parallel rank's share when pinned), their schedules."""
    pinned_mb, pinned_vp = fixed.get("micro_batch"), fixed.get("vp")
    sizes = (pinned_mb,) if isinstance(pinned_mb, int) else MICRO_BATCHES
    for mb in sizes:
        if mb < 1 or global_batch % (dp * mb):
            continue
        m = global_batch // (dp * mb)
        if (tp > 1 and (seq_len // cp * mb) % tp) or not ok("micro_batches", m):
            continue
        chunks = pinned_vp if isinstance(pinned_vp, int) and pinned_vp >= 2 else None
        for schedule, vp in schedules(pp, model.layers, chunks):
            if not ok("schedule", schedule) or not ok("vp", vp):
                continue
            if (pp > 1 and m < pp) or (schedule == "interleaved" and m % pp):
                continue
            if schedule == "DualPipeV" and m < 2 * pp:
                continue
            if ac_layers > stage_layers(model, Layout(pp=pp, vp=vp)):  # more than a rank holds
                continue
            for ac in AC_MODES:
                if not ok("ac", ac) or (ac_layers and ac != "full"):
                    continue
                for zero in ZERO_STAGES:
                    if ok("zero", zero):
                        yield Layout(tp, cp, pp, vp, ep, dp, mb, m, ac, zero, schedule,
                                     ac_layers=ac_layers)
