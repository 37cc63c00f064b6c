"""Plain reduce-scatter and all-gather as custom ops, each the other's backward (the gradient
of a reduce-scatter is the all-gather of its gradient): what a layer between two pairs needs.
"""

from __future__ import annotations

import torch

from plait.errors import SpecError
from plait.ops.common import _dim, _world
from plait.runtime import strands
from plait.runtime.context import GroupLike, group_key, runtime_of


@torch.library.custom_op("plait::reduce_scatter", mutates_args=())
def _reduce_scatter_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain reduce-scatter (sum) of `t`'s rows (dim 0): the all-gather -> matmul
    backward's unpaired reductions."""
    with strands.turn("reduce_scatter", group) as key:
        rt = runtime_of(key)
        out = t.new_empty((t.shape[0] // rt.world, *t.shape[1:]))
        rt.collective().reduce_scatter(out, t.contiguous(), "ag_mm.bwd").wait()
        return out


@_reduce_scatter_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return t.new_empty((t.shape[0] // runtime_of(group).world, *t.shape[1:]))


@torch.library.custom_op("plait::all_gather", mutates_args=())
def _all_gather_op(t: torch.Tensor, group: str) -> torch.Tensor:
    """The plain all-gather of `t`'s rows (dim 0), in rank order."""
    with strands.turn("all_gather", group) as key:
        rt = runtime_of(key)
        out = t.new_empty((t.shape[0] * rt.world, *t.shape[1:]))
        rt.collective().all_gather(out, t.contiguous(), "all_gather").wait()
        return out


@_all_gather_op.register_fake
def _(t: torch.Tensor, group: str) -> torch.Tensor:
    return t.new_empty((t.shape[0] * runtime_of(group).world, *t.shape[1:]))


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
