"""What one GPU holds under a layout: parameters, gradients and optimizer state as the
data-parallel sharding leaves them, the activations saved for backward (per operator, per
activation-checkpointing mode) times the micro-batches a pipeline schedule keeps in flight,
the logits of the loss, and the buffers overlap adds.

Sources: mixed-precision Adam holds a bf16 weight, an fp32 gradient (both stacks reduce
gradients in fp32 by default: torchtitan's `mixed_precision_reduce = "float32"`, NeMo's
`grad_reduce_in_fp32=True`) and 12 bytes of fp32 master weight, momentum and variance per
parameter. ZeRO stage 1 (Megatron-LM's distributed optimizer) shards the 12 over the
data-parallel group: 6 + 12/d bytes (Megatron-LM's distributed-optimizer guide, "bf16 param,
fp32 grads"); stage 3 (FSDP2) keeps only the fp32 shards, the master weight doubling as the
parameter: (4 + 12)/d (Rajbhandari et al., "ZeRO", SC'20, section 5: 16/d), plus the layers
it has gathered: two at a time, or in a pipeline the whole stage with its unsharded gradients
from the first forward to the last backward (torch.distributed.pipelining). The
saved tensors are the ones PyTorch's autograd keeps for a Llama block run eagerly (the Hugging
Face `LlamaDecoderLayer`, torchtitan's `TransformerBlock`): `saved_bytes` lists them operator by
operator, and `tests/test_activation_memory.py` checks the sum byte for byte on CPU. In-flight
micro-batches per schedule: 1F1B holds pp on its first stage (Narayanan et al., SC'21, section
2.2); interleaved 1F1B 2(pp-1) + (v-1)pp + 1 chunks (Megatron-LM's warm-up count);
DualPipeV pp + 1 micro-batches of its two chunks (DeepSeek's DualPipe table), 2pp + 1 chunks;
each the peak `plait.sim.pipeline` finds running the schedule's action lists (a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.planner.plan.space import AC, Layout, stage_layers
from plait.spec.model import ModelSpec

GiB = 2**30
# bf16 weight, fp32 gradient (reduced in fp32), fp32 master weight and Adam's two moments
PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# The CUDA context, NCCL's buffers and the caching allocator's slack: an estimate (a few GiB
# on every job; PyTorch's memory snapshots show 1-3 GiB of non-tensor use on H100).
RESERVED_BYTES = 3 * GiB


@dataclass(frozen=True, slots=True)
class Params:
    """Parameter counts of `model`: one layer's attention, dense MLP and experts, the
    embedding and the output head."""

    attention: int
    mlp: int  # dense MLP, or the shared part of an MoE block (its router)
    experts: int  # all routed experts of one layer (0: dense)
    norms: int
    embedding: int
    head: int

    @property
    def layer(self) -> int:
        return self.attention + self.mlp + self.experts + self.norms

    def total(self, layers: int) -> int:
        return layers * self.layer + self.embedding + self.head

    def active_per_token(self, model: ModelSpec) -> float:
        """Parameters one token's forward multiplies by: dense, or top-k of the experts."""
        if model.moe is None:
            return float(self.layer)
        per_expert = self.experts / model.moe.experts
        return self.attention + self.mlp + self.norms + per_expert * model.moe.top_k


def params_of(model: ModelSpec) -> Params:
    h, hd = model.hidden, model.head_dim
    q, kv = model.heads * hd, model.kv_heads * hd
    attention = h * (q + 2 * kv) + q * h
    mats = 3 if model.gated_mlp else 2
    if model.moe is None:
        mlp, experts = mats * h * model.ffn, 0
    else:
        mlp, experts = h * model.moe.experts, model.moe.experts * mats * h * model.moe.expert_ffn
    return Params(attention, mlp, experts, 2 * h, model.vocab * h, model.vocab * h)


# Whose kernels save the activations: PyTorch's eager operators (measured on CPU), a
# compiled or fused stack (torch.compile, Megatron-LM's fused kernels), or TransformerEngine's
# layers, which also cache their linears' FP8 inputs under FP8 training.
Stack = Literal["eager", "fused", "te"]


def saved_bytes(model: ModelSpec, tokens: int, tp: int, ac: AC, dtype_bytes: int = 2,
                stack: Stack = "eager", fp8: bool = False) -> float:
    """Bytes one layer keeps for its backward on one rank for `tokens` tokens (a micro-batch
    on one CP rank), as PyTorch's autograd saves them for a Llama block (TP with sequence
    parallelism keeps each column-parallel linear's gathered input, as PyTorch's TP and plait's
    runtime do; RMSNorm computes in fp32):

    - `none`: per RMSNorm its fp32 input, its fp32 reciprocal RMS, its normalized input and its
      output (the next linear's input, gathered under TP); q, k and v after the rotary
      embedding, the attention output and its fp32 log-sum-exp; the gated MLP's gate, up,
      activation and product (two of them without a gate);
    - `full` (the block checkpointed): the block's input;
    - `selective`, by stack: on Megatron-LM's (`te`), its selective recomputation
      (`--recompute-granularity selective`, the core attention: Korthikanti et al., MLSys'23):
      everything `none` keeps but what the fused attention kernel saves for its own backward
      (its log-sum-exp, and its output where the output projection caches an FP8 copy of it
      instead); on torchtitan's (`fused`, `eager`), its op-level SAC (`selective_ac_option =
      "op"`): attention's outputs kept and every other matmul's, counted per block (q, v, the
      gate or first MLP projection, and the gated MLP's down projection), the rest
      recomputed; with the block's input.

    The rotary tables (cos, sin) are shared by all layers and not counted per layer. MoE
    layers: each token's k experts' activations, plus its routing (an estimate, not checked
    against a run).

    `stack` "fused" (without checkpointing; the checkpointed modes save matmul outputs and
    block inputs alike): a fused RMSNorm saves its input in the activation dtype and its
    reciprocal RMS, not an fp32 copy or the normalized input (TransformerEngine's and
    Megatron-LM's norm kernels, Inductor's fused reduction), and a fused SwiGLU its two
    inputs and its product, not the activation apart (Megatron-LM's `bias_swiglu`). "te"
    with `fp8`: TransformerEngine's linears also cache the FP8 input they multiplied for the
    weight gradient (`Linear`/`LayerNormLinear`/`LayerNormMLP` save the FP8 cast): the norm
    outputs and the SwiGLU product in one byte, and an FP8 copy of the attention output
    beside the attention kernel's own; under sequence parallelism it keeps a norm output's
    shard and gathers it again in the backward (Megatron-LM's re-gather). Read from the
    kernels' saved tensors, not measured (no TransformerEngine on CPU)."""
    e = dtype_bytes
    hd, h = model.head_dim, model.hidden
    heads = model.heads // tp
    q, kv = heads * hd, max(1, model.kv_heads // tp) * hd
    shard = tokens // tp  # what a rank holds between TP regions (sequence parallel)
    ffn = model.ffn // tp
    width = ffn if model.moe is None else model.moe.top_k * model.moe.expert_ffn // tp
    if ac == "full":
        return shard * h * e
    attn_out = tokens * q * e + heads * tokens * 4
    if ac == "selective" and stack == "te":  # the core attention recomputed
        kernel_own = heads * tokens * 4 + (tokens * q * e if fp8 else 0)
        return saved_bytes(model, tokens, tp, "none", e, stack, fp8) - kernel_own
    if ac == "selective":  # matmuls 1, 3, 5 (and 7) of q, k, v, o, gate/fc1, up, down
        mlp = tokens * width * e + (tokens * h * e if model.gated_mlp else 0)
        return shard * h * e + tokens * (q + kv) * e + attn_out + mlp
    routing = 0.0 if model.moe is None else shard * (model.moe.experts * 4 + 2 * h * e)
    attention = tokens * (q + 2 * kv) * e + attn_out
    if stack == "eager":
        norm = shard * h * 4 + shard * 4 + shard * h * e + tokens * h * e
        mlp = tokens * width * e * (4 if model.gated_mlp else 2)
        return 2 * norm + attention + mlp + routing
    cached = 1 if stack == "te" and fp8 else e  # a linear's input kept for its weight gradient
    gathered = shard if stack == "te" else tokens  # TE keeps the shard, gathers it again
    norm = shard * h * e + shard * 4 + gathered * h * cached
    mlp = tokens * width * ((2 * e if model.gated_mlp else e) + cached)
    attention += tokens * q * cached if cached != e else 0
    return 2 * norm + attention + mlp + routing


def in_flight(layout: Layout) -> float:
    """Micro-batches' worth of one stage's activations the busiest rank holds at its peak,
    in units of one chunk (layers / (pp x vp)) times vp: the first stage of 1F1B holds pp,
    interleaved 1F1B 2(pp-1) + (v-1)pp + 1 chunks, DualPipeV 2pp + 1 chunks;
    co-execution (`coexec` without pipelining) a second micro-batch beside the first."""
    pp, v, m = layout.pp, layout.vp, layout.micro_batches
    if layout.schedule == "none":
        return 2.0 if layout.overlap == "coexec" and m > 1 else 1.0
    if layout.schedule == "1F1B":
        return float(min(pp, m)) + (1.0 if layout.overlap == "coexec" else 0.0)
    if layout.schedule == "interleaved":
        return min(m * v, 2 * (pp - 1) + (v - 1) * pp + 1) / v
    return (2 * pp + 1) / 2


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes on the busiest GPU, by what holds them."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float  # FSDP's gathered layers, overlap's staging buffers
    reserved: float = RESERVED_BYTES

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.logits
                + self.buffers + self.reserved)

    def as_dict(self) -> dict[str, float]:
        return {"params_gib": self.params / GiB, "grads_gib": self.grads / GiB,
                "optimizer_gib": self.optimizer / GiB, "activations_gib": self.activations / GiB,
                "logits_gib": self.logits / GiB, "buffers_gib": self.buffers / GiB,
                "reserved_gib": self.reserved / GiB, "total_gib": self.total / GiB}


def checkpointed_layers(model: ModelSpec, layout: Layout) -> int:
    """Layers of the busiest rank under the layout's activation checkpointing: none without
    it, `ac_layers` of them where set, else all."""
    n = stage_layers(model, layout)
    if layout.ac == "none":
        return 0
    return min(layout.ac_layers, n) if layout.ac_layers else n


@dataclass(frozen=True, slots=True)
class LocalParams:
    """Parameters on the busiest GPU before data-parallel sharding: the dense ones (attention,
    MLP, norms, the embedding or head of a pipeline's end; over TP) and the experts (over EP
    and TP), and the data-parallel groups that shard each."""

    dense: float
    experts: float
    dense_group: int  # dp x cp
    expert_group: int  # the experts' data-parallel ranks: dp x cp / ep, at least one

    @property
    def total(self) -> float:
        return self.dense + self.experts

    @property
    def sharded(self) -> float:
        """What one rank keeps of them when the data-parallel state is sharded."""
        return self.dense / self.dense_group + self.experts / self.expert_group


def local_params(model: ModelSpec, layout: Layout) -> LocalParams:
    p = params_of(model)
    layers = stage_layers(model, layout)
    # a pipeline's first rank holds the embedding, its last the head (DualPipeV: both on rank
    # 0); vocabulary-parallel over TP
    ends = (p.embedding + p.head if layout.pp == 1 or layout.schedule == "DualPipeV"
            else max(p.embedding, p.head))
    group = layout.dp * layout.cp
    return LocalParams((layers * (p.attention + p.mlp + p.norms) + ends) / layout.tp,
                       layers * p.experts / (layout.ep * layout.tp), group,
                       max(1, group // layout.ep))


def memory(model: ModelSpec, layout: Layout, seq_len: int, dtype_bytes: int = 2,
           stack: Stack = "eager", fp8: bool = False) -> Memory:
    """The busiest GPU's memory under `layout` (`Memory`), its activations as `stack` saves
    them (`saved_bytes`)."""
    tp = layout.tp
    layers = stage_layers(model, layout)
    local = local_params(model, layout)
    if layout.zero >= 3:  # fp32 shards only: the master weight is the parameter
        weights, grads = 0.0, local.sharded * GRAD_BYTES
    else:
        weights, grads = local.total * PARAM_BYTES, local.total * GRAD_BYTES
    optimizer = local.sharded * OPTIMIZER_BYTES
    tokens = layout.micro_batch * seq_len // layout.cp
    every = saved_bytes(model, tokens, tp, "none", dtype_bytes, stack, fp8)
    k = checkpointed_layers(model, layout)
    per_layer = saved_bytes(model, tokens, tp, layout.ac, dtype_bytes, stack, fp8) if k else 0.0
    acts = (per_layer * k + every * (layers - k)) * in_flight(layout)
    if k:  # the layer being recomputed holds all it saves, for a moment
        acts += every
    # the loss: bf16 logits and their fp32 copy for the cross-entropy, vocabulary-parallel
    logits = tokens * model.vocab / tp * (dtype_bytes + 4)
    buffers = 0.0
    if layout.zero >= 3 and layout.pp > 1:  # gathered all step, gradients accumulated unsharded
        buffers += local.total * (PARAM_BYTES + GRAD_BYTES)
    elif layout.zero >= 3:  # one layer gathered, the next prefetched; their gradients
        buffers += 2 * (params_of(model).layer / tp) * (PARAM_BYTES + GRAD_BYTES)
    if layout.overlap in ("ficco", "asynctp") and tp > 1:  # the gathered input, a chunk
        buffers += 2 * tokens * model.hidden * dtype_bytes
    return Memory(weights, grads, optimizer, acts, logits, buffers)
