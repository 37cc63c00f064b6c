"""The whole training step of one layout, predicted: every micro-batch's layers on the busiest
pipeline rank under the layout's overlap, the recomputation its activation checkpointing costs,
the output head and loss, the pipeline schedule's bubble and stage-to-stage transfers, the
data-parallel gradient and parameter collectives (and how much of them hides), the optimizer
and the per-step synchronization. Each mechanism and its source:

- layers: `plait.planner.explore` on one layer (its schedules by the heuristics): `plain` is
  the layer run sequentially as PyTorch's TP runs it (every collective exposed, the gathered
  input kept), `ficco` plait's schedule per pair, `coexec` DHelix's co-execution (the forward
  of micro-batch n beside the backward of n-1, `plait.planner.coexec`), the `OVERLAP_F_B` of
  DualPipeV's steady state.
- attention: cuDNN's fused kernel (TransformerEngine) or FlashAttention-2 (PyTorch SDPA's flash
  backend), each fitted to the FlashAttention-3 paper's H100 measurements
  (`plait.spec.hardware.ATTENTION_KERNELS`).
- memory-bound kernels: fused as the layer model has them (torch.compile, TransformerEngine,
  Megatron-LM), or `eager`: PyTorch op by op, their traffic and kernels counted from the
  operators a Llama block dispatches (`plait.planner.plan.eager`, checked on CPU).
- FP8: each linear's input and output gradient cast to FP8 with its transpose (memory-bound
  kernels, `Job.fp8_casts_s`).
- recomputation: full checkpointing runs the forward again in the backward (Chen et al. 2016;
  Korthikanti et al., MLSys'23); selective, on Megatron-LM's stack, its core attention again
  (the fused attention's forward kernel: Korthikanti et al.), on torchtitan's, its op-level
  SAC: the memory-bound operators and every second matmul of a block.
- bubble: 1F1B (pp - 1) micro-batch slots, interleaved (pp - 1) / v (Narayanan et al.,
  SC'21); DualPipeV simulated from its action lists (`plait.sim.pipeline`).
- data parallel: the distributed optimizer (ZeRO-1) reduce-scatters gradients in the last
  micro-batch's backward and all-gathers parameters in the first forward (Megatron-LM's
  `overlap_grad_reduce`, `overlap_param_gather`); FSDP (ZeRO-3) gathers each layer's
  parameters before its forward and backward and reduce-scatters its gradients after, every
  micro-batch, prefetched one layer ahead (PyTorch FSDP2, `fully_shard`): what the compute
  beside them does not cover is exposed, and the first layer's gather always is. In a
  pipeline FSDP gathers once a step and keeps the parameters (torchtitan:
  `reshard_after_forward=False`), and the gradients accumulate unsharded until the stage's
  last backward, after which all are reduce-scattered at once, exposed
  (`torch.distributed.pipelining`'s `PipelineStage.backward_maybe_with_nosync`). Gradients
  travel in fp32 (`GRAD_BYTES`: both stacks' default reduce dtype), parameters in bf16.
- contention: collective kernels running beside compute slow it by the preset's
  `gemm_slowdown_sm_comm` for as long as they run (`contended_s`): the data-parallel
  collectives the compute hides and, in co-execution, one strand's communication under the
  other's compute (DHelix's successor measured ~10% on H200).
- optimizer: Adam streams its fp32 state through HBM: 34 bytes a parameter (read and write
  weight, momentum and variance, read the gradient twice with the norm, write the bf16
  weight), at the preset's achievable HBM bandwidth.
- synchronization: the loss and the gradient norm, two small all-reduces over every GPU
  (estimate: latency-bound, log2 of the ranks in NIC hops).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from plait.cost.comm import collective_time, elementwise_time, route
from plait.cost.gemm import attention_time, gemm_time
from plait.planner.plan.eager import eager_bytes, eager_kernels
from plait.planner.plan.memory import (
    GRAD_BYTES,
    PARAM_BYTES,
    Memory,
    Stack,
    checkpointed_layers,
    local_params,
    memory,
    params_of,
)
from plait.planner.plan.space import OVERLAPS, Kernels, Layout, Overlap, can_overlap, stage_layers
from plait.sim.pipeline import Costs, dualpipe_v, simulate
from plait.spec.hardware import ClusterSpec
from plait.spec.layout import ModelDType, ParallelSpec
from plait.spec.model import ModelSpec
from plait.workload.operators import (
    Attention,
    Collective,
    CollectiveKind,
    Elementwise,
    Gemm,
    Op,
    Role,
)

if TYPE_CHECKING:
    from plait.planner.explore import Exploration

ADAM_BYTES_PER_PARAM = 34
_dualpipe_v = functools.cache(dualpipe_v)  # the action lists of (pp, micro-batches)


# How a stack counts a token's model FLOPs for its MFU and TFLOP/s (`Job.flops_per_token`)
FlopConvention = Literal["megatron", "torchtitan", "causal"]
FLOP_CONVENTIONS: dict[FlopConvention, str] = {
    "megatron": "Megatron-LM's num_floating_point_operations: 6 x the matmul parameters a token "
                "multiplies by (output head included, embedding lookup not) + 12 x layers x "
                "seq x query width (attention counted as if not causal)",
    "torchtitan": "torchtitan's get_num_flop_per_token: 6 x every parameter but the "
                  "embedding's (norms included) + 12 x layers x seq x query width",
    "causal": "the FLOPs the step performs: 6 x the matmul parameters + 6 x layers x seq x "
              "query width (causal attention computes half the scores)",
}


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """One layer and one micro-batch on one rank, per overlap (seconds)."""

    fwd: dict[str, float]  # plain, ficco; asynctp once asked for (`Job.layer`)
    bwd: dict[str, float]
    exposed: dict[str, float]  # exposed communication of forward + backward
    compute_fwd: float  # compute alone: the bound no overlap beats
    compute_bwd: float
    recompute_selective: float  # what selective recomputation runs again (`Job.layer`)
    plan: dict[str, str]  # plait's schedule per pair (the `ficco` overlap)
    added: float = 0.0  # what eager kernels and FP8 casts add to forward + backward
    weight_grad_bwd: float = 0.0  # the backward's weight-gradient GEMMs (DualPipeV's W)


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted step and memory, and what they are made of (seconds)."""

    layout: Layout
    step_s: float
    plain_step_s: float  # the same layout without overlap
    memory: Memory
    fits: bool
    parts: dict[str, float]
    tokens_per_s_per_gpu: float
    mfu: float
    plan: dict[str, str] = field(default_factory=dict)

    @property
    def overlap_gain(self) -> float:
        return self.plain_step_s / self.step_s - 1 if self.step_s > 0 else 0.0

    @property
    def exposed_comm_s(self) -> float:
        return self.parts.get("exposed_comm", 0.0)


class Job:
    """One model on `gpus` GPUs of `cluster`, `global_batch` sequences of `seq_len` tokens:
    what every layout's prediction shares (layer times by layer shape, memoized)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, gpus: int, seq_len: int,
                 global_batch: int, memory_bytes: float, dtype: ModelDType = "bf16",
                 kernels: Kernels = "fused", attention: str = "cudnn") -> None:
        self.model, self.gpus, self.seq_len, self.kernels = model, gpus, seq_len, kernels
        self.global_batch, self.memory_bytes, self.dtype = global_batch, memory_bytes, dtype
        self.attention = attention
        nodes = max(1, -(-gpus // cluster.gpus_per_node))
        cluster = cluster.with_attention(attention)
        self.cluster = cluster if cluster.nodes == nodes else cluster.with_(nodes=nodes)
        self.params = params_of(model)
        self._layers: dict[tuple[int, int, int, int], LayerTimes] = {}
        self._explored: dict[tuple[int, int, int, int],
                             tuple[Exploration, tuple[float, float]]] = {}
        self._planned: dict[tuple[int, int, int, int], float] = {}
        self._collectives: dict[tuple[CollectiveKind, float, int, int], float] = {}
        self._pipelines: dict[tuple[Layout, str, float | None], float] = {}

    @property
    def activation_bytes(self) -> int:
        """Bytes of a saved activation element: bf16 under fp8 GEMMs (TransformerEngine's
        recipe keeps activations in bf16)."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def stack(self) -> Stack:
        """Whose layers run: eager PyTorch (`--kernels eager`), a fused PyTorch stack
        (torch.compile: fused kernels with FlashAttention-2; DTensor's TP keeps each gathered
        input for the weight gradient), or Megatron-LM with TransformerEngine (fused kernels
        with cuDNN attention: NeMo's stack; sequence parallelism gathers a linear's input
        again in the backward, beside the input-gradient GEMM, and keeps only its shard)."""
        return ("eager" if self.kernels == "eager" else
                "te" if self.attention == "cudnn" else "fused")

    def memory(self, layout: Layout) -> Memory:
        """The busiest GPU's memory under `layout`, its activations saved as the job's stack
        saves them (`memory.saved_bytes`), FP8 inputs cached under `--dtype fp8`."""
        return memory(self.model, layout, self.seq_len, self.activation_bytes, self.stack,
                      self.dtype == "fp8")

    def tokens(self, layout: Layout) -> int:
        """Tokens of one micro-batch on one CP rank (the GEMMs' M inside a TP group)."""
        return layout.micro_batch * self.seq_len // layout.cp

    def hbm_s(self, nbytes: float) -> float:
        """Streaming `nbytes` through HBM at the achievable bandwidth (no launch)."""
        return nbytes / (self.cluster.gpu.hbm_bytes_per_s * self.cluster.params.hbm_fraction)

    def flops_per_token(self, convention: FlopConvention | None = None) -> float:
        """Model FLOPs of one token's forward and backward under `convention`
        (`FLOP_CONVENTIONS`; default: the job's stack's own, `flop_convention`)."""
        m, p = self.model, self.params
        conv = convention or self.flop_convention
        matmuls = m.layers * (p.active_per_token(m) - p.norms) + p.head
        attention = 12 * m.layers * self.seq_len * m.heads * m.head_dim  # as if not causal
        if conv == "torchtitan":  # every parameter but the embedding's: norms too
            return 6 * (matmuls + m.layers * p.norms + m.hidden) + attention
        return 6 * matmuls + (attention if conv == "megatron" else attention / 2)

    @property
    def flop_convention(self) -> FlopConvention:
        """The convention of the stack the job runs (`stack`): Megatron-LM's under its
        stack (TransformerEngine's attention), torchtitan's otherwise."""
        return "megatron" if self.stack == "te" else "torchtitan"

    def parallel(self, layout: Layout) -> ParallelSpec:
        return ParallelSpec(tp=layout.tp, sp=layout.tp > 1, cp=layout.cp, ep=layout.ep,
                            micro_batch=layout.micro_batch, seq_len=self.seq_len,
                            dtype=self.dtype, regather=self.stack == "te",
                            dp=max(1, layout.dp),
                            pp=1)

    def layer(self, layout: Layout, overlap: Overlap = "plain") -> LayerTimes:
        """One layer's times under each overlap (`LayerTimes`), explored once per layer
        shape; PyTorch's async TP (`asynctp`, a layer simulation of its own) only once an
        `overlap` asks for it."""
        key = layout.shape
        if key not in self._layers:
            from plait.planner.explore import explore

            e = explore(self.model, self.parallel(layout), self.cluster, fast=True)
            # without overlap Megatron-LM still gathers again beside the input gradient
            (sf, sb), (cf, cb) = e.phases("megatron" if self.stack == "te" else
                                          "sequential"), e.chosen
            fused = [sum(elementwise_time(op.bytes, self.cluster) for op in ops
                         if isinstance(op, Elementwise)) for ops in (e.layer.forward,
                                                                     e.layer.backward)]
            extra = self.fp8_casts_s(layout)
            if self.kernels == "eager":
                eager = self.eager_s(layout)
                extra = (extra[0] + eager[0] - fused[0], extra[1] + eager[1] - fused[1])
            recompute = (sum(attention_time(op, self.cluster) for op in e.layer.forward
                             if isinstance(op, Attention)) if self.stack == "te" else
                         fused[0] + extra[0] + self.recomputed_matmuls_s(e.layer.forward))
            self._layers[key] = LayerTimes(
                {"plain": sf.time_s + extra[0], "ficco": cf.time_s + extra[0]},
                {"plain": sb.time_s + extra[1], "ficco": cb.time_s + extra[1]},
                {"plain": sf.exposed_comm_s + sb.exposed_comm_s,
                 "ficco": cf.exposed_comm_s + cb.exposed_comm_s},
                sf.compute_s + extra[0], sb.compute_s + extra[1], recompute, e.plan,
                extra[0] + extra[1],
                sum(gemm_time(op, self.cluster) for op in e.layer.backward
                    if isinstance(op, Gemm) and op.role is Role.WEIGHT_GRAD))
            self._explored[key] = e, extra
        lt = self._layers[key]
        if overlap == "asynctp" and overlap not in lt.fwd:
            if layout.tp == 1:  # no TP pair: the plain layer
                for times in (lt.fwd, lt.bwd, lt.exposed):
                    times[overlap] = times["plain"]
            else:
                e, extra = self._explored[key]
                af, ab = e.tool_phases("pytorch")
                lt.fwd[overlap], lt.bwd[overlap] = af.time_s + extra[0], ab.time_s + extra[1]
                lt.exposed[overlap] = af.exposed_comm_s + ab.exposed_comm_s
        return lt

    def exploration(self, layout: Layout) -> Exploration:
        """The layer explored for `layout`'s shape (its pairs and their schedules)."""
        self.layer(layout)
        return self._explored[layout.shape][0]

    def recomputed_matmuls_s(self, forward: tuple[Op, ...]) -> float:
        """The matmuls torchtitan's op-level SAC recomputes (every second one of a block: k,
        the output projection, and the gated MLP's up projection or the plain MLP's second),
        as shares of the layer's fused GEMMs."""
        m = self.model
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        share = {"qkv": kv / (q + 2 * kv), "out_proj": 1.0,
                 "fc1": 0.5 if m.gated_mlp else 0.0, "fc2": 0.0 if m.gated_mlp else 1.0}
        return sum(share[op.name] * gemm_time(op, self.cluster) for op in forward
                   if isinstance(op, Gemm) and op.name in share)

    def fp8_casts_s(self, layout: Layout) -> tuple[float, float]:
        """(forward, backward) of FP8 training's casts, one layer: each linear's input cast to
        FP8 with its transpose for the weight gradient in the forward (read 2 bytes, write
        1 + 1), each output's gradient likewise in the backward (TransformerEngine's fused
        cast-transpose; torchao's Float8 casts the same tensors); column-parallel inputs are
        cast on the sequence shard before their FP8 all-gather. 0 unless the GEMMs are FP8."""
        if self.dtype != "fp8":
            return 0.0, 0.0
        m, tp = self.model, layout.tp
        tokens = self.tokens(layout)
        shard, d = tokens // tp, m.head_dim
        q, kv = m.heads // tp * d, max(1, m.kv_heads // tp) * d
        f = (m.ffn if m.moe is None else m.moe.top_k * m.moe.expert_ffn) // tp
        up = f * (2 if m.gated_mlp else 1)
        inputs = 2 * shard * m.hidden + tokens * (q + f)  # qkv, fc1 | out_proj, fc2
        outputs = tokens * (q + 2 * kv + up) + 2 * tokens * m.hidden
        kernels = 4 * self.cluster.gpu.launch_overhead_s  # one cast per linear
        return self.hbm_s(4 * inputs) + kernels, self.hbm_s(4 * outputs) + kernels

    def eager_s(self, layout: Layout) -> tuple[float, float]:
        """(forward, backward) of one layer's memory-bound operators run eagerly
        (`plait.planner.plan.eager`): their bytes at the achievable HBM bandwidth and a launch
        per kernel."""
        launch = self.cluster.gpu.launch_overhead_s
        scale = self.activation_bytes / 2  # the count is of bf16 tensors
        fwd, bwd = eager_bytes(self.model, self.tokens(layout), layout.tp)
        fwd_kernels, bwd_kernels = eager_kernels(self.model, layout.tp)
        return (self.hbm_s(fwd * scale) + fwd_kernels * launch,
                self.hbm_s(bwd * scale) + bwd_kernels * launch)

    def pair_s(self, layout: Layout, planned: bool = False) -> float:
        """One co-executed layer pair (a forward beside another micro-batch's backward).
        By default its overlap bound: each strand's communication hidden under the other's
        compute, that compute slowed by the preset's contention (`gemm_slowdown_sm_comm`)
        while it runs beside communication, never shorter than the communication itself.
        `planned`: DHelix's plan of the pair as `plait coexec plan` simulates it (the
        better of co-execution with and without FiCCO units), a fraction of a second per
        layer shape."""
        lt = self.layer(layout)
        compute = lt.compute_fwd + lt.compute_bwd
        comm = lt.exposed["plain"]
        bound = max(self.contended_s(compute, comm), comm)
        if not planned or comm <= 0:
            return bound
        key = layout.shape
        if key not in self._planned:
            from plait.planner.coexec.variants import predict_coexec

            r = predict_coexec(self.model, self.parallel(layout).model_copy(
                update={"num_micro_batches": 2}), self.cluster, fast=True)
            self._planned[key] = min(v.pair_s for v in r.variants if v.pair_s is not None)
        return self._planned[key] + lt.added  # the plan's layer has neither

    def contended_s(self, compute: float, comm: float) -> float:
        """`compute` seconds of kernels with `comm` seconds of collective kernels running
        beside them: slowed by `gemm_slowdown_sm_comm` while both run."""
        return compute + self.cluster.params.gemm_slowdown_sm_comm * min(comm, compute)

    # ---- the step's parts -------------------------------------------------------------------

    def head_s(self, layout: Layout) -> float:
        """The output projection forward and backward and the cross-entropy, one micro-batch."""
        tokens = self.tokens(layout)
        v, h = self.model.vocab // layout.tp, self.model.hidden
        g = Gemm("head", tokens, v, h, self.dtype)
        loss = elementwise_time(3 * tokens * v * (self.activation_bytes + 4), self.cluster)
        return 3 * gemm_time(g, self.cluster) + loss

    def transfer_s(self, layout: Layout) -> float:
        """One micro-batch's activations to the next pipeline stage (tp x cp ranks on)."""
        if layout.pp == 1:
            return 0.0
        tokens = self.tokens(layout)
        nbytes = tokens * self.model.hidden * self.activation_bytes / layout.tp
        link = route(self.cluster, 1, layout.tp * layout.cp)
        return link.latency_s + nbytes / link.bytes_per_s

    def data_parallel(self, layout: Layout, fwd_s: float, bwd_s: float) -> tuple[float, float]:
        """(time of the data-parallel collectives, the part the compute does not hide) of one
        step, given one micro-batch's forward and backward on the stage."""
        group = layout.dp * layout.cp
        if group == 1:
            return 0.0, 0.0
        layers = stage_layers(self.model, layout)
        params = local_params(self.model, layout).total
        stride = layout.tp * layout.cp if layout.cp == 1 else layout.tp
        ag = self.collective_s(CollectiveKind.AG, params * PARAM_BYTES, group, stride)
        rs = self.collective_s(CollectiveKind.RS, params * GRAD_BYTES, group, stride)
        m = layout.micro_batches
        if layout.zero >= 3 and layout.pp == 1:  # gathered for the forward and the backward
            fwd_exposed = max(0.0, ag - fwd_s)
            bwd_exposed = max(0.0, ag + rs - bwd_s)
            exposed = m * (fwd_exposed + bwd_exposed + ag / layers)
            return m * (2 * ag + rs), exposed
        if layout.zero >= 3:  # in a pipeline: gathered once, reduced once, after the last backward
            exposed = max(0.0, ag - fwd_s) + ag / layers + rs
            return ag + rs, exposed
        exposed = max(0.0, rs - bwd_s) + max(0.0, ag - fwd_s) + (ag + rs) / layers
        return ag + rs, exposed

    def collective_s(self, kind: CollectiveKind, nbytes: float, group: int, stride: int
                     ) -> float:
        """A collective's time, memoized (many layouts share their data-parallel ones)."""
        key = (kind, nbytes, group, stride)
        if key not in self._collectives:
            self._collectives[key] = collective_time(
                Collective(f"dp_{kind}", kind, nbytes, group, stride), self.cluster)
        return self._collectives[key]

    def optimizer_s(self, layout: Layout) -> float:
        return self.hbm_s(local_params(self.model, layout).sharded * ADAM_BYTES_PER_PARAM)

    def sync_s(self) -> float:
        c, hops = self.cluster, max(1.0, math.log2(self.gpus))
        return 2 * (c.params.comm_kernel_overhead_s + 2 * hops * c.nic.latency_s)

    # ---- one layout -------------------------------------------------------------------------

    def pipeline_s(self, layout: Layout, overlap: Overlap, pair: float | None) -> float:
        """Every micro-batch through the busiest rank's layers, the bubble and the transfers
        (memoized: a layout is predicted again under other overlaps and memory limits)."""
        key = (replace(layout, overlap="plain"), overlap, pair)
        if key not in self._pipelines:
            self._pipelines[key] = self._pipeline_s(layout, overlap, pair)
        return self._pipelines[key]

    def _pipeline_s(self, layout: Layout, overlap: Overlap, pair: float | None) -> float:
        o: Overlap = "plain" if overlap == "coexec" else overlap
        lt = self.layer(layout, o)
        n = stage_layers(self.model, layout)
        f = lt.fwd[o]
        b = lt.bwd[o] + self.recompute_s(layout, lt.fwd["plain"])
        m, pp, v = layout.micro_batches, layout.pp, layout.vp
        head = self.head_s(layout)
        xfer = self.transfer_s(layout)
        if layout.schedule == "DualPipeV":
            chunk = n // 2
            fb = None
            if pair is not None:
                fb_s = chunk * (pair + b - lt.bwd[o])  # recomputation runs in the pair too

                def fb_cost(_f: int, _b: int) -> float:
                    return fb_s
                fb = fb_cost
            costs = Costs(lambda _s: chunk * f, lambda _s: chunk * b,
                          lambda _s: chunk * lt.weight_grad_bwd, xfer, fb)
            return simulate(_dualpipe_v(pp, m), costs).step_s + m * head
        per_mb = n * (f + b) + head
        bubble = (pp - 1) / v * per_mb if pp > 1 else 0.0
        if pair is not None and m > 1:
            steady = n * (f + b + (m - 1) * (pair + b - lt.bwd[o])) + m * head
        else:
            steady = m * per_mb
        return steady + bubble + 2 * (pp - 1) * xfer

    def recompute_s(self, layout: Layout, forward: float) -> float:
        """What activation checkpointing adds to a layer's backward, averaged over the rank's
        layers: the forward again (`forward`) under full checkpointing, selective's share of
        it, on the checkpointed layers only (`checkpointed_layers`)."""
        per = {"none": 0.0, "selective": self.layer(layout).recompute_selective,
               "full": forward}[layout.ac]
        return per * checkpointed_layers(self.model, layout) / stage_layers(self.model, layout)

    def bound_s(self, layout: Layout) -> float:
        """A lower bound of the layout's step under any overlap: its compute alone, the
        bubble included (DualPipeV's: the rank at the V's turn waits for pp - 1 forward
        chunks before its first action, `_pipeline_s`'s simulation)."""
        lt = self.layer(layout)
        n = stage_layers(self.model, layout)
        rec = self.recompute_s(layout, lt.compute_fwd)
        per_mb = n * (lt.compute_fwd + lt.compute_bwd + rec) + self.head_s(layout)
        m, pp, v = layout.micro_batches, layout.pp, layout.vp
        if layout.schedule == "DualPipeV":
            bubble = (pp - 1) * (n // 2) * lt.compute_fwd
        else:
            bubble = 0.0 if layout.schedule == "none" else (pp - 1) / v * per_mb
        return m * per_mb + bubble + self.optimizer_s(layout)

    def predict(self, layout: Layout, overlaps: tuple[Overlap, ...] = OVERLAPS,
                planned: bool = False) -> Prediction:
        """The layout's step under each of `overlaps` it can run (`can_overlap`), the fastest
        kept (plain where it can run none); `plain_step_s` is the same layout without
        overlap. `planned`: co-execution's pair as its plan simulates it (`pair_s`), not its
        bound."""
        lt = self.layer(layout)
        n = stage_layers(self.model, layout)
        opt, sync = self.optimizer_s(layout), self.sync_s()
        steps: dict[str, tuple[float, dict[str, float]]] = {}
        pipes: dict[str, float] = {}
        tried: list[Overlap] = ["plain", *[x for x in overlaps if x != "plain"]]
        for o in tried:
            if not can_overlap(layout, o):
                continue
            pipes[o] = pipe = self.pipeline_s(layout, o,
                                              self.pair_s(layout, planned)
                                              if o == "coexec" else None)
            base: Overlap = "plain" if o == "coexec" else o
            lt = self.layer(layout, base)
            dp_s, dp_exposed = self.data_parallel(
                layout, n * lt.fwd[base], n * lt.bwd[base])
            layer_exposed = (lt.exposed[base] * n * layout.micro_batches if o != "coexec"
                             else max(0.0, lt.exposed["plain"] * n * layout.micro_batches
                                      - (pipes["plain"] - pipe)))
            # the hidden data-parallel collectives slow the compute they run beside
            dp_contention = self.contended_s(pipe, dp_s - dp_exposed) - pipe
            parts = {"pipeline": pipe, "dp_comm": dp_s, "dp_exposed": dp_exposed,
                     "dp_contention": dp_contention, "optimizer": opt, "sync": sync,
                     "exposed_comm": max(0.0, layer_exposed) + dp_exposed}
            steps[o] = (pipe + dp_exposed + dp_contention + opt + sync, parts)
        best = min((o for o in steps if o in overlaps), key=lambda k: steps[k][0],
                   default="plain")
        chosen = replace(layout, overlap=best)  # type: ignore[arg-type]
        step, parts = steps[best]
        mem = self.memory(chosen)
        tokens = self.global_batch * self.seq_len
        peak = self.cluster.gpu.flops(self.dtype)
        return Prediction(chosen, step, steps["plain"][0], mem,
                          mem.total <= self.memory_bytes, parts,
                          tokens / step / self.gpus,
                          self.flops_per_token() * tokens / (step * self.gpus * peak),
                          lt.plan if best in ("ficco", "coexec") else {})
