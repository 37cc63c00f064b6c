"""FP8 as PyTorch's `fused_all_gather_scaled_matmul` and `fused_scaled_matmul_reduce_scatter`
take it: every schedule's GEMM pieces run `torch._scaled_mm` on their rows, row-wise scales
following the rows; no autograd (PyTorch's have none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from plait.errors import SpecError
from plait.ops.common import (
    _dim,
    _group_given,
    _own,
    _rows_back,
    _rows_first,
    _schedule,
    _signature,
    _text,
    _world,
)
from plait.ops.dense import REDUCE_OPS
from plait.runtime import execute, strands
from plait.runtime.context import GroupLike, group_key, runtime_of
from plait.schedule.schedule import (
    Schedule,
    ScheduleLike,
)
from plait.workload.operators import Axis

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
        rt = runtime_of(key)
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
    world = runtime_of(group).world
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
        rt = runtime_of(key)
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
    world = runtime_of(group).world
    d, _, _, dtype = _rs_scaled_checks(world, a, b, a_scale, scatter_dim, out_dtype, schedule)
    shape = [*a.shape[:-1], b.shape[1]]
    shape[d] //= world
    return a.new_empty(shape, dtype=dtype)
