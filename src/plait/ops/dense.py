"""The dense pairs: all-gather -> matmul and matmul -> reduce-scatter (tensor and sequence
parallel), as PyTorch's `fused_all_gather_matmul` and `fused_matmul_reduce_scatter` take them,
each a custom op (`torch.library`) with its fake kernel and its autograd.

A custom op's arguments are tensors and plain values: the group travels as a key
(`plait.runtime.context.group_key`), the schedules as text ("" for a backward schedule derived
from the forward one). The kernel validates, checks that every rank passes the same call (a
small all-gather, at run time, never while tracing) and runs the schedule; the fake kernel
gives shapes to FakeTensor/meta tracing; the backward is built from the same ops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from plait.errors import SpecError
from plait.ops.common import (
    _autocast,
    _dim,
    _filling,
    _group_given,
    _mm_signature,
    _Once,
    _one,
    _own,
    _ran,
    _rows,
    _rows2d,
    _rows_back,
    _rows_first,
    _schedule,
    _signature,
    _signature_of,
    _text,
    _wgrad,
    _world,
)
from plait.runtime import execute, strands
from plait.runtime.context import CallRecord, GroupLike, Runtime, group_key, runtime_of
from plait.schedule.schedule import (
    AUTO,
    Choice,
    Schedule,
    ScheduleLike,
    as_schedule,
)
from plait.tuning.signature import Signature
from plait.tuning.tuner import TORCH_FUSED
from plait.workload.operators import Axis, PairKind


def all_gather_matmul(a_shard: torch.Tensor | None = None,
                      weights: Sequence[torch.Tensor] | None = None,
                      group: GroupLike | int = None, group_name: GroupLike = None, *,
                      gather_dim: int = 0, schedule: ScheduleLike = "seq/sm",
                      backward_schedule: ScheduleLike | None = None,
                      return_gathered: bool = True, return_A: bool | None = None,
                      A_shard: torch.Tensor | None = None,
                      Bs: Sequence[torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Overlapped form of::

        a = all_gather_into_tensor(a_shard, dim=gather_dim)   # concatenated in rank order
        return a, [a @ w for w in weights]

    `gather_dim` is any dimension of `a_shard` except... all of them: a leading dimension is split
    along the GEMM's M (rows); the last one is its K (the reduction; weight-gradient style).
    Backward runs the dual pair (matmul -> reduce-scatter), scheduled by `backward_schedule`.
    PyTorch's call form `fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name,
    return_A=...)` works too, positionally or by its keyword names; `group` is a process group,
    its name, a `DeviceMesh` (1-D) or `(mesh, dim)`. It runs the custom op
    `torch.ops.plait.all_gather_matmul`.
    """
    a_shard = _one("a_shard", a_shard, "A_shard", A_shard)
    weights = _one("weights", weights, "Bs", Bs)
    if isinstance(group, int):  # PyTorch's positional form (A_shard, Bs, gather_dim, group)
        if isinstance(group, bool):
            raise SpecError("group", "True/False is no process group",
                            "pass a process group, its name or a DeviceMesh")
        gather_dim, group = group, group_name
    if return_A is not None:
        return_gathered = return_A
    a_shard, *ws = _autocast(a_shard, *weights)
    outs = torch.ops.plait.all_gather_matmul(a_shard, ws, group_key(group), gather_dim,
                                             _text(schedule), _text(backward_schedule))
    return (outs[0] if return_gathered else None), list(outs[1:])


REDUCE_OPS = ("sum", "avg")


def matmul_reduce_scatter(a: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                          group: GroupLike = None, *args: Any, scatter_dim: int = 0,
                          reduce_op: str = "sum", schedule: ScheduleLike = "seq/sm",
                          backward_schedule: ScheduleLike | None = None,
                          A: torch.Tensor | None = None, B: torch.Tensor | None = None,
                          group_name: GroupLike = None) -> torch.Tensor:
    """Overlapped form of::

        return reduce_scatter_tensor(a @ weight, op=reduce_op, dim=scatter_dim)

    `reduce_op` is "sum" or "avg"; `scatter_dim` any dimension: a leading one scatters the
    GEMM's rows, the last one its columns (N; run as the transposed product). Backward runs the
    dual pair (all-gather -> matmul) scheduled by `backward_schedule`. PyTorch's call form
    `fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)` works too,
    positionally or by its keyword names. It runs the custom op
    `torch.ops.plait.matmul_reduce_scatter`.
    """
    a = _one("a", a, "A", A)
    weight = _one("weight", weight, "B", B)
    if isinstance(group, str) and group in REDUCE_OPS and len(args) <= 2:  # PyTorch's form
        reduce_op, group = group, None  # (A, B, reduce_op, scatter_dim, group_name), any of
        if args:                        # the last two by keyword
            scatter_dim = args[0]
        if len(args) == 2:
            group = args[1]
    elif args:
        raise SpecError("matmul_reduce_scatter", f"{len(args) + 3} positional arguments",
                        "pass (a, weight, group) or PyTorch's (A, B, reduce_op, scatter_dim, "
                        "group_name); the rest by keyword")
    group = _group_given(group, group_name)
    if reduce_op not in REDUCE_OPS:
        raise SpecError("reduce_op", f"{reduce_op!r} is not supported",
                        f"use one of {', '.join(REDUCE_OPS)}")
    key = group_key(group)
    world = _world(key)
    a, weight = _autocast(a, weight)
    d = _dim(scatter_dim, a.dim(), "scatter_dim")
    if d == a.dim() - 1:  # scatter N: the transposed product W^T A^T scatters its rows
        if weight.dim() == 2 and weight.shape[1] % world:
            raise SpecError("weight", f"its {weight.shape[1]} columns (N) do not split over "
                            f"{world} ranks", f"use an N that is a multiple of {world}")
        a2 = _rows2d(a)
        yt = torch.ops.plait.matmul_reduce_scatter(
            weight.T.contiguous(), a2.T.contiguous(), key, 0, _text(schedule),
            _text(backward_schedule))
        y: torch.Tensor = yt.T.reshape(*a.shape[:-1], -1).contiguous()
    else:
        y = torch.ops.plait.matmul_reduce_scatter(a, weight, key, d, _text(schedule),
                                                  _text(backward_schedule))
    return y / world if reduce_op == "avg" else y


def _forward_ag(rt: Runtime, s: Schedule, d: int, a_shard: torch.Tensor,
                weights: list[torch.Tensor], need_gathered: bool, label: str
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather along any dim of `a_shard`, then one matmul per weight."""
    P = rt.world
    if d == a_shard.dim() - 1:  # K: gather columns
        a2 = _rows2d(a_shard).contiguous()
        execute.check_splits(label, a2.shape[1], s, "columns")
        g, ys = execute.all_gather_matmul(rt, a2, weights, s, Axis.K, need_gathered, label)
        lead = a_shard.shape[:-1]
        return (None if g is None else g.view(*lead, -1)), [y.view(*lead, -1) for y in ys]
    a2, moved = _rows_first(a_shard, d)
    execute.check_splits(label, a2.shape[0], s, "rows")
    g, ys = execute.all_gather_matmul(rt, a2, weights, s, Axis.M, need_gathered, label)
    n0 = moved[0] * P
    ys = [_rows_back(y, moved, d, n0) for y in ys]
    if g is not None:
        g = _rows_back(g, moved, d, n0)
    return g, ys


def _forward_rs(rt: Runtime, s: Schedule, d: int, a: torch.Tensor, w: torch.Tensor,
                label: str) -> torch.Tensor:
    a2, moved = _rows_first(a, d)
    execute.check_splits(label, a2.shape[0] // rt.world, s, "rows per rank")
    y = execute.matmul_reduce_scatter(rt, a2, w, s, label)
    return _rows_back(y, moved, d, moved[0] // rt.world)


def _ag_signature(rt: Runtime, d: int, a_shard: torch.Tensor,
                  weights: Sequence[torch.Tensor]) -> Signature:
    n, K = sum(w.shape[-1] for w in weights), a_shard.shape[-1]
    if d == a_shard.dim() - 1:  # K gathered: in the pair's words the transposed product,
        # W^T (n x k) times the gathered A^T (k x rows, "B" gathered along K)
        return _signature_of(rt, PairKind.AG, a_shard, n, _rows(a_shard), K * rt.world,
                             axis=Axis.K)
    return _signature_of(rt, PairKind.AG, a_shard, _rows(a_shard) * rt.world, n, K)


def _torch_fused_ag(rt: Runtime, d: int, a_shard: torch.Tensor, weights: list[torch.Tensor],
                    label: str) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """PyTorch's own fused all-gather -> matmul (symmetric memory; a CUDA candidate of
    `schedule="auto"` where the group enabled it)."""
    rt.records.append(CallRecord("all_gather_matmul", TORCH_FUSED, "torch symm_mem",
                                 (tuple(a_shard.shape), *(tuple(w.shape) for w in weights)),
                                 rt.world, label))
    g, ys = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, weights, d,
                                                       rt.group.group_name)
    return g, list(ys)


def _torch_fused_rs(rt: Runtime, d: int, a: torch.Tensor, w: torch.Tensor, label: str
                    ) -> torch.Tensor:
    """PyTorch's own fused matmul -> reduce-scatter (as `_torch_fused_ag`)."""
    rt.records.append(CallRecord("matmul_reduce_scatter", TORCH_FUSED, "torch symm_mem",
                                 (tuple(a.shape), tuple(w.shape)), rt.world, label))
    out: torch.Tensor = torch.ops.symm_mem.fused_matmul_reduce_scatter(
        a, w, "sum", d, rt.group.group_name)
    return out


def _ag_checks(world: int, a_shard: torch.Tensor, weights: Sequence[torch.Tensor],
               gather_dim: int, schedule: str, backward_schedule: str
               ) -> tuple[int, Choice, Choice]:
    """The validated gather dimension and both schedules of an all-gather -> matmul call."""
    if not weights:
        raise SpecError("weights", "no weight given", "pass at least one (K, N) weight")
    d = _dim(gather_dim, a_shard.dim(), "gather_dim")
    axis = Axis.K if d == a_shard.dim() - 1 else Axis.M
    k_total = a_shard.shape[-1] * (world if axis is Axis.K else 1)
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[0] != k_total:
            raise SpecError(f"weights[{i}]", f"shape {tuple(w.shape)} does not match the "
                            f"gathered input's last dimension {k_total}",
                            f"pass 2-d weights of shape ({k_total}, N)")
        if w.dtype != a_shard.dtype or w.device != a_shard.device:
            raise SpecError(f"weights[{i}]", f"{w.dtype} on {w.device} but a_shard is "
                            f"{a_shard.dtype} on {a_shard.device}",
                            "use one dtype and device for all operands")
    s = _schedule(schedule, axis)
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule else \
        Schedule(s.comm, s.engine, s.chunks, s.group, Axis.M) if isinstance(s, Schedule) else AUTO
    return d, s, bwd


def _rs_checks(world: int, a: torch.Tensor, weight: torch.Tensor, scatter_dim: int,
               schedule: str, backward_schedule: str) -> tuple[int, Choice, Choice]:
    """The validated scatter dimension and both schedules of a matmul -> reduce-scatter call."""
    d = _dim(scatter_dim, a.dim(), "scatter_dim")
    if d == a.dim() - 1:
        raise SpecError("scatter_dim", "the last dimension of `a` is the GEMM's reduction",
                        "scatter along a leading dimension (rows)")
    if weight.dim() != 2 or weight.shape[0] != a.shape[-1]:
        raise SpecError("weight", f"shape {tuple(weight.shape)} does not match a's last "
                        f"dimension {a.shape[-1]}", f"pass a ({a.shape[-1]}, N) weight")
    if weight.dtype != a.dtype or weight.device != a.device:
        raise SpecError("weight", f"{weight.dtype} on {weight.device} but a is {a.dtype} on "
                        f"{a.device}", "use one dtype and device for both operands")
    if a.shape[d] % world:
        raise SpecError("a", f"dimension {d} of size {a.shape[d]} is not divisible by the "
                        f"group size {world}", f"pad it to a multiple of {world}")
    s = _schedule(schedule, Axis.M)
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule else s
    return d, s, bwd


@torch.library.custom_op("plait::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a_shard: torch.Tensor, weights: list[torch.Tensor], group: str,
                          gather_dim: int, schedule: str, backward_schedule: str,
                          label: str = "ag_mm") -> list[torch.Tensor]:
    """[gathered, a @ w for w in weights] (see `all_gather_matmul`); `label` names the call
    in records and traces (a backward's dual pair says so)."""
    with strands.turn(label, group) as key:
        rt = runtime_of(key)
        d, s, bwd = _ag_checks(rt.world, a_shard, weights, gather_dim, schedule, backward_schedule)
        if not label.endswith(".bwd"):  # a backward repeats its checked forward call
            rt.check_same("all_gather_matmul", _signature(1, s, bwd, d, a_shard, *weights),
                          "a_shard, weights, gather_dim, schedule, backward_schedule")
        def run(x: Schedule | str) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
            if x == TORCH_FUSED:
                return _torch_fused_ag(rt, d, a_shard, list(weights), label)
            return _forward_ag(rt, as_schedule(x), d, a_shard, list(weights), True, label)

        g, ys = _ran(rt, key, s, lambda: _ag_signature(rt, d, a_shard, weights), run)
        assert g is not None
        # as PyTorch's: gathered along a leading dimension d, the results are views of
        # d-major storage moved into place (contiguous only for d = 0 and the last)
        return [_own(g, a_shard, *weights, contiguous=False),
                *(_own(y, contiguous=False) for y in ys)]


@_all_gather_matmul_op.register_fake
def _(a_shard: torch.Tensor, weights: list[torch.Tensor], group: str, gather_dim: int,
      schedule: str, backward_schedule: str, label: str = "ag_mm") -> list[torch.Tensor]:
    world = runtime_of(group).world
    d, _, _ = _ag_checks(world, a_shard, weights, gather_dim, schedule, backward_schedule)
    if d == a_shard.dim() - 1:
        shape = [*a_shard.shape[:-1], a_shard.shape[-1] * world]
        return [a_shard.new_empty(shape),
                *(a_shard.new_empty((*shape[:-1], w.shape[1])) for w in weights)]
    moved = list(a_shard.movedim(d, 0).shape)  # the strided layout the kernel returns
    moved[0] *= world

    def laid_out(n: int) -> torch.Tensor:
        return a_shard.new_empty((*moved[:-1], n)).movedim(0, d)

    return [laid_out(moved[-1]), *(laid_out(w.shape[1]) for w in weights)]


def _ag_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    a_shard, weights, group, gather_dim, schedule, backward_schedule, _ = inputs
    d, _, bwd = _ag_checks(runtime_of(group).world, a_shard, weights, gather_dim, schedule,
                           backward_schedule)
    ctx.group, ctx.d, ctx.bwd, ctx.shard = group, d, str(bwd), tuple(a_shard.shape)
    ctx.save_for_backward(output[0], *weights)
    ctx.set_materialize_grads(False)  # an unused output's gradient is None: no zeros sent


def _ag_backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    gathered, *weights = ctx.saved_tensors
    g_gathered, g_outs = grads[0], grads[1:]
    pairs = [(g, w) for g, w in zip(g_outs, weights, strict=True) if g is not None]
    # the weight gradients: computed while the data gradient's reduce-scatter is in flight
    # (as Megatron-LM's backward overlaps them), else after it; a strand may defer them
    weight_grads = _Once(lambda: [
        None if g is None else strands.weight_grad(w, functools.partial(_wgrad, gathered, g, w))
        for g, w in zip(g_outs, weights, strict=True)])
    if not ctx.needs_input_grad[0]:  # an input that needs no gradient: neither its GEMM
        g_a = None  # nor its reduce-scatter (every rank's model says so alike)
    elif ctx.d == gathered.dim() - 1:
        # K gathered: d(a_shard) is a reduce-scatter along columns of dA, not overlapped.
        da = sum((g @ w.T for g, w in pairs), torch.zeros_like(gathered))
        if g_gathered is not None:
            da = da + g_gathered
        out = torch.ops.plait.reduce_scatter(_rows2d(da).T.contiguous(), ctx.group)
        g_a = out.T.reshape(ctx.shard)
    else:
        # dA = [g_1 .. g_n] @ [W_1 .. W_n]^T, reduce-scattered along rows: the dual pair.
        if pairs:  # one weight: no concatenation (a copy of the gradient)
            g_cat = pairs[0][0] if len(pairs) == 1 else torch.cat([g for g, _ in pairs], -1)
            w_cat = pairs[0][1] if len(pairs) == 1 else torch.cat([w for _, w in pairs], 1)
            with _filling(weight_grads):
                g_a = torch.ops.plait.matmul_reduce_scatter(g_cat, w_cat.T.contiguous(),
                                                            ctx.group, ctx.d, ctx.bwd, ctx.bwd,
                                                            "ag_mm.bwd")
        else:
            g_a = gathered.new_zeros(ctx.shard)
        if g_gathered is not None:
            t2, moved = _rows_first(g_gathered, ctx.d)
            out = torch.ops.plait.reduce_scatter(t2, ctx.group)
            g_a = g_a + _rows_back(out, moved, ctx.d, ctx.shard[ctx.d])
    # one gradient per argument given (the label may have been left to its default)
    return g_a, weight_grads(), *[None] * (len(ctx.needs_input_grad) - 2)


_all_gather_matmul_op.register_autograd(_ag_backward, setup_context=_ag_setup)


@torch.library.custom_op("plait::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, weight: torch.Tensor, group: str,
                              scatter_dim: int, schedule: str, backward_schedule: str,
                              label: str = "mm_rs") -> torch.Tensor:
    """reduce_scatter(a @ weight) along `scatter_dim` (see `matmul_reduce_scatter`)."""
    with strands.turn(label, group) as key:
        rt = runtime_of(key)
        d, s, bwd = _rs_checks(rt.world, a, weight, scatter_dim, schedule, backward_schedule)
        if not label.endswith(".bwd"):
            rt.check_same("matmul_reduce_scatter", _signature(2, s, bwd, d, a, weight),
                          "a, weight, scatter_dim, schedule, backward_schedule")
        def run(x: Schedule | str) -> torch.Tensor:
            if x == TORCH_FUSED:
                return _torch_fused_rs(rt, d, a, weight, label)
            return _forward_rs(rt, as_schedule(x), d, a, weight, label)

        y = _ran(rt, key, s, lambda: _mm_signature(rt, PairKind.RS, a, weight), run)
        return _own(y, a, weight)


@_matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, weight: torch.Tensor, group: str, scatter_dim: int, schedule: str,
      backward_schedule: str, label: str = "mm_rs") -> torch.Tensor:
    world = runtime_of(group).world
    d, _, _ = _rs_checks(world, a, weight, scatter_dim, schedule, backward_schedule)
    shape = [*a.shape[:-1], weight.shape[1]]
    shape[d] //= world
    return a.new_empty(shape)


def _rs_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, group, scatter_dim, schedule, backward_schedule, _ = inputs
    d, _, bwd = _rs_checks(runtime_of(group).world, a, weight, scatter_dim, schedule,
                           backward_schedule)
    ctx.group, ctx.d, ctx.bwd = group, d, str(bwd)
    ctx.save_for_backward(a, weight)


def _rs_backward(ctx: Any, g_out: torch.Tensor) -> tuple[Any, ...]:
    a, w = ctx.saved_tensors
    # d(a @ w) = all_gather(g_out): da = AG(g) @ w^T (the dual pair), dw = a^T @ AG(g).
    g_full, da = torch.ops.plait.all_gather_matmul(g_out.contiguous(), [w.T.contiguous()],
                                                   ctx.group, ctx.d, ctx.bwd, ctx.bwd,
                                                   "mm_rs.bwd")
    dw = strands.weight_grad(w, functools.partial(_wgrad, a, g_full, w))
    return da, dw, *[None] * (len(ctx.needs_input_grad) - 2)


_matmul_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)
