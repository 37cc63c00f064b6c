"""Per-layer operator sequences of a Megatron-style TP+SP(+CP, +EP) transformer.

Forward (Llama-style, SP on):
    norm_attn, ag_attn -> qkv, attn, out_proj -> rs_attn, add_attn,
    norm_mlp,  ag_mlp  -> fc1, act,  fc2      -> rs_mlp,  add_mlp
Backward (Megatron re-gathers the input of a column-parallel GEMM for its weight gradient):
    ag_mlp_dy -> fc2_dgrad, fc2_wgrad, act_bwd, fc1_dgrad -> rs_mlp_dx, ag_mlp_x -> fc1_wgrad,
    norm_mlp_bwd, ag_attn_dy -> out_proj_dgrad, out_proj_wgrad, attn_bwd,
    qkv_dgrad -> rs_attn_dx, ag_attn_x -> qkv_wgrad, norm_attn_bwd
Stacks that keep the gathered input for the weight gradient: `keeping_gathered_inputs`.
Without SP the AG disappears and the RS becomes an all-reduce. With EP > 1 the MLP is an MoE
block with expert-parallel all-to-all dispatch and combine around the expert GEMMs (expert TP 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.layout import ParallelSpec, check_shardable
from plait.spec.model import ModelSpec
from plait.workload.operators import (
    Attention,
    Axis,
    Collective,
    CollectiveKind,
    Elementwise,
    Gemm,
    Layer,
    Op,
    OverlapPair,
    Role,
    gradient_name,
)

RMS_EPS = 1e-6  # the layers' RMSNorm epsilon (Llama's)


@dataclass(frozen=True, slots=True)
class LayerShape:
    """Per-rank sizes of one TP (+SP, +CP) transformer layer, computed once for the operator
    model, the co-execution units and the reference model."""

    hidden: int
    heads: int  # local query heads (heads / TP)
    kv_heads: int  # local key/value heads (at least one)
    head_dim: int
    ffn: int  # local dense FFN width (ffn / TP)
    tokens: int  # tokens of one micro-batch on a CP rank: the GEMM M dimension
    tokens_local: int  # tokens a rank holds between TP regions (tokens / TP with SP)
    ranks: int  # the TP group
    # expert parallel (a MoE layer with EP > 1; zero otherwise)
    experts: int = 0  # all experts of the layer
    local_experts: int = 0  # experts / EP, on each rank of the EP group
    top_k: int = 0
    expert_ffn: int = 0
    capacity: int = 0  # rows a rank sends each expert: ceil(tokens_local * k * factor / E)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width


def layer_shape(model: ModelSpec, par: ParallelSpec) -> LayerShape:
    """The per-rank sizes of `model`'s layer under `par` (checked shardable)."""
    check_shardable(model, par)
    t, s = par.tp, par.tokens
    local = s // t if par.sp else s
    e = model.moe
    moe = () if e is None or par.ep == 1 else (
        e.experts, e.experts // par.ep, e.top_k, e.expert_ffn,
        max(1, math.ceil(local * e.top_k * par.capacity_factor / e.experts)))
    return LayerShape(model.hidden, model.heads // t, max(1, model.kv_heads // t),
                      model.head_dim, model.ffn // t, s, local, t, *moe)


class _Builder:
    """Accumulates one op sequence and the dependent pairs found in it."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.pairs: list[OverlapPair] = []

    def add(self, *ops: Op) -> None:
        self.ops.extend(ops)

    def comm_then_gemm(self, coll: Collective, gemm: Gemm, axis: Axis, pair: bool) -> None:
        if coll.group == 1:
            self.add(gemm)
            return
        coll = replace(coll, feeds=gemm.name)
        self.add(coll, gemm)
        if pair:
            self.pairs.append(OverlapPair(gemm.name, coll, gemm, "in", axis))

    def gemm_then_comm(self, gemm: Gemm, coll: Collective, pair: bool) -> None:
        self.add(gemm)
        if coll.group == 1:
            return
        coll = replace(coll, fed_by=gemm.name)
        self.add(coll)
        if pair:
            self.pairs.append(OverlapPair(gemm.name, coll, gemm, "out", Axis.M))

    def column_backward(self, dgrad: Gemm, dx: Collective, x: Collective, wgrad: Gemm,
                        sp: bool) -> None:
        """The backward of a column-parallel linear: the data gradient, its reduce-scatter
        (all-reduce without SP), the input's re-gather (SP) and the weight gradient. Megatron-LM
        runs the re-gather beside the data-gradient GEMM and the reduction beside the
        weight-gradient GEMM (megatron/core/tensor_parallel/layers.py,
        LinearWithGradAccumulationAndAsyncCommunication.backward: async all-gather, dgrad
        matmul, wait, async reduce-scatter, wgrad, wait)."""
        self.gemm_then_comm(dgrad, replace(dx, beside=wgrad.name), sp)
        self.comm_then_gemm(replace(x, beside=dgrad.name), wgrad, Axis.K, sp)


@dataclass(frozen=True)
class Gemms:
    """The layer's GEMMs in one dtype: a forward product, or a pair's data or weight gradient
    (named and marked by its role)."""

    dtype: str

    def __call__(self, name: str, m: int, n: int, k: int, count: int = 1) -> Gemm:
        return Gemm(name, m, n, k, self.dtype, count)

    def dgrad(self, pair: str, m: int, n: int, k: int, count: int = 1) -> Gemm:
        return Gemm(gradient_name(pair, Role.DATA_GRAD), m, n, k, self.dtype, count,
                    role=Role.DATA_GRAD)

    def wgrad(self, pair: str, m: int, n: int, k: int, count: int = 1) -> Gemm:
        return Gemm(gradient_name(pair, Role.WEIGHT_GRAD), m, n, k, self.dtype, count,
                    role=Role.WEIGHT_GRAD)


def build_layer(model: ModelSpec, par: ParallelSpec) -> Layer:
    """The forward and backward operator sequences of one layer on one rank."""
    shape = layer_shape(model, par)
    t, dt = par.tp, par.dtype
    # FP8 training as TransformerEngine's recipe runs it: the linear layers' GEMMs and the
    # inputs they gather in FP8; their outputs (so the reduce-scatters), attention, the ring's
    # keys and values and the memory-bound kernels in BF16
    hdt = "bf16" if dt == "fp8" else dt
    b, hb = par.dtype_bytes, DTYPE_BYTES[hdt]
    s, s_local, h = shape.tokens, shape.tokens_local, shape.hidden
    heads, kv, hd, qkv_n = shape.heads, shape.kv_heads, shape.head_dim, shape.qkv_width

    def entry(name: str) -> Collective:  # AG with SP; nothing without (input is replicated)
        return Collective(name, CollectiveKind.AG, s * h * b, t if par.sp else 1)

    def exit_(name: str) -> Collective:  # RS with SP, all-reduce without
        kind = CollectiveKind.RS if par.sp else CollectiveKind.AR
        return Collective(name, kind, s * h * hb, t)

    def ew(name: str, tensors: float, tokens: int = s_local, width: int = h) -> Elementwise:
        return Elementwise(name, tensors * tokens * width * hb)

    g = Gemms(dt)

    # Attention is within a sequence: per sequence, q = seq / cp tokens against the whole
    # sequence's keys, times the micro-batch's sequences (not (micro-batch x seq)^2).
    q_seq = s // par.micro_batch
    attn_fwd = Attention("attn", q_seq, q_seq * par.cp, heads, hd, dtype=hdt,
                         sequences=par.micro_batch)
    attn_bwd = Attention("attn_bwd", q_seq, q_seq * par.cp, heads, hd, backward=True, dtype=hdt,
                         sequences=par.micro_batch)
    kv_bytes = 2 * s * kv * hd * hb * (par.cp - 1)  # ring attention: K and V from every CP peer
    # the ring runs beside the attention blocks (`sim.layer`); in backward it carries the
    # key/value gradients too
    cp_ring = Collective("cp_kv_ring", CollectiveKind.P2P, kv_bytes, par.cp, stride=t,
                         feeds="attn")
    cp_ring_bwd = Collective("cp_kv_ring_bwd", CollectiveKind.P2P, 2 * kv_bytes, par.cp,
                             stride=t, feeds="attn_bwd")

    # ---- forward -----------------------------------------------------------------------------
    f = _Builder()
    f.add(ew("norm_attn", 2))
    f.comm_then_gemm(entry("ag_attn"), g("qkv", s, qkv_n, h), Axis.M, par.sp)
    if par.cp > 1:
        f.add(cp_ring)
    f.add(attn_fwd)
    f.gemm_then_comm(g("out_proj", s, h, heads * hd), exit_("rs_attn"), par.sp)
    f.add(ew("add_attn", 3), ew("norm_mlp", 2))
    # ---- backward (reverse order) -----------------------------------------------------------
    bw = _Builder()
    _mlp(model, par, f, bw, entry, exit_, ew, g)
    bw.add(ew("norm_mlp_bwd", 4))
    bw.comm_then_gemm(entry("ag_attn_dy"), g.dgrad("out_proj", s, heads * hd, h), Axis.M, par.sp)
    bw.add(g.wgrad("out_proj", h, heads * hd, s))
    if par.cp > 1:
        bw.add(cp_ring_bwd)
    bw.add(attn_bwd)
    bw.column_backward(g.dgrad("qkv", s, h, qkv_n), exit_("rs_attn_dx"), entry("ag_attn_x"),
                       g.wgrad("qkv", qkv_n, h, s), par.sp)
    bw.add(ew("norm_attn_bwd", 4))
    layer = Layer(tuple(f.ops), tuple(bw.ops), tuple(f.pairs + bw.pairs))
    return layer if par.regather else keeping_gathered_inputs(layer)


def _mlp(model, par, f, bw, entry, exit_, ew, g) -> None:  # type: ignore[no-untyped-def]
    """Append the MLP (dense or MoE) forward to `f` and its backward to `bw`."""
    t, s, h = par.tp, par.tokens, model.hidden
    up = 2 if model.gated_mlp else 1
    if model.moe is None or par.ep == 1:
        # Dense MLP, or MoE whose experts are tensor-parallel like a dense MLP (expert TP = tp).
        if model.moe is None:
            count, m, ffn = 1, s, model.ffn // t
        else:
            e = model.moe
            m = math.ceil(s * e.top_k * par.capacity_factor / e.experts)
            count, m, ffn = e.experts, max(1, m), e.expert_ffn // t
            f.add(g("router", s // t if par.sp else s, e.experts, h))
        f.comm_then_gemm(entry("ag_mlp"), g("fc1", m, up * ffn, h, count), Axis.M, par.sp)
        f.add(ew("act", 3 * count, m, ffn))
        f.gemm_then_comm(g("fc2", m, h, ffn, count), exit_("rs_mlp"), par.sp)
        f.add(ew("add_mlp", 3))
        bw.add(ew("add_mlp_bwd", 1))
        bw.comm_then_gemm(entry("ag_mlp_dy"), g.dgrad("fc2", m, ffn, h, count), Axis.M, par.sp)
        bw.add(g.wgrad("fc2", ffn, h, m, count), ew("act_bwd", 5 * count, m, ffn))
        bw.column_backward(g.dgrad("fc1", m, h, up * ffn, count), exit_("rs_mlp_dx"),
                           entry("ag_mlp_x"), g.wgrad("fc1", up * ffn, h, m, count), par.sp)
        if model.moe is not None:
            _router_backward(bw, g, s // t if par.sp else s, h, model.moe.experts)
        return
    # Expert parallel: tokens stay sequence-sharded; all-to-all within the EP group.
    e = model.moe
    s_loc = s // t if par.sp else s
    local_experts = e.experts // par.ep
    # token copies a rank sends out (and, balanced, receives), padded to the capacity
    routed = math.ceil(s_loc * e.top_k * par.capacity_factor)
    m = max(1, routed // local_experts)
    ffn = e.expert_ffn
    sent = routed * h * par.dtype_bytes

    def a2a(name: str) -> Collective:
        return Collective(name, CollectiveKind.A2A, sent, par.ep, stride=t)

    f.add(g("router", s_loc, e.experts, h))
    f.comm_then_gemm(a2a("a2a_dispatch"), g("fc1", m, up * ffn, h, local_experts), Axis.M, True)
    f.add(ew("act", 3 * local_experts, m, ffn))
    f.gemm_then_comm(g("fc2", m, h, ffn, local_experts), a2a("a2a_combine"), True)
    f.add(ew("add_mlp", 3))
    bw.add(ew("add_mlp_bwd", 1))
    bw.comm_then_gemm(a2a("a2a_combine_bwd"), g.dgrad("fc2", m, ffn, h, local_experts), Axis.M,
                      True)
    bw.add(g.wgrad("fc2", ffn, h, m, local_experts), ew("act_bwd", 5 * local_experts, m, ffn))
    bw.gemm_then_comm(g.dgrad("fc1", m, h, up * ffn, local_experts), a2a("a2a_dispatch_bwd"),
                      True)
    bw.add(g.wgrad("fc1", up * ffn, h, m, local_experts))
    _router_backward(bw, g, s_loc, h, e.experts)


def keeping_gathered_inputs(layer: Layer) -> Layer:
    """`layer` as the stacks run it that keep each column-parallel linear's gathered input for
    its weight gradient instead of re-gathering it in backward (PyTorch's DTensor tensor
    parallelism as torchtitan runs it, where full activation checkpointing's recomputed forward
    gathers it again; plait's own runtime): the backward's re-gathers, the all-gathers that
    feed a weight-gradient GEMM split along K, are left out with their pairs."""
    backward = {op.name for op in layer.backward}
    regathers = {p.collective.name for p in layer.pairs
                 if p.axis is Axis.K and p.collective.name in backward}
    return Layer(layer.forward, tuple(op for op in layer.backward if op.name not in regathers),
                 tuple(p for p in layer.pairs if p.collective.name not in regathers))


def _router_backward(bw, g, tokens: int, h: int, experts: int) -> None:  # type: ignore[no-untyped-def]
    """The router learns through the gates that weight the experts' outputs: its data
    gradient (added to the MLP input's) and weight gradient, after the experts' backward."""
    bw.add(g.dgrad("router", tokens, h, experts), g.wgrad("router", h, experts, tokens))
