"""An explicit-operator Llama layer with TP + sequence parallelism: every forward and backward
operator of `plait.workload.transformer.build_layer` (the one description of the layer: its
operators' names, order and sizes) computed by a `Unit` with declared inputs and outputs, so
the planner and simulator (which see those operators) and the executor (which runs these
units) talk about the same things; a layer operator without a unit is an error.

Tensors live in a strand's store (one micro-batch, one layer): the forward reads `x` and
writes `out`; the backward reads `d_out` (and the forward's saved tensors) and writes `d_x`, and
accumulates weight gradients into the layer's `grads`. Token-sharded tensors have S/P rows;
gathered ones S. Collective units start asynchronously and return a handle; their outputs exist
once it is waited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from plait.errors import SpecError
from plait.runtime.engines import CollectiveEngine, Handle
from plait.workload.ops import Layer
from plait.workload.transformer import RMS_EPS, LayerShape

Store = dict[str, torch.Tensor]


@dataclass
class LayerParams:
    """One copy of a layer's local weights and their accumulated gradients."""

    g1: torch.Tensor
    wqkv: torch.Tensor  # (H, (heads + 2 kv) * hd)
    wo: torch.Tensor  # (heads * hd, H)
    g2: torch.Tensor
    w1: torch.Tensor  # (H, 2 F)  [gate | up]
    w2: torch.Tensor  # (F, H)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return ("g1", "wqkv", "wo", "g2", "w1", "w2")

    def accumulate(self, name: str, g: torch.Tensor) -> None:
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g.clone()


@dataclass(frozen=True)
class Unit:
    """One operator: `run(store, params, comm)` reads `inputs`, writes `outputs`; a collective
    unit returns the handle of its asynchronous transfer."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run: Callable[[Store, LayerParams, CollectiveEngine], Handle | None]
    collective: bool = False


def rms_norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The layers' RMSNorm (PyTorch's, with the operator model's epsilon)."""
    return F.rms_norm(x, (x.shape[-1],), g, RMS_EPS)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def _rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    r = _rms(x)
    xhat = x * r
    dxhat = dy * g
    dg = (dy * xhat).sum(0)
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, dg


def _gather(out: str, src: str) -> Callable[[Store, LayerParams, CollectiveEngine], Handle]:
    def run(st: Store, _p: LayerParams, comm: CollectiveEngine) -> Handle:
        x = st[src].contiguous()
        st[out] = x.new_empty((comm.world * x.shape[0], *x.shape[1:]))
        return comm.all_gather(st[out], x, f"all-gather {src}")
    return run


def _scatter(out: str, src: str) -> Callable[[Store, LayerParams, CollectiveEngine], Handle]:
    def run(st: Store, _p: LayerParams, comm: CollectiveEngine) -> Handle:
        x = st[src].contiguous()
        st[out] = x.new_empty((x.shape[0] // comm.world, *x.shape[1:]))
        return comm.reduce_scatter(st[out], x, f"reduce-scatter {src}")
    return run


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LayerShape
               ) -> torch.Tensor:
    """Causal attention over local heads; grouped KV heads repeated to the query heads."""
    s = q.shape[0]
    q4 = q.view(s, shape.heads, shape.head_dim).transpose(0, 1)
    rep = shape.heads // shape.kv_heads
    k4 = k.view(s, shape.kv_heads, shape.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
    v4 = v.view(s, shape.kv_heads, shape.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
    o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
    return o.transpose(0, 1).reshape(s, shape.heads * shape.head_dim)


def forward_units(layer: Layer, shape: LayerShape) -> tuple[Unit, ...]:
    """The units of `layer`'s forward operators, in its order (`build_layer` is the one
    description of the layer: names, order and dependencies; these compute it)."""
    return _in_order(layer.forward, _forward_table(shape))


def backward_units(layer: Layer, shape: LayerShape) -> tuple[Unit, ...]:
    """The units of `layer`'s backward operators, in its order."""
    return _in_order(layer.backward, _backward_table(shape))


def _in_order(ops: tuple[object, ...], table: tuple[Unit, ...]) -> tuple[Unit, ...]:
    by_name = {u.name: u for u in table}
    names = [str(getattr(op, "name", op)) for op in ops]
    missing = [n for n in names if n not in by_name]
    if missing or len(names) != len(by_name):
        raise SpecError("model", f"the executable layer has no unit for {missing or 'some'} "
                        f"operators of this layer (it has {', '.join(by_name)})",
                        "co-execute a dense TP+SP layer (tp >= 2, no CP, no MoE)")
    return tuple(by_name[n] for n in names)


def _forward_table(shape: LayerShape) -> tuple[Unit, ...]:
    hq, hk = shape.q_width, shape.kv_width
    f = shape.ffn

    def norm_attn(st: Store, p: LayerParams, _c: Any) -> None:
        st["xn"] = rms_norm(st["x"], p.g1)

    def qkv(st: Store, p: LayerParams, _c: Any) -> None:
        st["qkv"] = st["xg"] @ p.wqkv

    def attn(st: Store, _p: LayerParams, _c: Any) -> None:
        q, k, v = st["qkv"].split([hq, hk, hk], dim=1)
        st["o"] = attention(q, k, v, shape)

    def out_proj(st: Store, p: LayerParams, _c: Any) -> None:
        st["y"] = st["o"] @ p.wo

    def add_attn(st: Store, _p: LayerParams, _c: Any) -> None:
        st["h1"] = st["x"] + st["yr"]

    def norm_mlp(st: Store, p: LayerParams, _c: Any) -> None:
        st["hn"] = rms_norm(st["h1"], p.g2)

    def fc1(st: Store, p: LayerParams, _c: Any) -> None:
        st["u"] = st["hg"] @ p.w1

    def act(st: Store, _p: LayerParams, _c: Any) -> None:
        st["a"] = F.silu(st["u"][:, :f]) * st["u"][:, f:]

    def fc2(st: Store, p: LayerParams, _c: Any) -> None:
        st["z"] = st["a"] @ p.w2

    def add_mlp(st: Store, _p: LayerParams, _c: Any) -> None:
        st["out"] = st["h1"] + st["zr"]

    return (
        Unit("norm_attn", ("x",), ("xn",), norm_attn),
        Unit("ag_attn", ("xn",), ("xg",), _gather("xg", "xn"), collective=True),
        Unit("qkv", ("xg",), ("qkv",), qkv),
        Unit("attn", ("qkv",), ("o",), attn),
        Unit("out_proj", ("o",), ("y",), out_proj),
        Unit("rs_attn", ("y",), ("yr",), _scatter("yr", "y"), collective=True),
        Unit("add_attn", ("x", "yr"), ("h1",), add_attn),
        Unit("norm_mlp", ("h1",), ("hn",), norm_mlp),
        Unit("ag_mlp", ("hn",), ("hg",), _gather("hg", "hn"), collective=True),
        Unit("fc1", ("hg",), ("u",), fc1),
        Unit("act", ("u",), ("a",), act),
        Unit("fc2", ("a",), ("z",), fc2),
        Unit("rs_mlp", ("z",), ("zr",), _scatter("zr", "z"), collective=True),
        Unit("add_mlp", ("h1", "zr"), ("out",), add_mlp),
    )


# Long on purpose: one small function per backward operator, then the table; it reads like
# the layer's backward.
def _backward_table(shape: LayerShape) -> tuple[Unit, ...]:
    """The hand-written backward; weight-gradient units read the re-gathered inputs (`xg2`,
    `hg2`) as Megatron does, so the forward's gathered tensors need not be kept."""
    hq, hk = shape.q_width, shape.kv_width
    f = shape.ffn

    def add_mlp_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        st["d_zr"] = st["d_out"]

    def fc2_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_a"] = st["d_z"] @ p.w2.T

    def fc2_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("w2", st["a"].T @ st["d_z"])

    def act_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        gate, up = st["u"][:, :f], st["u"][:, f:]
        s = torch.sigmoid(gate)
        d_a = st["d_a"]
        st["d_u"] = torch.cat([d_a * up * (s + gate * s * (1 - s)), d_a * gate * s], dim=1)

    def fc1_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_hg"] = st["d_u"] @ p.w1.T

    def fc1_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("w1", st["hg2"].T @ st["d_u"])

    def norm_mlp_bwd(st: Store, p: LayerParams, _c: Any) -> None:
        dx, dg = _rmsnorm_bwd(st["d_hn"], st["h1"], p.g2)
        p.accumulate("g2", dg)
        st["d_h1"] = st["d_out"] + dx

    def out_proj_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_o"] = st["d_y"] @ p.wo.T

    def out_proj_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("wo", st["o"].T @ st["d_y"])

    def attn_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        qkv = st["qkv"].detach().requires_grad_(True)
        with torch.enable_grad():
            q, k, v = qkv.split([hq, hk, hk], dim=1)
            o = attention(q, k, v, shape)
            (d_qkv,) = torch.autograd.grad(o, qkv, st["d_o"])
        st["d_qkv"] = d_qkv

    def qkv_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_xg"] = st["d_qkv"] @ p.wqkv.T

    def qkv_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("wqkv", st["xg2"].T @ st["d_qkv"])

    def norm_attn_bwd(st: Store, p: LayerParams, _c: Any) -> None:
        dx, dg = _rmsnorm_bwd(st["d_xn"], st["x"], p.g1)
        p.accumulate("g1", dg)
        st["d_x"] = st["d_h1"] + dx

    return (
        Unit("add_mlp_bwd", ("d_out",), ("d_zr",), add_mlp_bwd),
        Unit("ag_mlp_dy", ("d_zr",), ("d_z",), _gather("d_z", "d_zr"), collective=True),
        Unit("fc2_dgrad", ("d_z",), ("d_a",), fc2_dgrad),
        Unit("fc2_wgrad", ("a", "d_z"), (), fc2_wgrad),
        Unit("act_bwd", ("u", "d_a"), ("d_u",), act_bwd),
        Unit("fc1_dgrad", ("d_u",), ("d_hg",), fc1_dgrad),
        Unit("rs_mlp_dx", ("d_hg",), ("d_hn",), _scatter("d_hn", "d_hg"), collective=True),
        Unit("ag_mlp_x", ("hn",), ("hg2",), _gather("hg2", "hn"), collective=True),
        Unit("fc1_wgrad", ("hg2", "d_u"), (), fc1_wgrad),
        Unit("norm_mlp_bwd", ("d_hn", "h1", "d_out"), ("d_h1",), norm_mlp_bwd),
        Unit("ag_attn_dy", ("d_h1",), ("d_y",), _gather("d_y", "d_h1"), collective=True),
        Unit("out_proj_dgrad", ("d_y",), ("d_o",), out_proj_dgrad),
        Unit("out_proj_wgrad", ("o", "d_y"), (), out_proj_wgrad),
        Unit("attn_bwd", ("qkv", "d_o"), ("d_qkv",), attn_bwd),
        Unit("qkv_dgrad", ("d_qkv",), ("d_xg",), qkv_dgrad),
        Unit("rs_attn_dx", ("d_xg",), ("d_xn",), _scatter("d_xn", "d_xg"), collective=True),
        Unit("ag_attn_x", ("xn",), ("xg2",), _gather("xg2", "xn"), collective=True),
        Unit("qkv_wgrad", ("xg2", "d_qkv"), (), qkv_wgrad),
        Unit("norm_attn_bwd", ("d_xn", "x", "d_h1"), ("d_x",), norm_attn_bwd),
    )


# Forward tensors the backward reads (kept from forward to backward: activation memory).
SAVED = ("x", "xn", "qkv", "o", "h1", "hn", "u", "a")
