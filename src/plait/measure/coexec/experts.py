"""The expert-parallel MoE MLP of `build_layer` (EP > 1) as co-execution units: the router,
the all-to-all dispatch, the local experts' GEMMs, the all-to-all combine, and their
hand-written backward, operator for operator as the layer lists them.

Routing (one function for the units and the reference, `route`): softmax over the experts,
the top-k of it are a token's gates; each (token, choice) copy takes the next free slot of its
expert's capacity on this rank (`LayerShape.capacity`, in token order: `plait.nn.expert_slots`,
the rule `ExpertParallelMLP.routed` uses too), and copies beyond it are dropped. A rank's send
buffer holds E x capacity rows ordered (expert, slot), that is (destination rank, local expert,
slot): chunk q goes to rank q, which receives the same layout from every rank and runs each
local expert on its P x capacity rows (`_by_expert`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from plait.measure.coexec.values import LayerParams, Store, Unit
from plait.nn import expert_slots
from plait.ops import expert_blocks, expert_unblocks
from plait.runtime import execute
from plait.runtime.context import Group
from plait.runtime.engines import CollectiveEngine, Handle
from plait.schedule.schedule import Schedule
from plait.workload.operators import Axis, OverlapPair
from plait.workload.transformer import LayerShape


@dataclass(frozen=True)
class Routing:
    """Where each kept (token, choice) copy goes: its `token`, `choice` (0..k-1) and `row`
    in the send buffer (expert x capacity + slot); `expert` (T, k) every choice's expert."""

    expert: torch.Tensor
    token: torch.Tensor
    choice: torch.Tensor
    row: torch.Tensor


def route(probs: torch.Tensor, shape: LayerShape) -> Routing:
    """The routing of tokens with expert probabilities `probs` (T, E) (module docstring)."""
    k, cap = shape.top_k, shape.capacity
    expert = probs.detach().topk(k, dim=-1).indices
    flat = expert.reshape(-1)  # copies in token order, choices of a token in order
    slot, _ = expert_slots(flat, shape.experts)
    kept = (slot < cap).nonzero().squeeze(1)
    return Routing(expert, kept // k, kept % k, flat[kept] * cap + slot[kept])


ROUTING = ("expert", "r_token", "r_choice", "r_row")  # what `_routing` reads


def _routing(st: Store) -> Routing:
    return Routing(*(st[name] for name in ROUTING))


def _by_expert(rows: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """Received rows (rank, local expert, slot) as (local expert, rank x slot, width)."""
    e, c = shape.local_experts, shape.capacity
    return rows.view(-1, e, c, rows.shape[-1]).transpose(0, 1).reshape(e, -1, rows.shape[-1])


def _rows(per_expert: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """The inverse of `_by_expert`."""
    e, c, w = shape.local_experts, shape.capacity, per_expert.shape[-1]
    return per_expert.view(e, -1, c, w).transpose(0, 1).reshape(-1, w)


def _exchange(out: str, src: str) -> Callable[[Store, LayerParams, CollectiveEngine], Handle]:
    def run(st: Store, _p: LayerParams, comm: CollectiveEngine) -> Handle:
        x = st[src].contiguous()
        st[out] = torch.empty_like(x)
        return comm.all_to_all(st[out], x, f"all-to-all {src}")
    return run


def _swiglu_bwd(u: torch.Tensor, d_a: torch.Tensor, f: int) -> torch.Tensor:
    gate, up = u[..., :f], u[..., f:]
    s = torch.sigmoid(gate)
    return torch.cat([d_a * up * (s + gate * s * (1 - s)), d_a * gate * s], dim=-1)


def _pack(st: Store, shape: LayerShape) -> torch.Tensor:
    """This rank's send buffer of the dispatch: each kept copy's token in its row."""
    r = _routing(st)
    send = st["hn"].new_zeros(shape.experts * shape.capacity, shape.hidden)
    send[r.row] = st["hn"][r.token]
    return send


def fused(pair: OverlapPair, coll: Unit, gemm: Unit, s: Schedule, rt: Group,
          shape: LayerShape, readers: set[str]) -> Unit:
    """The FiCCO unit `<pair>*` of one of the layer's all-to-all pairs, on plait's executor
    (`exchange`): the dispatch into the experts' first GEMM (`fc1`), the combine gradient
    into the second's data gradient (`fc2_dgrad`), the second GEMM into the combine (`fc2`),
    the first's data gradient into the dispatch gradient (`fc1_dgrad`). Rows go to the
    executor in its block layout (`plait.ops`: (rank, sub-chunk, expert, slot))."""

    P, E = rt.world, shape.local_experts
    c = s.steps if P > 1 else 1
    execute.check_splits(pair.name, shape.capacity, s, "rows per rank and expert")
    label = f"{pair.name}*"

    def weight(p: LayerParams) -> torch.Tensor:
        w = {"fc1": p.w1, "fc2": p.w2, "fc2_dgrad": p.w2.transpose(1, 2),
             "fc1_dgrad": p.w1.transpose(1, 2)}[pair.name]
        return w.contiguous()

    if pair.direction == "in":  # an all-to-all feeding the GEMM: rows received, then used
        src, received = coll.inputs[0], coll.outputs[0]
        (product,) = gemm.outputs
        keep = received in readers  # (weight gradients read it)

        def run_in(st: Store, p: LayerParams, _c: Any) -> None:
            rows = _pack(st, shape) if pair.name == "fc1" else st[src]
            got, (y,) = execute.all_gather_matmul(rt, expert_blocks(rows, P, E, c), [weight(p)], s,
                                                  Axis.M, keep, label, exchange=True)
            if got is not None:
                st[received] = expert_unblocks(got, P, E, c)
            st[product] = _by_expert(expert_unblocks(y, P, E, c), shape)

        inputs = tuple(dict.fromkeys((*coll.inputs, *(i for i in gemm.inputs
                                                      if i != received))))
        return Unit(label, inputs, (product, *((received,) if keep else ())), run_in,
                    fused=str(s))
    (src,), (sent,) = gemm.inputs, coll.outputs

    def run_out(st: Store, p: LayerParams, _c: Any) -> None:
        out = execute.matmul_reduce_scatter(rt, expert_blocks(_rows(st[src], shape), P, E, c),
                                            weight(p), s, label, exchange=True)
        st[sent] = expert_unblocks(out, P, E, c)

    return Unit(label, gemm.inputs, (sent,), run_out, fused=str(s))


def forward_units(shape: LayerShape) -> tuple[Unit, ...]:

    f = shape.expert_ffn

    def router(st: Store, p: LayerParams, _c: Any) -> None:
        assert p.wr is not None
        probs = torch.softmax(st["hn"] @ p.wr, dim=-1)
        r = route(probs, shape)
        st["probs"], st["expert"] = probs, r.expert
        st["r_token"], st["r_choice"], st["r_row"] = r.token, r.choice, r.row

    def pack(st: Store, p: LayerParams, comm: CollectiveEngine) -> Handle:
        st["send"] = _pack(st, shape)
        handle: Handle = _exchange("recv", "send")(st, p, comm)
        return handle

    def fc1(st: Store, p: LayerParams, _c: Any) -> None:
        st["u"] = torch.bmm(_by_expert(st["recv"], shape), p.w1)

    def act(st: Store, _p: LayerParams, _c: Any) -> None:
        st["a"] = F.silu(st["u"][..., :f]) * st["u"][..., f:]

    def fc2(st: Store, p: LayerParams, _c: Any) -> None:
        st["z"] = _rows(torch.bmm(st["a"], p.w2), shape)

    def add_mlp(st: Store, _p: LayerParams, _c: Any) -> None:
        r = _routing(st)
        gates = st["probs"].gather(1, r.expert)
        y = torch.zeros_like(st["h1"])
        y.index_add_(0, r.token, gates[r.token, r.choice, None] * st["zb"][r.row])
        st["out"] = st["h1"] + y

    return (
        Unit("router", ("hn",), ("probs", *ROUTING), router),
        Unit("a2a_dispatch", ("hn", *ROUTING), ("recv",), pack, collective=True),
        Unit("fc1", ("recv",), ("u",), fc1),
        Unit("act", ("u",), ("a",), act),
        Unit("fc2", ("a",), ("z",), fc2),
        Unit("a2a_combine", ("z",), ("zb",), _exchange("zb", "z"), collective=True),
        Unit("add_mlp", ("h1", "zb", "probs", *ROUTING), ("out",), add_mlp),
    )


def backward_units(shape: LayerShape) -> tuple[Unit, ...]:

    f = shape.expert_ffn

    def add_mlp_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        r, d_out = _routing(st), st["d_out"]
        gates = st["probs"].gather(1, r.expert)
        d_zb = torch.zeros_like(st["zb"])
        d_zb[r.row] = gates[r.token, r.choice, None] * d_out[r.token]
        d_gates = torch.zeros_like(gates)
        d_gates[r.token, r.choice] = (d_out[r.token] * st["zb"][r.row]).sum(-1)
        st["d_zb"], st["d_gates"] = d_zb, d_gates

    def fc2_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_a"] = torch.bmm(_by_expert(st["d_z"], shape), p.w2.transpose(1, 2))

    def fc2_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("w2", torch.bmm(st["a"].transpose(1, 2), _by_expert(st["d_z"], shape)))

    def act_bwd(st: Store, _p: LayerParams, _c: Any) -> None:
        st["d_u"] = _swiglu_bwd(st["u"], st["d_a"], f)

    def fc1_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        st["d_recv"] = _rows(torch.bmm(st["d_u"], p.w1.transpose(1, 2)), shape)

    def fc1_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("w1", torch.bmm(_by_expert(st["recv"], shape).transpose(1, 2), st["d_u"]))

    def router_dgrad(st: Store, p: LayerParams, _c: Any) -> None:
        assert p.wr is not None
        r, probs = _routing(st), st["probs"]
        d_probs = torch.zeros_like(probs).scatter_(1, r.expert, st["d_gates"])
        d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        d_hn = d_logits @ p.wr.T
        d_hn.index_add_(0, r.token, st["d_send"][r.row])  # the dispatched copies' gradient
        st["d_logits"], st["d_hn"] = d_logits, d_hn

    def router_wgrad(st: Store, p: LayerParams, _c: Any) -> None:
        p.accumulate("wr", st["hn"].T @ st["d_logits"])

    return (
        Unit("add_mlp_bwd", ("d_out", "zb", "probs", *ROUTING), ("d_zb", "d_gates"),
             add_mlp_bwd),
        Unit("a2a_combine_bwd", ("d_zb",), ("d_z",), _exchange("d_z", "d_zb"),
             collective=True),
        Unit("fc2_dgrad", ("d_z",), ("d_a",), fc2_dgrad),
        Unit("fc2_wgrad", ("a", "d_z"), (), fc2_wgrad),
        Unit("act_bwd", ("u", "d_a"), ("d_u",), act_bwd),
        Unit("fc1_dgrad", ("d_u",), ("d_recv",), fc1_dgrad),
        Unit("a2a_dispatch_bwd", ("d_recv",), ("d_send",), _exchange("d_send", "d_recv"),
             collective=True),
        Unit("fc1_wgrad", ("recv", "d_u"), (), fc1_wgrad),
        Unit("router_dgrad", ("d_gates", "probs", "d_send", *ROUTING), ("d_logits", "d_hn"),
             router_dgrad),
        Unit("router_wgrad", ("hn", "d_logits"), (), router_wgrad),
    )


# Forward tensors the MoE backward reads.


def experts_mlp(hn: torch.Tensor, wr: torch.Tensor, w1: list[torch.Tensor],
                w2: list[torch.Tensor], shape: LayerShape) -> torch.Tensor:
    """The reference: the MoE MLP of one rank's tokens `hn` with every expert's weights
    (`w1[e]` (H, 2 F), `w2[e]` (F, H)), in torch autograd, routed as the units route."""
    probs = torch.softmax(hn @ wr, dim=-1)
    r = route(probs, shape)
    gates = probs.gather(1, r.expert)
    y = torch.zeros_like(hn)
    f = shape.expert_ffn
    for e in range(shape.experts):
        mine = (r.row // shape.capacity) == e
        tokens, choices = r.token[mine], r.choice[mine]
        u = hn[tokens] @ w1[e]
        out = (F.silu(u[:, :f]) * u[:, f:]) @ w2[e]
        y = y.index_add(0, tokens, gates[tokens, choices, None] * out)
    return y
