"""Overlapped all-gather->matmul and matmul->reduce-scatter (tensor/sequence parallel), and
all-to-all->matmul and matmul->all-to-all (expert-parallel dispatch and combine), with autograd.

Semantics and argument names follow PyTorch's `fused_all_gather_matmul` and
`fused_matmul_reduce_scatter`, so users can switch. Every call runs a `Schedule` (the same values
`plait explore` picks) on the collective engine (`/sm`) or the peer-copy engine (`/dma`) and
appends a `CallRecord` (schedule, engine) to `plait.runtime.context.runtime_for(group).records`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch._dynamo  # a custom op's first call imports it (~1 s): here, once, so that
import torch.distributed as dist  # forked ranks inherit it instead of each paying it
from torch.distributed.device_mesh import DeviceMesh

from plait.errors import SpecError
from plait.runtime import execute, strands
from plait.runtime.context import CallRecord, Runtime, runtime_for
from plait.schedule.schedule import (
    AUTO,
    Choice,
    CommPattern,
    Schedule,
    ScheduleLike,
    as_choice,
    as_schedule,
)
from plait.spec import dtypes
from plait.tuning.signature import Signature
from plait.tuning.tuner import TORCH_FUSED, tuner
from plait.workload.operators import Axis, PairKind

GroupLike = dist.ProcessGroup | Runtime | str | DeviceMesh | tuple[DeviceMesh, int] | None


def _schedule(s: ScheduleLike, axis: Axis) -> Choice:
    sched = as_choice(s)
    if not isinstance(sched, Schedule):
        return AUTO
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


def _signature(op: int, s: Choice, bwd: Choice, dim: int, *tensors: torch.Tensor
               ) -> list[int]:
    """What every rank of the group must pass alike: the op, both schedules (a backward that
    differs between ranks would mismatch its collectives), the dimension and the operands."""
    sig = [op, zlib.crc32(str(s).encode()), zlib.crc32(str(bwd).encode()), dim]  # stable
    # across processes (str hash is not)
    for t in tensors:
        sig += [dtypes.code(t.dtype), t.dim(), *t.shape]
    return sig


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


def _group_given(group: GroupLike, group_name: GroupLike) -> GroupLike:
    """The group given as `group` or by PyTorch's keyword `group_name`, not both."""
    if group_name is None:
        return group
    if group is not None:
        raise SpecError("group_name", "given with group", "pass one of them")
    return group_name


def _one(name: str, value: Any, alias: str, aliased: Any) -> Any:
    """An argument given by plait's name or PyTorch's (`alias`), exactly once."""
    if (value is None) == (aliased is None):
        raise SpecError(name, "given twice" if value is not None else "missing",
                        f"pass {name} (or PyTorch's {alias}) once")
    return aliased if value is None else value


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


def _experts(w: torch.Tensor) -> int:
    """Local experts of an expert weight: (K, N) one, (E, K, N) E."""
    return w.shape[0] if w.dim() == 3 else 1


def _steps(rt: Runtime, s: Schedule) -> int:
    """Sub-chunks per shard the executors will cut (one rank runs sequentially)."""
    return s.steps if rt.world > 1 else 1


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


# --- schedule="auto" ---------------------------------------------------------------------------

T = TypeVar("T")


def _ran(rt: Runtime, key: str, s: Choice, signature: Callable[[], Signature],
         run: Callable[[Schedule | str], T]) -> T:
    """`run(s)` for a schedule; for "auto", the call run by `plait.tuning` (the decided
    schedule, or a candidate under trial) on the call's `signature()`, its record saying
    "auto -> <schedule>"."""
    if isinstance(s, Schedule):
        return run(s)

    def recorded(choice: str) -> T:
        before = rt.records[-1] if rt.records else None
        out = run(choice)
        if rt.records and rt.records[-1] is not before:
            rt.records[-1] = dataclasses.replace(rt.records[-1], schedule=f"auto -> {choice}")
        return out

    return tuner().run(rt, key, signature(), recorded)


def _signature_of(rt: Runtime, kind: PairKind, a: torch.Tensor, m: int, n: int, k: int,
                  experts: int = 1, axis: Axis = Axis.M) -> Signature:
    """The pair a call runs (its GEMM: m rows on each rank over its experts, n x k), on the
    call's group and device."""
    return Signature(kind, m, n, k, rt.world, dtypes.plait_name(a.dtype), axis, experts,
                     rt.backend, _device_name(a.device))


@functools.lru_cache(maxsize=64)
def _device_name(device: torch.device) -> str:
    """What a signature calls `device` (a CUDA device by its name), asked once per device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _rows(t: torch.Tensor) -> int:
    """Rows of `t` flattened to (rows, last dimension)."""
    return math.prod(t.shape[:-1])


def _ag_signature(rt: Runtime, d: int, a_shard: torch.Tensor,
                  weights: Sequence[torch.Tensor]) -> Signature:
    n, K = sum(w.shape[-1] for w in weights), a_shard.shape[-1]
    if d == a_shard.dim() - 1:  # K gathered: in the pair's words the transposed product,
        # W^T (n x k) times the gathered A^T (k x rows, "B" gathered along K)
        return _signature_of(rt, PairKind.AG, a_shard, n, _rows(a_shard), K * rt.world,
                             axis=Axis.K)
    return _signature_of(rt, PairKind.AG, a_shard, _rows(a_shard) * rt.world, n, K)


def _mm_signature(rt: Runtime, kind: PairKind, a: torch.Tensor, weight: torch.Tensor
                  ) -> Signature:
    """A pair whose GEMM takes `a`'s rows (rs, a2a, mm_a2a)."""
    return _signature_of(rt, kind, a, _rows(a), weight.shape[-1], a.shape[-1],
                         _experts(weight) if kind.experts else 1)


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


# --- torch custom ops (torch.library): every public op, traceable -----------------------------
#
# A custom op's arguments are tensors and plain values: the group travels as a key
# (`group_key`: a c10d group's name, or a registered runtime's), the schedules as text (""
# for a backward schedule derived from the forward one). The kernel validates, checks that
# every rank passes the same call (a small all-gather, at run time, never while tracing) and
# runs the schedule; the fake kernel gives shapes to FakeTensor/meta tracing; autograd is
# registered, its backward built from the same ops.

_RUNTIME_KEYS: weakref.WeakValueDictionary[str, Runtime] = weakref.WeakValueDictionary()


def group_key(group: GroupLike) -> str:
    """The text a custom op names `group` by: a process group's c10d name (the world group's
    for None; a name passes as it is; a `DeviceMesh` gives its group, `(mesh, dim)` that
    dimension's), or, for a `Runtime` of one's own (its own timeout, say), a key registered
    for as long as it lives."""
    if isinstance(group, Runtime):
        key = f"plait-runtime-{id(group)}"
        _RUNTIME_KEYS[key] = group
        return key
    if isinstance(group, str):
        return group
    if isinstance(group, tuple):
        mesh, dim = group
        group = mesh.get_group(dim)
    elif group is not None and not isinstance(group, dist.ProcessGroup):  # a DeviceMesh
        if group.ndim != 1:
            raise SpecError("group", f"a {group.ndim}-d DeviceMesh names no single group",
                            "pass (mesh, dim) or mesh[dim_name]")
        group = group.get_group()
    pg = group or dist.group.WORLD
    if pg is None:
        raise SpecError("group", "torch.distributed is not initialized",
                        "call torch.distributed.init_process_group (or run under torchrun)")
    return str(pg.group_name)


def runtime_of(group: GroupLike) -> Runtime:
    """The runtime of any group form the ops take (see `group_key`)."""
    return _runtime(group_key(group))


def _group_size(key: str) -> int:
    return _runtime(key).world


# The group size behind a key: a constant to torch.compile (it traces no group lookup).
_world: Callable[[str], int] = torch.compiler.assume_constant_result(_group_size)


def _runtime(key: str) -> Runtime:
    rt = _RUNTIME_KEYS.get(key)
    if rt is not None:
        return rt
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._resolve_process_group(key)  # type: ignore[attr-defined,arg-type]
    return runtime_for(pg)


def _autocast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Inside an autocast region, floating operands in its dtype, as torch.matmul gets them
    (the cast is differentiable: gradients reach the full-precision weights)."""
    out = []
    for t in tensors:
        kind = t.device.type
        if t.is_floating_point() and torch.is_autocast_enabled(kind):
            t = t.to(torch.get_autocast_dtype(kind))
        out.append(t)
    return out


def _text(s: ScheduleLike | None) -> str:
    return "" if s is None else s if isinstance(s, str) else str(s)


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


def _own(t: torch.Tensor, *inputs: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """`t` in storage of its own (a custom op's outputs alias no input), contiguous, or with
    `contiguous=False` in its layout (a gathered tensor's strides as PyTorch's)."""
    if contiguous:
        t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
        t = t.clone(memory_format=torch.preserve_format)
    return t


@torch.library.custom_op("plait::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a_shard: torch.Tensor, weights: list[torch.Tensor], group: str,
                          gather_dim: int, schedule: str, backward_schedule: str,
                          label: str = "ag_mm") -> list[torch.Tensor]:
    """[gathered, a @ w for w in weights] (see `all_gather_matmul`); `label` names the call
    in records and traces (a backward's dual pair says so)."""
    with strands.turn(label, group) as key:
        rt = _runtime(key)
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
    world = _runtime(group).world
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


def _wgrad(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x^T g, the gradient of `weight` (K, N), laid out as `weight` is: a layer's weight
    passed as `W.T` gets its gradient as the transpose of a contiguous (N, K), so W's own
    gradient is contiguous (autograd would otherwise warn and copy it)."""
    x2, g2 = _rows2d(x), _rows2d(g)
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1:
        return (g2.T @ x2).T
    return x2.T @ g2


def _ag_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    a_shard, weights, group, gather_dim, schedule, backward_schedule, _ = inputs
    d, _, bwd = _ag_checks(_runtime(group).world, a_shard, weights, gather_dim, schedule,
                           backward_schedule)
    ctx.group, ctx.d, ctx.bwd, ctx.shard = group, d, str(bwd), tuple(a_shard.shape)
    ctx.save_for_backward(output[0], *weights)
    ctx.set_materialize_grads(False)  # an unused output's gradient is None: no zeros sent


class _Once:
    """`fn()` computed at the first call, its value returned at every call."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.value: Any = None

    def __call__(self) -> Any:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            self.value = fn()
        return self.value


def _filling(work: Callable[[], Any]) -> contextlib.AbstractContextManager[Any]:
    """While the block waits on communication, `work` runs (`strands.filling`): eagerly and
    where no strand plans this thread's work; never while compiling (the waits run inside
    the op's kernel, outside the traced graph)."""
    if torch.compiler.is_compiling() or strands.beside_other_work():
        return contextlib.nullcontext()
    return strands.filling(work, own=True)


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
        rt = _runtime(key)
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
    world = _runtime(group).world
    d, _, _ = _rs_checks(world, a, weight, scatter_dim, schedule, backward_schedule)
    shape = [*a.shape[:-1], weight.shape[1]]
    shape[d] //= world
    return a.new_empty(shape)


def _rs_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, group, scatter_dim, schedule, backward_schedule, _ = inputs
    d, _, bwd = _rs_checks(_runtime(group).world, a, weight, scatter_dim, schedule,
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


@torch.library.custom_op("plait::reduce_scatter", mutates_args=())
def _reduce_scatter_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain reduce-scatter (sum) of `t`'s rows (dim 0): the all-gather -> matmul
    backward's unpaired reductions."""
    with strands.turn("reduce_scatter", group) as key:
        rt = _runtime(key)
        out = t.new_empty((t.shape[0] // rt.world, *t.shape[1:]))
        rt.collective().reduce_scatter(out, t.contiguous(), "ag_mm.bwd").wait()
        return out


@_reduce_scatter_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return t.new_empty((t.shape[0] // _runtime(group).world, *t.shape[1:]))


@torch.library.custom_op("plait::all_gather", mutates_args=())
def _all_gather_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain all-gather of `t`'s rows (dim 0), in rank order."""
    with strands.turn("all_gather", group) as key:
        rt = _runtime(key)
        out = t.new_empty((t.shape[0] * rt.world, *t.shape[1:]))
        rt.collective().all_gather(out, t.contiguous(), "all_gather").wait()
        return out


@_all_gather_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return t.new_empty((t.shape[0] * _runtime(group).world, *t.shape[1:]))


# each other's backward: the gradient of a reduce-scatter is the all-gather of its gradient
_reduce_scatter_op.register_autograd(
    lambda ctx, g: (torch.ops.plait.all_gather(g.contiguous(), ctx.group), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "group", inputs[1]))
_all_gather_op.register_autograd(
    lambda ctx, g: (torch.ops.plait.reduce_scatter(g.contiguous(), ctx.group), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "group", inputs[1]))


def reduce_scatter(t: torch.Tensor, group: GroupLike = None, *, dim: int = 0) -> torch.Tensor:
    """The sum over the group's ranks of `t`, this rank's chunk along `dim` (differentiable:
    its backward all-gathers): a plain collective of plait's, so it runs on plait's
    communicators (and an `OVERLAP_F_B` strand's own)."""
    key = group_key(group)
    d = _dim(dim, t.dim(), "dim")
    if t.shape[d] % _world(key):
        raise SpecError("t", f"dimension {d} of size {t.shape[d]} does not split over "
                        f"{_world(key)} ranks", f"pad it to a multiple of {_world(key)}")
    moved = t.movedim(d, 0).contiguous()
    out: torch.Tensor = torch.ops.plait.reduce_scatter(moved, key)
    return out.movedim(0, d).contiguous()


@torch.library.custom_op("plait::all_to_all_matmul", mutates_args=())
def _all_to_all_matmul_op(x: torch.Tensor, weight: torch.Tensor, group: str, schedule: str,
                          backward_schedule: str, label: str = "a2a_mm"
                          ) -> list[torch.Tensor]:
    """[received, received @ weight] (see `all_to_all_matmul`)."""
    with strands.turn(label, group) as key:
        rt = _runtime(key)
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
    _exchange_checks(_runtime(group).world, "x", x, weight, schedule, backward_schedule)
    return [x.new_empty(x.shape), x.new_empty((x.shape[0], weight.shape[-1]))]


def _a2a_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, weight, group, schedule, backward_schedule, _ = inputs
    _, bwd = _exchange_checks(_runtime(group).world, "x", x, weight, schedule,
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
    world = _runtime(ctx.group).world
    dw = strands.weight_grad(w, lambda: _expert_grad(received, g_y, world, w))
    return dx, dw, *[None] * (len(ctx.needs_input_grad) - 2)


_all_to_all_matmul_op.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@torch.library.custom_op("plait::matmul_all_to_all", mutates_args=())
def _matmul_all_to_all_op(a: torch.Tensor, weight: torch.Tensor, group: str, schedule: str,
                          backward_schedule: str, label: str = "mm_a2a") -> torch.Tensor:
    """all_to_all(a @ weight) (see `matmul_all_to_all`)."""
    with strands.turn(label, group) as key:
        rt = _runtime(key)
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
    _exchange_checks(_runtime(group).world, "a", a, weight, schedule, backward_schedule)
    return a.new_empty((a.shape[0], weight.shape[-1]))


def _mm_a2a_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, group, schedule, backward_schedule, _ = inputs
    _, bwd = _exchange_checks(_runtime(group).world, "a", a, weight, schedule,
                              backward_schedule)
    ctx.group, ctx.bwd = group, str(bwd)
    ctx.save_for_backward(a, weight)


def _mm_a2a_backward(ctx: Any, g_y: torch.Tensor) -> tuple[Any, ...]:
    a, w = ctx.saved_tensors
    g_full, da = torch.ops.plait.all_to_all_matmul(g_y.contiguous(),
                                                   w.transpose(-1, -2).contiguous(), ctx.group,
                                                   ctx.bwd, ctx.bwd, "mm_a2a.bwd")
    world = _runtime(ctx.group).world
    dw = strands.weight_grad(w, lambda: _expert_grad(a, g_full, world, w))
    return da, dw, *[None] * (len(ctx.needs_input_grad) - 2)


_matmul_all_to_all_op.register_autograd(_mm_a2a_backward, setup_context=_mm_a2a_setup)


@torch.library.custom_op("plait::all_to_all", mutates_args=())
def _all_to_all_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain all-to-all of `t`'s equal row chunks: the dispatch backward's unpaired part."""
    out = torch.empty_like(t)
    with strands.turn("all_to_all", group) as key:
        _runtime(key).collective().all_to_all(out, t.contiguous(), "a2a_mm.bwd").wait()
        return out


@_all_to_all_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(t)


# --- FP8 scaled variants (PyTorch's fused_all_gather_scaled_matmul and
# fused_scaled_matmul_reduce_scatter): every schedule's GEMM pieces run torch._scaled_mm on
# their rows, row-wise scales following the rows; no autograd (PyTorch's have none) -------

def all_gather_scaled_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor],
                             A_scale: torch.Tensor, B_scales: Sequence[torch.Tensor],
                             gather_dim: int = 0, group: GroupLike = None,
                             biases: Sequence[torch.Tensor | None] | None = None,
                             result_scales: Sequence[torch.Tensor | None] | None = None,
                             out_dtypes: Sequence[torch.dtype | None] | None = None,
                             use_fast_accum: Sequence[bool] | None = None, *,
                             schedule: ScheduleLike = "seq/sm", return_A: bool = True,
                             group_name: GroupLike = None,
                             ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Overlapped form of PyTorch's `fused_all_gather_scaled_matmul` (its positional order)::

        A = all_gather(A_shard, gather_dim)      # FP8, concatenated in rank order
        return A, [torch._scaled_mm(A, B, A_scale, B_scale, bias, result_scale,
                                    out_dtype, use_fast_accum) for each B ...]

    `A_scale`: tensor-wise (one element), or row-wise: one per row of `A_shard`
    (`A_shard.shape[:-1] + (1,)`, gathered with it) or of the gathered A (replicated).
    `gather_dim`: a leading dimension. Any schedule on either engine, not "auto"; no autograd.
    """
    group = _group_given(group, group_name)
    n = len(Bs)
    outs = torch.ops.plait.all_gather_scaled_matmul(
        A_shard, list(Bs), A_scale, list(B_scales), group_key(group), gather_dim,
        _each("biases", biases, n), _each("result_scales", result_scales, n),
        [_dtype_code(d) for d in _each("out_dtypes", out_dtypes, n)],
        [bool(f) for f in _each("use_fast_accum", use_fast_accum, n, False)], _text(schedule))
    return (outs[0] if return_A else None), list(outs[1:])


def scaled_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, A_scale: torch.Tensor,
                                 B_scale: torch.Tensor, reduce_op: str = "sum",
                                 scatter_dim: int = 0, group: GroupLike = None,
                                 bias: torch.Tensor | None = None,
                                 result_scale: torch.Tensor | None = None,
                                 out_dtype: torch.dtype | None = None,
                                 use_fast_accum: bool = False, *,
                                 schedule: ScheduleLike = "seq/sm",
                                 group_name: GroupLike = None) -> torch.Tensor:
    """Overlapped form of PyTorch's `fused_scaled_matmul_reduce_scatter`::

        C = torch._scaled_mm(A, B, A_scale, B_scale, bias, result_scale, out_dtype, ...)
        return reduce_scatter(C, reduce_op, scatter_dim)

    `A_scale`: tensor-wise, or row-wise (`A.shape[:-1] + (1,)`); `scatter_dim` a leading
    dimension; `out_dtype` the dtype partials are reduced in (bf16, fp16 or fp32). Any
    schedule on either engine, not "auto"; no autograd."""
    group = _group_given(group, group_name)
    if reduce_op not in REDUCE_OPS:
        raise SpecError("reduce_op", f"{reduce_op!r} is not supported",
                        f"use one of {', '.join(REDUCE_OPS)}")
    key = group_key(group)
    y: torch.Tensor = torch.ops.plait.scaled_matmul_reduce_scatter(
        A, B, A_scale, B_scale, key, scatter_dim, bias, result_scale, out_dtype,
        use_fast_accum, _text(schedule))
    return y / _world(key) if reduce_op == "avg" else y


def _each(name: str, values: Sequence[Any] | None, n: int, default: Any = None) -> list[Any]:
    """One value per weight (`default` for every one when None)."""
    if values is None:
        return [default] * n
    if len(values) != n:
        raise SpecError(name, f"{len(values)} values for {n} weights", f"pass {n}, or None")
    return list(values)


# The output dtypes a list of them travels as (a custom op takes no list of dtypes): the
# index of each, -1 for the default (A's dtype)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
               torch.float8_e5m2)


def _dtype_code(d: torch.dtype | None) -> int:
    if d is None:
        return -1
    if d not in _OUT_DTYPES:
        raise SpecError("out_dtypes", f"{d} is not an output dtype of a scaled GEMM",
                        f"pass one of {', '.join(map(str, _OUT_DTYPES))}")
    return _OUT_DTYPES.index(d)


def _dtype_of(code: int) -> torch.dtype | None:
    return None if code < 0 else _OUT_DTYPES[code]


def _scaled_schedule(schedule: str) -> Schedule:
    s = _schedule(schedule, Axis.M)
    if not isinstance(s, Schedule):
        raise SpecError("schedule", "\"auto\" is not offered for the FP8 scaled ops",
                        "pass a schedule, e.g. seq/sm or fine/dma/c2/g1/M")
    return s


def _row_scale(name: str, scale: torch.Tensor, rows_shape: tuple[int, ...],
               shard_shape: tuple[int, ...] | None, d: int) -> str:
    """How `scale` scales A: "tensor" (one element), "rows" (one per row of A), or
    "shard rows" (one per row of this rank's shard, to be gathered)."""
    if scale.numel() == 1:
        return "tensor"
    lead = tuple(scale.shape[:-1])
    if scale.dim() >= 1 and scale.shape[-1] == 1 and lead == rows_shape:
        return "rows"
    if shard_shape is not None and scale.shape[-1] == 1 and lead == shard_shape:
        return "shard rows"
    want = f"{(*rows_shape, 1)}" + ("" if shard_shape is None else f" or {(*shard_shape, 1)}")
    raise SpecError(name, f"shape {tuple(scale.shape)} is neither one scale nor one per row",
                    f"pass one element, or shape {want}")


def _ag_scaled_checks(world: int, a: torch.Tensor, bs: Sequence[torch.Tensor],
                      a_scale: torch.Tensor, b_scales: Sequence[torch.Tensor],
                      gather_dim: int, schedule: str) -> tuple[int, Schedule, str]:
    d = _dim(gather_dim, a.dim(), "gather_dim")
    if d == a.dim() - 1 or a.dim() < 2:
        raise SpecError("gather_dim", "the FP8 scaled all-gather gathers rows",
                        "gather a leading dimension")
    if not bs or len(b_scales) != len(bs):
        raise SpecError("B_scales", f"{len(b_scales)} scales for {len(bs)} weights",
                        "pass one scale per weight")
    for i, b in enumerate(bs):
        if b.dim() != 2 or b.shape[0] != a.shape[-1]:
            raise SpecError(f"Bs[{i}]", f"shape {tuple(b.shape)} does not match A_shard's "
                            f"last dimension {a.shape[-1]}", f"pass ({a.shape[-1]}, N) weights")
    shard = tuple(a.shape[:-1])
    full = list(shard)
    full[d] *= world
    return d, _scaled_schedule(schedule), _row_scale("A_scale", a_scale, tuple(full), shard, d)


def _scaled_gemm(a_scale: torch.Tensor, rows_scale: torch.Tensor | None,
                 b_scales: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                 result_scales: Sequence[torch.Tensor | None],
                 dtypes_: Sequence[torch.dtype | None], fast: Sequence[bool]
                 ) -> execute.RowGemm:
    """Weight i's GEMM piece as `torch._scaled_mm`, A's scale the tensor-wise one, or the
    row-wise scales (`rows_scale`, one per row of A) of the piece's rows."""
    def gemm(i: int, x: torch.Tensor, w: torch.Tensor, rows: Callable[[], torch.Tensor]
             ) -> torch.Tensor:
        sa = a_scale.reshape(()) if rows_scale is None else rows_scale[rows()]
        out: torch.Tensor = torch._scaled_mm(x.contiguous(), w, sa, b_scales[i], biases[i],
                                             result_scales[i], out_dtype=dtypes_[i],
                                             use_fast_accum=fast[i])
        return out

    return gemm


def _rows_of_scale(scale: torch.Tensor, d: int) -> torch.Tensor:
    """A row-wise scale as one column, in the rows-first order of `_rows_first`."""
    return scale.movedim(d, 0).reshape(-1, 1).contiguous()


@torch.library.custom_op("plait::all_gather_scaled_matmul", mutates_args=())
def _ag_scaled_op(a_shard: torch.Tensor, bs: list[torch.Tensor], a_scale: torch.Tensor,
                  b_scales: list[torch.Tensor], group: str, gather_dim: int,
                  biases: list[torch.Tensor | None], result_scales: list[torch.Tensor | None],
                  out_dtypes: list[int], use_fast_accum: list[bool], schedule: str
                  ) -> list[torch.Tensor]:
    """[gathered A, the scaled products] (see `all_gather_scaled_matmul`)."""
    label = "ag_smm"
    with strands.turn(label, group) as key:
        rt = _runtime(key)
        d, s, mode = _ag_scaled_checks(rt.world, a_shard, bs, a_scale, b_scales, gather_dim,
                                       schedule)
        rt.check_same("all_gather_scaled_matmul",
                      _signature(5, s, s, d, a_shard, *bs, a_scale),
                      "A_shard, Bs, A_scale, gather_dim, schedule")
        a2, moved = _rows_first(a_shard, d)
        execute.check_splits(label, a2.shape[0], s, "rows")
        rows_scale = None
        if mode == "rows":
            rows_scale = _rows_of_scale(a_scale, d).float()
        elif mode == "shard rows":
            mine = _rows_of_scale(a_scale, d).float()
            rows_scale = mine.new_empty((mine.shape[0] * rt.world, 1))
            rt.collective().all_gather(rows_scale, mine, f"{label} A_scale").wait()
        dtypes_ = [_dtype_of(t) for t in out_dtypes]

        gemm = _scaled_gemm(a_scale, rows_scale, b_scales, biases, result_scales, dtypes_,
                            use_fast_accum)
        g, ys = execute.all_gather_matmul(rt, a2, list(bs), s, Axis.M, True, label,
                                          gemm=gemm, out_dtypes=dtypes_)
        assert g is not None
        n0 = moved[0] * rt.world
        return [_own(_rows_back(g, moved, d, n0), a_shard, contiguous=False),
                *(_own(_rows_back(y, moved, d, n0), contiguous=False) for y in ys)]


@_ag_scaled_op.register_fake
def _(a_shard: torch.Tensor, bs: list[torch.Tensor], a_scale: torch.Tensor,
      b_scales: list[torch.Tensor], group: str, gather_dim: int,
      biases: list[torch.Tensor | None], result_scales: list[torch.Tensor | None],
      out_dtypes: list[int], use_fast_accum: list[bool], schedule: str) -> list[torch.Tensor]:
    world = _runtime(group).world
    d, _, _ = _ag_scaled_checks(world, a_shard, bs, a_scale, b_scales, gather_dim, schedule)
    moved = list(a_shard.movedim(d, 0).shape)
    moved[0] *= world

    def laid_out(n: int, dtype: torch.dtype) -> torch.Tensor:
        return a_shard.new_empty((*moved[:-1], n), dtype=dtype).movedim(0, d)

    return [laid_out(moved[-1], a_shard.dtype),
            *(laid_out(b.shape[1], _dtype_of(t) or a_shard.dtype)
              for b, t in zip(bs, out_dtypes, strict=True))]


def _rs_scaled_checks(world: int, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                      scatter_dim: int, dtype: torch.dtype | None, schedule: str
                      ) -> tuple[int, Schedule, str, torch.dtype]:
    d = _dim(scatter_dim, a.dim(), "scatter_dim")
    if d == a.dim() - 1 or a.dim() < 2:
        raise SpecError("scatter_dim", "the FP8 scaled reduce-scatter scatters rows",
                        "scatter a leading dimension")
    if b.dim() != 2 or b.shape[0] != a.shape[-1]:
        raise SpecError("B", f"shape {tuple(b.shape)} does not match A's last dimension "
                        f"{a.shape[-1]}", f"pass a ({a.shape[-1]}, N) weight")
    if a.shape[d] % world:
        raise SpecError("A", f"dimension {d} of size {a.shape[d]} is not divisible by the "
                        f"group size {world}", f"pad it to a multiple of {world}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise SpecError("out_dtype", f"{dtype} partials cannot be reduced",
                        "pass torch.bfloat16, torch.float16 or torch.float32")
    mode = _row_scale("A_scale", a_scale, tuple(a.shape[:-1]), None, d)
    assert dtype is not None
    return d, _scaled_schedule(schedule), mode, dtype


@torch.library.custom_op("plait::scaled_matmul_reduce_scatter", mutates_args=())
def _rs_scaled_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                  b_scale: torch.Tensor, group: str, scatter_dim: int,
                  bias: torch.Tensor | None, result_scale: torch.Tensor | None,
                  out_dtype: torch.dtype | None, use_fast_accum: bool, schedule: str
                  ) -> torch.Tensor:
    """reduce_scatter(scaled A @ B) (see `scaled_matmul_reduce_scatter`)."""
    label = "smm_rs"
    with strands.turn(label, group) as key:
        rt = _runtime(key)
        d, s, mode, dtype = _rs_scaled_checks(rt.world, a, b, a_scale, scatter_dim, out_dtype,
                                              schedule)
        rt.check_same("scaled_matmul_reduce_scatter", _signature(6, s, s, d, a, b, a_scale),
                      "A, B, A_scale, scatter_dim, schedule")
        a2, moved = _rows_first(a, d)
        execute.check_splits(label, a2.shape[0] // rt.world, s, "rows per rank")
        rows_scale = _rows_of_scale(a_scale, d).float() if mode == "rows" else None

        gemm = _scaled_gemm(a_scale, rows_scale, [b_scale], [bias], [result_scale], [dtype],
                            [use_fast_accum])
        y = execute.matmul_reduce_scatter(rt, a2, b, s, label, gemm=gemm, out_dtype=dtype)
        return _own(_rows_back(y, moved, d, moved[0] // rt.world), a, b)


@_rs_scaled_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
      group: str, scatter_dim: int, bias: torch.Tensor | None,
      result_scale: torch.Tensor | None, out_dtype: torch.dtype | None, use_fast_accum: bool,
      schedule: str) -> torch.Tensor:
    world = _runtime(group).world
    d, _, _, dtype = _rs_scaled_checks(world, a, b, a_scale, scatter_dim, out_dtype, schedule)
    shape = [*a.shape[:-1], b.shape[1]]
    shape[d] //= world
    return a.new_empty(shape, dtype=dtype)


def sac_save_ops() -> tuple[Any, ...]:
    """plait's communicating ops, for a selective activation checkpointing save list (as
    torchtitan's op-level SAC names PyTorch's collectives): their outputs are kept from the
    forward, so the backward does not run their communication again."""
    return (torch.ops.plait.all_gather_matmul.default,
            torch.ops.plait.matmul_reduce_scatter.default,
            torch.ops.plait.all_to_all_matmul.default,
            torch.ops.plait.matmul_all_to_all.default)


def sac_policy(save: Sequence[Any] = ()) -> Callable[..., Any]:
    """A policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`: plait's ops
    (and `save`) are saved, everything else recomputed::

        checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, plait.ops.sac_policy()))
    """
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {*sac_save_ops(), *save}

    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op in keep
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return policy
