"""plait's overlapped linears as PyTorch tensor-parallel styles, for `parallelize_module`.

    from torch.distributed.tensor.parallel import parallelize_module
    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel

    parallelize_module(block, tp_mesh, {"w1": PlaitColwiseParallel(schedule="fine/dma/c2/g1/M"),
                                        "w2": PlaitRowwiseParallel(plan="plan.json", name="fc2")})

An `nn.Linear` given a style keeps its name and parameters, now `DTensor`s sharded over the
mesh (colwise: weight and bias by output rows, `Shard(0)`; rowwise: the weight by input
columns, `Shard(1)`, the bias replicated), so distributed checkpointing and
`torch.nn.utils.clip_grad_norm_` see the whole layer. Its forward runs plait's op under the
schedule (a plan's pair, as in `plait.nn`), sequence-parallel: the colwise input is this
rank's sequence shard (dim `seq_dim`; a `DTensor` is taken local), the rowwise output is again
a sequence shard. Outputs are local tensors, or `DTensor`s with `use_local_output=False`.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from plait.errors import SpecError
from plait.nn import PlanLike, _pick
from plait.ops import ScheduleLike, all_gather_matmul, matmul_reduce_scatter


class _PlaitStyle(ParallelStyle):
    _weight_dim = 0  # the weight dimension sharded: output rows (colwise) or input columns

    def __init__(self, *, seq_dim: int = 0, schedule: ScheduleLike | None = None,
                 plan: PlanLike | None = None, name: str | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.seq_dim, self.schedule, self.plan, self.name = seq_dim, schedule, plan, name
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise SpecError(type(self).__name__, f"applies to nn.Linear, not "
                            f"{type(module).__name__}", "give the style to a Linear submodule")
        if device_mesh.ndim != 1:
            raise SpecError("device_mesh", f"a {device_mesh.ndim}-d mesh", "pass the TP mesh "
                            "(a 1-d mesh, or mesh['tp'])")
        world = device_mesh.size()
        size = module.weight.shape[self._weight_dim]
        if size % world:
            raise SpecError(type(self).__name__, f"dimension {self._weight_dim} of the weight "
                            f"({size}) does not split over {world} ranks",
                            f"use a layer whose {'out' if self._weight_dim == 0 else 'in'}"
                            f"_features is a multiple of {world}")
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh,
                                                       [Shard(self._weight_dim)]))
        if module.bias is not None:
            bias = [Shard(0)] if self._weight_dim == 0 else [Replicate()]
            module.bias = nn.Parameter(distribute_tensor(module.bias.data, device_mesh, bias))
        group = device_mesh.get_group()
        schedule = _pick(self.name, self.schedule, self.plan, backward=False,
                         world=world) or "seq/sm"
        backward = _pick(self.name, self.schedule, self.plan, backward=True)
        module.forward = types.MethodType(  # type: ignore[method-assign]
            self._forward(group, schedule, backward, device_mesh), module)
        return module

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        raise NotImplementedError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class PlaitColwiseParallel(_PlaitStyle):
    """all_gather(x, seq_dim) @ W_local.T (+ b_local): QKV, FC1."""

    _weight_dim = 0

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        seq_dim, local_out = self.seq_dim, self.use_local_output

        def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            _, (y,) = all_gather_matmul(_local(x), [_local(lin.weight).T], group,
                                        gather_dim=seq_dim, schedule=schedule,
                                        backward_schedule=backward, return_gathered=False)
            if lin.bias is not None:
                y = y + _local(lin.bias)
            return y if local_out else DTensor.from_local(y, mesh, [Shard(-1)],
                                                          run_check=False)
        return forward


class PlaitRowwiseParallel(_PlaitStyle):
    """reduce_scatter(x_local @ W_local.T, seq_dim) (+ b): out-proj, FC2."""

    _weight_dim = 1

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        seq_dim, local_out = self.seq_dim, self.use_local_output

        def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            y = matmul_reduce_scatter(_local(x), _local(lin.weight).T, group,
                                      scatter_dim=seq_dim, schedule=schedule,
                                      backward_schedule=backward)
            out: torch.Tensor = DTensor.from_local(y, mesh, [Shard(seq_dim)], run_check=False)
            if lin.bias is not None:  # in DTensor: the replicated bias's gradient is summed
                out = out + lin.bias  # over the ranks' sequence shards
            return _local(out) if local_out else out
        return forward
