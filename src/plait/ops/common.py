"""What every op's call shares: the schedule it asked for, the signature every rank must pass
alike, the shapes a matmul takes its rows in, `schedule="auto"` (the call run by
`plait.tuning`), autocast, and the pieces of a backward (the weight gradient, a wait filled
with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo  # a custom op's first call imports it (~1 s): here, once, so that
import torch.distributed  # forked ranks inherit it instead of each paying it

from plait.errors import SpecError
from plait.runtime import strands
from plait.runtime.context import GroupLike, Runtime, runtime_of
from plait.schedule.schedule import (
    AUTO,
    Choice,
    CommPattern,
    Schedule,
    ScheduleLike,
    as_choice,
)
from plait.spec import dtypes
from plait.tuning.signature import Signature
from plait.tuning.tuner import tuner
from plait.workload.operators import Axis, PairKind


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


def _experts(w: torch.Tensor) -> int:
    """Local experts of an expert weight: (K, N) one, (E, K, N) E."""
    return w.shape[0] if w.dim() == 3 else 1


def _steps(rt: Runtime, s: Schedule) -> int:
    """Sub-chunks per shard the executors will cut (one rank runs sequentially)."""
    return s.steps if rt.world > 1 else 1


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


def _mm_signature(rt: Runtime, kind: PairKind, a: torch.Tensor, weight: torch.Tensor
                  ) -> Signature:
    """A pair whose GEMM takes `a`'s rows (rs, a2a, mm_a2a)."""
    return _signature_of(rt, kind, a, _rows(a), weight.shape[-1], a.shape[-1],
                         _experts(weight) if kind.experts else 1)


def _group_size(key: str) -> int:
    return runtime_of(key).world


# The group size behind a key: a constant to torch.compile (it traces no group lookup).
_world: Callable[[str], int] = torch.compiler.assume_constant_result(_group_size)


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


def _own(t: torch.Tensor, *inputs: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """`t` in storage of its own (a custom op's outputs alias no input), contiguous, or with
    `contiguous=False` in its layout (a gathered tensor's strides as PyTorch's)."""
    if contiguous:
        t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
        t = t.clone(memory_format=torch.preserve_format)
    return t


def _wgrad(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x^T g, the gradient of `weight` (K, N), laid out as `weight` is: a layer's weight
    passed as `W.T` gets its gradient as the transpose of a contiguous (N, K), so W's own
    gradient is contiguous (autograd would otherwise warn and copy it)."""
    x2, g2 = _rows2d(x), _rows2d(g)
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1:
        return (g2.T @ x2).T
    return x2.T @ g2


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
