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

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from plait.errors import SpecError
from plait.measure.coexec import experts
from plait.measure.coexec.values import LayerParams, Matmul, Store, Unit
from plait.runtime.context import Group
from plait.runtime.engines import CollectiveEngine, Handle
from plait.runtime.execute import all_gather_matmul, matmul_reduce_scatter
from plait.schedule.schedule import Schedule
from plait.workload.operators import Axis, CollectiveKind, Layer, OverlapPair
from plait.workload.transformer import RMS_EPS, LayerShape


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


def _gemm(name: str, mm: Matmul, *more_inputs: str) -> Unit:
    def run(st: Store, p: LayerParams, _c: Any) -> None:
        mm.write(st, p, mm.operand(st) @ mm.b(st, p))
    return Unit(name, (mm.a, *more_inputs), (mm.out,) if mm.out else (), run, matmul=mm)


def _weight(name: str, transposed: bool = False
            ) -> Callable[[Store, LayerParams], torch.Tensor]:
    def get(_st: Store, p: LayerParams) -> torch.Tensor:
        w: torch.Tensor = getattr(p, name)
        return w.T if transposed else w
    return get


def _tensor(name: str) -> Callable[[Store, LayerParams], torch.Tensor]:
    return lambda st, _p: st[name]


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
    return _in_order(layer.forward, _forward_table(shape, _names(layer.forward)))


def backward_units(layer: Layer, shape: LayerShape) -> tuple[Unit, ...]:
    """The units of `layer`'s backward operators, in its order."""
    return _in_order(layer.backward, _backward_table(shape, _names(layer.backward)))


def _names(ops: tuple[object, ...]) -> frozenset[str]:
    return frozenset(str(getattr(op, "name", op)) for op in ops)


def fuse(units: tuple[Unit, ...], layer: Layer, schedules: Mapping[str, Schedule], rt: Group,
         shape: LayerShape | None = None, kept: frozenset[str] = frozenset()
         ) -> tuple[Unit, ...]:
    """`units` (one strand's, in order) with each dependent (collective, GEMM) pair of `layer`
    that `schedules` names (pair name -> schedule) made one unit `<pair>*` in the place of the
    pair's first unit: the names the planner gives fused strands (`CoexecCosts`). It runs the
    pair with plait's FiCCO executor under its schedule on `rt`: an all-gather feeding the
    GEMM (rows, or the tokens a weight gradient sums over), or the GEMM feeding a
    reduce-scatter; an expert-parallel layer's all-to-all pairs (`experts.fused`, which
    needs the layer's `shape`). `kept`: what the other pass reads of this one's tensors
    (`saved`), which the fused units keep too."""
    by_name = {u.name: u for u in units}
    out: list[Unit] = []
    done: set[str] = set()
    for u in units:
        pair = layer.pair_of(u.name)
        if u.name in done:
            continue
        if pair is None or pair.name not in schedules or pair.gemm.name not in by_name:
            out.append(u)
            continue
        coll, gemm = by_name[pair.collective.name], by_name[pair.gemm.name]
        readers = {i for v in units if v.name not in (coll.name, gemm.name)
                   for i in v.inputs} | kept
        if pair.collective.kind is CollectiveKind.A2A:
            if shape is None:
                raise ValueError("fusing an all-to-all pair needs the layer's shape")
            out.append(experts.fused(pair, coll, gemm, schedules[pair.name], rt, shape,
                                     readers))
        else:
            out.append(_fused(pair, coll, gemm, schedules[pair.name], rt, readers))
        done |= {coll.name, gemm.name}
    return tuple(out)


def _fused(pair: OverlapPair, coll: Unit, gemm: Unit, s: Schedule, rt: Group,
           readers: set[str]) -> Unit:
    """The FiCCO unit of `pair` (`fuse`); `readers`: what the strand's other units read."""
    mm = gemm.matmul
    if mm is None:
        raise SpecError("model", f"unit {gemm.name} is not a declared GEMM", "declare its Matmul")
    label = f"{pair.name}*"
    if pair.direction == "in":
        if pair.collective.kind is not CollectiveKind.AG or mm.a != coll.outputs[0]:
            raise SpecError("model", f"{pair.name}: a gathered pair must be an all-gather "
                            "feeding the GEMM's first operand", "fuse only such pairs")
        src, gathered = coll.inputs[0], coll.outputs[0]
        keep = gathered in readers  # e.g. the weight gradient reads the gathered d_out
        tokens = pair.axis is Axis.K  # a weight gradient: A = gathered^T, split along K

        def run_in(st: Store, p: LayerParams, _c: Any) -> None:
            shard = st[src].T.contiguous() if tokens else st[src]
            a, (product,) = all_gather_matmul(rt, shard, [mm.b(st, p)], s, pair.axis, keep,
                                              label)
            if a is not None:
                st[gathered] = a.T if tokens else a
            mm.write(st, p, product)

        inputs = tuple(dict.fromkeys((*coll.inputs, *(i for i in gemm.inputs
                                                      if i != gathered))))
        outputs = (*gemm.outputs, *((gathered,) if keep else ()))
        return Unit(label, inputs, outputs, run_in, fused=str(s))
    if pair.collective.kind is not CollectiveKind.RS or coll.inputs[0] != mm.out:
        raise SpecError("model", f"{pair.name}: a scattered pair must be the GEMM's product "
                        "reduce-scattered", "fuse only such pairs")
    if mm.out in readers:
        raise SpecError("model", f"{pair.name}: another unit reads the unscattered product "
                        f"{mm.out}", "fuse only pairs whose product only the scatter reads")
    scattered = coll.outputs[0]

    def run_out(st: Store, p: LayerParams, _c: Any) -> None:
        st[scattered] = matmul_reduce_scatter(rt, mm.operand(st), mm.b(st, p), s, label)

    return Unit(label, gemm.inputs, (scattered,), run_out, fused=str(s))


def _in_order(ops: tuple[object, ...], table: tuple[Unit, ...]) -> tuple[Unit, ...]:
    by_name = {u.name: u for u in table}
    names = [str(getattr(op, "name", op)) for op in ops]
    missing = [n for n in names if n not in by_name]
    if missing or len(names) != len(by_name):
        raise SpecError("model", f"the executable layer has no unit for {missing or 'some'} "
                        f"operators of this layer (it has {', '.join(by_name)})",
                        "co-execute a dense TP+SP layer (tp >= 2, no CP) or an "
                        "expert-parallel MoE layer (tp = 1, ep = dp)")
    return tuple(by_name[n] for n in names)


def _forward_table(shape: LayerShape, names: frozenset[str]) -> tuple[Unit, ...]:
    """The forward's units; without TP (no `ag_attn`) the attention reads and writes the
    sequence directly; a MoE layer's MLP is `experts`'."""
    hq, hk = shape.q_width, shape.kv_width
    f = shape.ffn
    tp = "ag_attn" in names
    xg, y = ("xg", "y") if tp else ("xn", "yr")

    def norm_attn(st: Store, p: LayerParams, _c: Any) -> None:
        st["xn"] = rms_norm(st["x"], p.g1)

    def attn(st: Store, _p: LayerParams, _c: Any) -> None:
        q, k, v = st["qkv"].split([hq, hk, hk], dim=1)
        st["o"] = attention(q, k, v, shape)

    def add_attn(st: Store, _p: LayerParams, _c: Any) -> None:
        st["h1"] = st["x"] + st["yr"]

    def norm_mlp(st: Store, p: LayerParams, _c: Any) -> None:
        st["hn"] = rms_norm(st["h1"], p.g2)

    def act(st: Store, _p: LayerParams, _c: Any) -> None:
        st["a"] = F.silu(st["u"][:, :f]) * st["u"][:, f:]

    def add_mlp(st: Store, _p: LayerParams, _c: Any) -> None:
        st["out"] = st["h1"] + st["zr"]

    attention_units = (
        Unit("norm_attn", ("x",), ("xn",), norm_attn),
        *((Unit("ag_attn", ("xn",), ("xg",), _gather("xg", "xn"), collective=True),) if tp
          else ()),
        _gemm("qkv", Matmul(xg, _weight("wqkv"), out="qkv")),
        Unit("attn", ("qkv",), ("o",), attn),
        _gemm("out_proj", Matmul("o", _weight("wo"), out=y)),
        *((Unit("rs_attn", ("y",), ("yr",), _scatter("yr", "y"), collective=True),) if tp
          else ()),
        Unit("add_attn", ("x", "yr"), ("h1",), add_attn),
        Unit("norm_mlp", ("h1",), ("hn",), norm_mlp),
    )
    if "router" in names:
        return (*attention_units, *experts.forward_units(shape))
    return (
        *attention_units,
        Unit("ag_mlp", ("hn",), ("hg",), _gather("hg", "hn"), collective=True),
        _gemm("fc1", Matmul("hg", _weight("w1"), out="u")),
        Unit("act", ("u",), ("a",), act),
        _gemm("fc2", Matmul("a", _weight("w2"), out="z")),
        Unit("rs_mlp", ("z",), ("zr",), _scatter("zr", "z"), collective=True),
        Unit("add_mlp", ("h1", "zr"), ("out",), add_mlp),
    )


# Long on purpose: one small function per backward operator, then the table; it reads like
# the layer's backward.
def _backward_table(shape: LayerShape, names: frozenset[str]) -> tuple[Unit, ...]:
    """The hand-written backward; weight-gradient units read the re-gathered inputs (`xg2`,
    `hg2`) as Megatron does, so the forward's gathered tensors need not be kept, or, in a
    layer without those re-gathers (`keeping_gathered_inputs`), the forward's (`xg`, `hg`),
    which are then kept. Without TP the attention's backward reads and writes the sequence
    directly."""
    hq, hk = shape.q_width, shape.kv_width
    f = shape.ffn
    tp = "ag_attn_dy" in names
    regather = "ag_attn_x" in names
    d_y, d_xg = ("d_y", "d_xg") if tp else ("d_h1", "d_xn")
    xg2 = ("xg2" if regather else "xg") if tp else "xn"
    hg2 = "hg2" if "ag_mlp_x" in names else "hg"

    def add_mlp_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        st["d_zr"] = st["d_out"]

    def act_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        gate, up = st["u"][:, :f], st["u"][:, f:]
        s = torch.sigmoid(gate)
        d_a = st["d_a"]
        st["d_u"] = torch.cat([d_a * up * (s + gate * s * (1 - s)), d_a * gate * s], dim=1)

    def norm_mlp_bwd(st: Store, p: LayerParams, _c: Any) -> None:
        dx, dg = _rmsnorm_bwd(st["d_hn"], st["h1"], p.g2)
        p.accumulate("g2", dg)
        st["d_h1"] = st["d_out"] + dx

    def attn_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        qkv = st["qkv"].detach().requires_grad_(True)
        with torch.enable_grad():
            q, k, v = qkv.split([hq, hk, hk], dim=1)
            o = attention(q, k, v, shape)
            (d_qkv,) = torch.autograd.grad(o, qkv, st["d_o"])
        st["d_qkv"] = d_qkv

    def norm_attn_bwd(st: Store, p: LayerParams, _c: Any) -> None:
        dx, dg = _rmsnorm_bwd(st["d_xn"], st["x"], p.g1)
        p.accumulate("g1", dg)
        st["d_x"] = st["d_h1"] + dx

    mlp = experts.backward_units(shape) if "router_dgrad" in names else (
        Unit("add_mlp_bwd", ("d_out",), ("d_zr",), add_mlp_bwd),
        Unit("ag_mlp_dy", ("d_zr",), ("d_z",), _gather("d_z", "d_zr"), collective=True),
        _gemm("fc2_dgrad", Matmul("d_z", _weight("w2", transposed=True), out="d_a")),
        _gemm("fc2_wgrad", Matmul("a", _tensor("d_z"), grad="w2"), "d_z"),
        Unit("act_bwd", ("u", "d_a"), ("d_u",), act_bwd),
        _gemm("fc1_dgrad", Matmul("d_u", _weight("w1", transposed=True), out="d_hg")),
        Unit("rs_mlp_dx", ("d_hg",), ("d_hn",), _scatter("d_hn", "d_hg"), collective=True),
        *((Unit("ag_mlp_x", ("hn",), ("hg2",), _gather("hg2", "hn"), collective=True),)
          if hg2 == "hg2" else ()),
        _gemm("fc1_wgrad", Matmul(hg2, _tensor("d_u"), grad="w1"), "d_u"),
    )
    return (
        *mlp,
        Unit("norm_mlp_bwd", ("d_hn", "h1", "d_out"), ("d_h1",), norm_mlp_bwd),
        *((Unit("ag_attn_dy", ("d_h1",), ("d_y",), _gather("d_y", "d_h1"), collective=True),)
          if tp else ()),
        _gemm("out_proj_dgrad", Matmul(d_y, _weight("wo", transposed=True), out="d_o")),
        _gemm("out_proj_wgrad", Matmul("o", _tensor(d_y), grad="wo"), d_y),
        Unit("attn_bwd", ("qkv", "d_o"), ("d_qkv",), attn_bwd),
        _gemm("qkv_dgrad", Matmul("d_qkv", _weight("wqkv", transposed=True), out=d_xg)),
        *((Unit("rs_attn_dx", ("d_xg",), ("d_xn",), _scatter("d_xn", "d_xg"),
                collective=True),) if tp else ()),
        *((Unit("ag_attn_x", ("xn",), ("xg2",), _gather("xg2", "xn"), collective=True),)
          if regather else ()),
        _gemm("qkv_wgrad", Matmul(xg2, _tensor("d_qkv"), grad="wqkv"), "d_qkv"),
        Unit("norm_attn_bwd", ("d_xn", "x", "d_h1"), ("d_x",), norm_attn_bwd),
    )


def saved(forward: tuple[Unit, ...], backward: tuple[Unit, ...]) -> frozenset[str]:
    """The forward's tensors the backward reads (its input `x` among them): what a layer
    keeps from its forward to its backward, its activation memory."""
    made = {"x", *(o for u in forward for o in u.outputs)}
    return frozenset(i for u in backward for i in u.inputs if i in made)
