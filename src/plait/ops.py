"""Overlapped all-gather->matmul and matmul->reduce-scatter (tensor/sequence parallel), and
all-to-all->matmul and matmul->all-to-all (expert-parallel dispatch and combine), with autograd.

Semantics and argument names follow PyTorch's `fused_all_gather_matmul` and
`fused_matmul_reduce_scatter`, so users can switch. Every call runs a `Schedule` (the same values
`plait explore` picks) on the collective engine (`/sm`) or the peer-copy engine (`/dma`) and
appends a `CallRecord` (schedule, engine) to `plait.runtime.context.runtime_for(group).records`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.errors import SpecError
from plait.runtime import execute
from plait.runtime.context import Runtime, runtime_for
from plait.schedule.schedule import CommPattern, Schedule
from plait.spec import dtypes
from plait.workload.ops import Axis

ScheduleLike = Schedule | str
GroupLike = dist.ProcessGroup | Runtime | None


def _schedule(s: ScheduleLike, axis: Axis) -> Schedule:
    sched = Schedule.parse(s) if isinstance(s, str) else s
    if sched.comm is not CommPattern.SEQ and sched.axis is not axis:
        raise SpecError("schedule", f"{sched} splits along {sched.axis} but this call "
                        f"gathers/scatters GEMM dimension {axis}",
                        f"use the same schedule with /{axis}")
    return sched


def _dim(dim: int, ndim: int, field: str) -> int:
    if not -ndim <= dim < ndim:
        raise SpecError(field, f"{dim} is out of range for a {ndim}-d tensor",
                        f"use a dimension in [{-ndim}, {ndim - 1}]")
    return dim % ndim


def _signature(op: int, s: Schedule, bwd: Schedule, dim: int, *tensors: torch.Tensor
               ) -> list[int]:
    """What every rank of the group must pass alike: the op, both schedules (a backward that
    differs between ranks would mismatch its collectives), the dimension and the operands."""
    sig = [op, zlib.crc32(str(s).encode()), zlib.crc32(str(bwd).encode()), dim]  # stable
    # across processes (str hash is not)
    for t in tensors:
        sig += [dtypes.code(t.dtype), t.dim(), *t.shape]
    return sig


def _apply(fn: type[torch.autograd.Function], *args: object) -> Any:
    """`fn.apply(*args)`: torch declares no types for it."""
    return fn.apply(*args)


def all_gather_matmul(a_shard: torch.Tensor, weights: Sequence[torch.Tensor],
                      group: GroupLike = None, *, gather_dim: int = 0,
                      schedule: ScheduleLike = "seq/sm",
                      backward_schedule: ScheduleLike | None = None,
                      return_gathered: bool = True,
                      ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Overlapped form of::

        a = all_gather_into_tensor(a_shard, dim=gather_dim)   # concatenated in rank order
        return a, [a @ w for w in weights]

    `gather_dim` is any dimension of `a_shard` except... all of them: a leading dimension is split
    along the GEMM's M (rows); the last one is its K (the reduction; weight-gradient style).
    Backward runs the dual pair (matmul -> reduce-scatter), scheduled by `backward_schedule`.
    """
    rt = runtime_for(group)
    if not weights:
        raise SpecError("weights", "no weight given", "pass at least one (K, N) weight")
    d = _dim(gather_dim, a_shard.dim(), "gather_dim")
    axis = Axis.K if d == a_shard.dim() - 1 else Axis.M
    k_total = a_shard.shape[-1] * (rt.world if axis is Axis.K else 1)
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
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule is not None else \
        Schedule(s.comm, s.engine, s.chunks, s.group, Axis.M)
    rt.check_same("all_gather_matmul", _signature(1, s, bwd, d, a_shard, *weights),
                  "a_shard, weights, gather_dim, schedule, backward_schedule")
    need = return_gathered or (torch.is_grad_enabled()
                               and any(t.requires_grad for t in (a_shard, *weights)))
    outs: tuple[torch.Tensor, ...] = _apply(_AllGatherMatmul, rt, s, bwd, d, need, a_shard,
                                            *weights)
    gathered, ys = outs[0], list(outs[1:])
    return (gathered if return_gathered else None), ys


def matmul_reduce_scatter(a: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *,
                          scatter_dim: int = 0, reduce_op: str = "sum",
                          schedule: ScheduleLike = "seq/sm",
                          backward_schedule: ScheduleLike | None = None) -> torch.Tensor:
    """Overlapped form of::

        return reduce_scatter_tensor(a @ weight, op=sum, dim=scatter_dim)

    `scatter_dim` must be a leading dimension of `a` (the GEMM's rows). Backward runs the dual
    pair (all-gather -> matmul) scheduled by `backward_schedule`.
    """
    rt = runtime_for(group)
    if reduce_op != "sum":
        raise SpecError("reduce_op", f"{reduce_op!r} is not supported", "use 'sum'")
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
    if a.shape[d] % rt.world:
        raise SpecError("a", f"dimension {d} of size {a.shape[d]} is not divisible by the "
                        f"group size {rt.world}", f"pad it to a multiple of {rt.world}")
    s = _schedule(schedule, Axis.M)
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule is not None else s
    rt.check_same("matmul_reduce_scatter", _signature(2, s, bwd, d, a, weight),
                  "a, weight, scatter_dim, schedule, backward_schedule")
    y: torch.Tensor = _apply(_MatmulReduceScatter, rt, s, bwd, d, a, weight)
    return y


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
    rt = runtime_for(group)
    s, bwd = _exchange_call(rt, 3, "x", x, weight, schedule, backward_schedule)
    received, y = _apply(_AllToAllMatmul, rt, s, bwd, x, weight)
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
    rt = runtime_for(group)
    s, bwd = _exchange_call(rt, 4, "a", a, weight, schedule, backward_schedule)
    out: torch.Tensor = _apply(_MatmulAllToAll, rt, s, bwd, a, weight)
    return out


def _exchange_call(rt: Runtime, op: int, name: str, x: torch.Tensor, weight: torch.Tensor,
                   schedule: ScheduleLike, backward_schedule: ScheduleLike | None
                   ) -> tuple[Schedule, Schedule]:
    """The checks of an all-to-all op (`op` 3: dispatch, 4: combine) and its two schedules,
    the same on every rank."""
    _check_exchange(name, x, weight, rt.world)
    s = _schedule(schedule, Axis.M)
    bwd = _schedule(backward_schedule, Axis.M) if backward_schedule is not None else s
    label = "all_to_all_matmul" if op == 3 else "matmul_all_to_all"
    rt.check_same(label, _signature(op, s, bwd, 0, x, weight),
                  f"{name}, weight, schedule, backward_schedule")
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


# --- autograd ---------------------------------------------------------------------------------

def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, last dimension), also when it holds no element."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _rows_first(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`t` with `dim` moved first and flattened to 2-d; and the moved shape."""
    moved = t.movedim(dim, 0).contiguous()
    return moved.view(math.prod(moved.shape[:-1]), moved.shape[-1]), tuple(moved.shape)


def _rows_back(y: torch.Tensor, moved_shape: tuple[int, ...], dim: int, lead: int
               ) -> torch.Tensor:
    shape = (lead, *moved_shape[1:-1], y.shape[-1])
    return y.view(shape).movedim(0, dim)


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


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: Runtime, s: Schedule, bwd: Schedule, d: int, need: bool,
                a_shard: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g, ys = _forward_ag(rt, s, d, a_shard, list(weights), need, "ag_mm")
        ctx.rt, ctx.bwd, ctx.d = rt, bwd, d
        ctx.save_for_backward(g, *weights)
        return (g, *ys)

    @staticmethod
    def backward(ctx: Any, g_gathered: torch.Tensor | None, *g_outs: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        rt, bwd, d = ctx.rt, ctx.bwd, ctx.d
        gathered, *weights = ctx.saved_tensors
        pairs = [(g, w) for g, w in zip(g_outs, weights, strict=True) if g is not None]
        grads_w = [None if g is None else
                   _rows2d(gathered).T @ _rows2d(g)
                   for g, w in zip(g_outs, weights, strict=True)]
        last = gathered.dim() - 1
        if d == last:
            # K gathered: d(a_shard) is a reduce-scatter along columns of dA, not overlapped.
            da = sum(g @ w.T for g, w in pairs) if pairs else torch.zeros_like(gathered)
            if g_gathered is not None:
                da = da + g_gathered
            da2 = _rows2d(da).T.contiguous()
            out = torch.empty((da2.shape[0] // rt.world, da2.shape[1]), dtype=da.dtype,
                              device=da.device)
            rt.collective().reduce_scatter(out, da2, "ag_mm.bwd").wait()
            g_a = out.T.reshape(*gathered.shape[:-1], -1)
        else:
            # dA = [g_1 .. g_n] @ [W_1 .. W_n]^T, reduce-scattered along rows: the dual pair.
            g_cat = torch.cat([g for g, _ in pairs], dim=-1)
            w_cat = torch.cat([w for _, w in pairs], dim=1)
            g_a = _forward_rs(rt, bwd, d, g_cat, w_cat.T.contiguous(), "ag_mm.bwd")
            if g_gathered is not None:
                g_a = g_a + _forward_rs_plain(rt, g_gathered, d)
        return (None, None, None, None, None, g_a, *grads_w)


def _forward_rs_plain(rt: Runtime, t: torch.Tensor, d: int) -> torch.Tensor:
    t2, moved = _rows_first(t, d)
    out = torch.empty((t2.shape[0] // rt.world, t2.shape[1]), dtype=t.dtype, device=t.device)
    rt.collective().reduce_scatter(out, t2, "ag_mm.bwd").wait()
    return _rows_back(out, moved, d, moved[0] // rt.world)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: Runtime, s: Schedule, bwd: Schedule, d: int, a: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        ctx.rt, ctx.bwd, ctx.d = rt, bwd, d
        ctx.save_for_backward(a, w)
        return _forward_rs(rt, s, d, a, w, "mm_rs")

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rt, bwd, d = ctx.rt, ctx.bwd, ctx.d
        a, w = ctx.saved_tensors
        # d(a @ w) = all_gather(g_out): da = AG(g) @ w^T (the dual pair), dw = a^T @ AG(g).
        g_full, (da,) = _forward_ag(rt, bwd, d, g_out.contiguous(), [w.T.contiguous()], True,
                                    "mm_rs.bwd")
        assert g_full is not None
        dw = _rows2d(a).T @ _rows2d(g_full)
        return None, None, None, None, da, dw


def _experts(w: torch.Tensor) -> int:
    """Local experts of an expert weight: (K, N) one, (E, K, N) E."""
    return w.shape[0] if w.dim() == 3 else 1


def _steps(rt: Runtime, s: Schedule) -> int:
    """Sub-chunks per shard the executors will cut (one rank runs sequentially)."""
    return s.steps if rt.world > 1 else 1


def _check_expert_splits(op: str, rows: int, world: int, w: torch.Tensor, s: Schedule) -> None:
    execute.check_splits(op, rows // (world * _experts(w)), s,
                         "rows per rank" if w.dim() == 2 else "rows per rank and expert")


def _blocks(t: torch.Tensor, world: int, experts: int, c: int) -> torch.Tensor:
    """Rows ordered (rank, expert, slot) reordered (rank, sub-chunk, expert, slot): each block
    of the schedule (a rank's chunk cut in c) then holds its E expert groups contiguously,
    which is what the executors take. Free when E or c is 1."""
    if experts == 1 or c == 1:
        return t.contiguous()
    rows, d = t.shape
    return t.reshape(world, experts, c, -1, d).transpose(1, 2).reshape(rows, d)


def _unblocks(t: torch.Tensor, world: int, experts: int, c: int) -> torch.Tensor:
    """The inverse of `_blocks`."""
    if experts == 1 or c == 1:
        return t
    rows, d = t.shape
    return t.view(world, c, experts, -1, d).transpose(1, 2).reshape(rows, d)


def _expert_grad(a: torch.Tensor, g: torch.Tensor, world: int, experts: int) -> torch.Tensor:
    """Weight gradient of rows `a` @ w -> `g`, rows ordered (rank, expert, slot)."""
    if experts == 1:
        return a.T @ g
    return torch.einsum("pesk,pesn->ekn", a.view(world, experts, -1, a.shape[1]),
                        g.view(world, experts, -1, g.shape[1]))


class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: Runtime, s: Schedule, bwd: Schedule, x: torch.Tensor, w: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        P, E, c = rt.world, _experts(w), _steps(rt, s)
        _check_expert_splits("a2a_mm", x.shape[0], P, w, s)
        received, (y,) = execute.all_gather_matmul(rt, _blocks(x, P, E, c), [w], s, Axis.M,
                                                   True, "a2a_mm", exchange=True)
        assert received is not None
        received, y = _unblocks(received, P, E, c), _unblocks(y, P, E, c)
        ctx.rt, ctx.bwd = rt, bwd
        ctx.save_for_backward(received, w)
        return received, y

    @staticmethod
    def backward(ctx: Any, g_received: torch.Tensor | None, g_y: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        rt, bwd = ctx.rt, ctx.bwd
        received, w = ctx.saved_tensors
        P, E, c = rt.world, _experts(w), _steps(rt, bwd)
        # Rank r's rows from rank q are q's rows for r: their gradient goes back the same way.
        if g_y is None:
            g_y = received.new_zeros(received.shape[0], w.shape[-1])
        _check_expert_splits("a2a_mm.bwd", g_y.shape[0], P, w, bwd)
        dx = _unblocks(execute.matmul_reduce_scatter(
            rt, _blocks(g_y, P, E, c), w.transpose(-1, -2).contiguous(), bwd, "a2a_mm.bwd",
            exchange=True), P, E, c)
        if g_received is not None:
            back = torch.empty_like(g_received)
            rt.collective().all_to_all(back, g_received.contiguous(), "a2a_mm.bwd").wait()
            dx = dx + back
        return None, None, None, dx, _expert_grad(received, g_y, P, E).view(w.shape)


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: Runtime, s: Schedule, bwd: Schedule, a: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        P, E, c = rt.world, _experts(w), _steps(rt, s)
        _check_expert_splits("mm_a2a", a.shape[0], P, w, s)
        ctx.rt, ctx.bwd = rt, bwd
        ctx.save_for_backward(a, w)
        return _unblocks(execute.matmul_reduce_scatter(rt, _blocks(a, P, E, c), w, s, "mm_a2a",
                                                       exchange=True), P, E, c)

    @staticmethod
    def backward(ctx: Any, g_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rt, bwd = ctx.rt, ctx.bwd
        a, w = ctx.saved_tensors
        P, E, c = rt.world, _experts(w), _steps(rt, bwd)
        _check_expert_splits("mm_a2a.bwd", g_y.shape[0], P, w, bwd)
        g_full, (da,) = execute.all_gather_matmul(
            rt, _blocks(g_y, P, E, c), [w.transpose(-1, -2).contiguous()], bwd, Axis.M, True,
            "mm_a2a.bwd", exchange=True)
        assert g_full is not None
        g_full, da = _unblocks(g_full, P, E, c), _unblocks(da, P, E, c)
        return None, None, None, da, _expert_grad(a, g_full, P, E).view(w.shape)
