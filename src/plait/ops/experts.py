"""The expert-parallel pairs: all-to-all -> matmul (dispatch) and matmul -> all-to-all
(combine), with one or several local experts, as custom ops with autograd; `expert_blocks`
lays a rank's rows out as the executors take them.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.errors import SpecError
from plait.ops.common import (
    _autocast,
    _experts,
    _mm_signature,
    _own,
    _ran,
    _schedule,
    _signature,
    _steps,
    _text,
)
from plait.runtime import execute, strands
from plait.runtime.context import GroupLike, group_key, runtime_of
from plait.schedule.schedule import (
    Choice,
    Schedule,
    ScheduleLike,
    as_schedule,
)
from plait.workload.operators import Axis, PairKind


def all_to_all_matmul(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *,
                      schedule: ScheduleLike = "seq/sm",
                      backward_schedule: ScheduleLike | None = None,
                      return_received: bool = True,
                      ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Overlapped form of the expert-parallel dispatch::

        received = all_to_all_single(x)   # row chunk q of x goes to rank q, equal chunks
        return received, received @ weight

    `x` (rows, K) holds, chunk by chunk, the tokens this rank routes to each rank's experts
    (equal capacity per rank); `weight` (K, N) is this rank's expert, or (E, K, N) its E local
    experts: then every rank's chunk is E equal groups of rows, group e for that rank's expert e
    (rows ordered by destination rank, expert, slot). `received` lists the chunks by source
    rank, in the same order. Backward runs the dual pair (matmul -> all-to-all).
    """
    x, weight = _autocast(x, weight)
    received, y = torch.ops.plait.all_to_all_matmul(x, weight, group_key(group),
                                                    _text(schedule), _text(backward_schedule))
    return (received if return_received else None), y


def matmul_all_to_all(a: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *,
                      schedule: ScheduleLike = "seq/sm",
                      backward_schedule: ScheduleLike | None = None) -> torch.Tensor:
    """Overlapped form of the expert-parallel combine::

        return all_to_all_single(a @ weight)   # row chunk q of the product goes to rank q

    The result lists, by source rank, the chunks every rank computed for this one. `weight`
    (E, K, N): E local experts, rows grouped as in `all_to_all_matmul`. Backward runs the dual
    pair (all-to-all -> matmul).
    """
    a, weight = _autocast(a, weight)
    out: torch.Tensor = torch.ops.plait.matmul_all_to_all(a, weight, group_key(group),
                                                          _text(schedule),
                                                          _text(backward_schedule))
    return out


def _exchange_checks(world: int, name: str, x: torch.Tensor, weight: torch.Tensor,
                     schedule: str, backward_schedule: str) -> tuple[Choice, Choice]:
    """The validated schedules of an all-to-all op (`name`: its token operand)."""
    _check_exchange(name, x, weight, world)
    s = _schedule(schedule, Axis.M)
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule else s
    return s, bwd


def _check_exchange(name: str, x: torch.Tensor, weight: torch.Tensor, world: int) -> None:
    if x.dim() != 2:
        raise SpecError(name, f"{x.dim()}-d, but the all-to-all exchanges row chunks",
                        f"pass a 2-d (rows, K) {name}, rows grouped by destination rank")
    if weight.dim() not in (2, 3) or weight.shape[-2] != x.shape[1]:
        raise SpecError("weight", f"shape {tuple(weight.shape)} does not match {name}'s last "
                        f"dimension {x.shape[1]}", f"pass a ({x.shape[1]}, N) weight, or "
                        f"(E, {x.shape[1]}, N) for E local experts")
    groups = world * _experts(weight)
    if x.shape[0] % groups:
        raise SpecError(name, f"{x.shape[0]} rows do not split into {world} ranks x "
                        f"{_experts(weight)} experts of equal capacity",
                        f"pad every expert's rows to the same capacity (rows a multiple of "
                        f"{groups})")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise SpecError("weight", f"{weight.dtype} on {weight.device} but {name} is {x.dtype} "
                        f"on {x.device}", "use one dtype and device for both operands")


def _check_expert_splits(op: str, rows: int, world: int, w: torch.Tensor, s: Schedule) -> None:
    execute.check_splits(op, rows // (world * _experts(w)), s,
                         "rows per rank" if w.dim() == 2 else "rows per rank and expert")


def expert_blocks(t: torch.Tensor, world: int, experts: int, c: int) -> torch.Tensor:
    """Rows ordered (rank, expert, slot) reordered (rank, sub-chunk, expert, slot): each block
    of the schedule (a rank's chunk cut in c) then holds its E expert groups contiguously,
    which is what the executors take. Free when E or c is 1."""
    if experts == 1 or c == 1:
        return t.contiguous()
    rows, d = t.shape
    return t.reshape(world, experts, c, -1, d).transpose(1, 2).reshape(rows, d)


def expert_unblocks(t: torch.Tensor, world: int, experts: int, c: int) -> torch.Tensor:
    """The inverse of `expert_blocks`."""
    if experts == 1 or c == 1:
        return t
    rows, d = t.shape
    return t.view(world, c, experts, -1, d).transpose(1, 2).reshape(rows, d)


def _expert_grad(a: torch.Tensor, g: torch.Tensor, world: int, weight: torch.Tensor
                 ) -> torch.Tensor:
    """Weight gradient of rows `a` @ weight -> `g`, rows ordered (rank, expert, slot), laid
    out as `weight` is (an expert's `fc1.transpose(-1, -2)` gets the transpose of a
    contiguous gradient, so the parameter's own gradient is contiguous, as for `_wgrad`)."""
    experts = _experts(weight)
    transposed = weight.stride(-2) == 1 and weight.shape[-1] > 1
    if experts == 1:
        return ((g.T @ a).T if transposed else a.T @ g).view(weight.shape)  # (1, K, N) too
    a4 = a.view(world, experts, -1, a.shape[1])
    g4 = g.view(world, experts, -1, g.shape[1])
    if transposed:
        return torch.einsum("pesn,pesk->enk", g4, a4).transpose(-1, -2)
    return torch.einsum("pesk,pesn->ekn", a4, g4)


@torch.library.custom_op("plait::all_to_all_matmul", mutates_args=())
def _all_to_all_matmul_op(x: torch.Tensor, weight: torch.Tensor, group: str, schedule: str,
                          backward_schedule: str, label: str = "a2a_mm"
                          ) -> list[torch.Tensor]:
    """[received, received @ weight] (see `all_to_all_matmul`)."""
    with strands.turn(label, group) as key:
        rt = runtime_of(key)
        s, bwd = _exchange_checks(rt.world, "x", x, weight, schedule, backward_schedule)
        if not label.endswith(".bwd"):  # a backward repeats its checked forward call
            rt.check_same("all_to_all_matmul", _signature(3, s, bwd, 0, x, weight),
                          "x, weight, schedule, backward_schedule")
        def run(x_: Schedule | str) -> tuple[torch.Tensor, torch.Tensor]:
            sch = as_schedule(x_)
            P, E, c = rt.world, _experts(weight), _steps(rt, sch)
            _check_expert_splits(label, x.shape[0], P, weight, sch)
            received, (y,) = execute.all_gather_matmul(rt, expert_blocks(x, P, E, c), [weight],
                                                       sch, Axis.M, True, label, exchange=True)
            assert received is not None
            return expert_unblocks(received, P, E, c), expert_unblocks(y, P, E, c)

        received, y = _ran(rt, key, s, lambda: _mm_signature(rt, PairKind.A2A, x, weight), run)
        return [_own(received, x, weight), _own(y)]


@_all_to_all_matmul_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, group: str, schedule: str, backward_schedule: str,
      label: str = "a2a_mm") -> list[torch.Tensor]:
    _exchange_checks(runtime_of(group).world, "x", x, weight, schedule, backward_schedule)
    return [x.new_empty(x.shape), x.new_empty((x.shape[0], weight.shape[-1]))]


def _a2a_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, weight, group, schedule, backward_schedule, _ = inputs
    _, bwd = _exchange_checks(runtime_of(group).world, "x", x, weight, schedule,
                              backward_schedule)
    ctx.group, ctx.bwd = group, str(bwd)
    ctx.save_for_backward(output[0], weight)
    ctx.set_materialize_grads(False)  # an unused output's gradient is None: no zeros sent


def _a2a_backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    received, w = ctx.saved_tensors
    g_received, g_y = grads
    # Rank r's rows from rank q are q's rows for r: their gradient goes back the same way.
    if g_y is None:
        g_y = received.new_zeros(received.shape[0], w.shape[-1])
    dx = None
    if ctx.needs_input_grad[0]:  # else neither the GEMM nor the all-to-all back
        dx = torch.ops.plait.matmul_all_to_all(g_y.contiguous(),
                                               w.transpose(-1, -2).contiguous(), ctx.group,
                                               ctx.bwd, ctx.bwd, "a2a_mm.bwd")
        if g_received is not None:
            dx = dx + torch.ops.plait.all_to_all(g_received.contiguous(), ctx.group)
    world = runtime_of(ctx.group).world
    dw = strands.weight_grad(w, lambda: _expert_grad(received, g_y, world, w))
    return dx, dw, *[None] * (len(ctx.needs_input_grad) - 2)


_all_to_all_matmul_op.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@torch.library.custom_op("plait::matmul_all_to_all", mutates_args=())
def _matmul_all_to_all_op(a: torch.Tensor, weight: torch.Tensor, group: str, schedule: str,
                          backward_schedule: str, label: str = "mm_a2a") -> torch.Tensor:
    """all_to_all(a @ weight) (see `matmul_all_to_all`)."""
    with strands.turn(label, group) as key:
        rt = runtime_of(key)
        s, bwd = _exchange_checks(rt.world, "a", a, weight, schedule, backward_schedule)
        if not label.endswith(".bwd"):
            rt.check_same("matmul_all_to_all", _signature(4, s, bwd, 0, a, weight),
                          "a, weight, schedule, backward_schedule")
        def run(x_: Schedule | str) -> torch.Tensor:
            sch = as_schedule(x_)
            P, E, c = rt.world, _experts(weight), _steps(rt, sch)
            _check_expert_splits(label, a.shape[0], P, weight, sch)
            out = execute.matmul_reduce_scatter(rt, expert_blocks(a, P, E, c), weight, sch,
                                                label, exchange=True)
            return expert_unblocks(out, P, E, c)

        y = _ran(rt, key, s, lambda: _mm_signature(rt, PairKind.MM_A2A, a, weight), run)
        return _own(y, a, weight)


@_matmul_all_to_all_op.register_fake
def _(a: torch.Tensor, weight: torch.Tensor, group: str, schedule: str, backward_schedule: str,
      label: str = "mm_a2a") -> torch.Tensor:
    _exchange_checks(runtime_of(group).world, "a", a, weight, schedule, backward_schedule)
    return a.new_empty((a.shape[0], weight.shape[-1]))


def _mm_a2a_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, group, schedule, backward_schedule, _ = inputs
    _, bwd = _exchange_checks(runtime_of(group).world, "a", a, weight, schedule,
                              backward_schedule)
    ctx.group, ctx.bwd = group, str(bwd)
    ctx.save_for_backward(a, weight)


def _mm_a2a_backward(ctx: Any, g_y: torch.Tensor) -> tuple[Any, ...]:
    a, w = ctx.saved_tensors
    g_full, da = torch.ops.plait.all_to_all_matmul(g_y.contiguous(),
                                                   w.transpose(-1, -2).contiguous(), ctx.group,
                                                   ctx.bwd, ctx.bwd, "mm_a2a.bwd")
    world = runtime_of(ctx.group).world
    dw = strands.weight_grad(w, lambda: _expert_grad(a, g_full, world, w))
    return da, dw, *[None] * (len(ctx.needs_input_grad) - 2)


_matmul_all_to_all_op.register_autograd(_mm_a2a_backward, setup_context=_mm_a2a_setup)


@torch.library.custom_op("plait::all_to_all", mutates_args=())
def _all_to_all_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain all-to-all of `t`'s equal row chunks: the dispatch backward's unpaired part."""
    out = torch.empty_like(t)
    with strands.turn("all_to_all", group) as key:
        runtime_of(key).collective().all_to_all(out, t.contiguous(), "a2a_mm.bwd").wait()
        return out


@_all_to_all_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(t)
