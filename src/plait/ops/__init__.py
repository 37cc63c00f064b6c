"""Overlapped all-gather->matmul and matmul->reduce-scatter (tensor/sequence parallel), and
all-to-all->matmul and matmul->all-to-all (expert-parallel dispatch and combine), with autograd.

Semantics and argument names follow PyTorch's `fused_all_gather_matmul` and
`fused_matmul_reduce_scatter`, so users can switch. Every call runs a `Schedule` (the same values
`plait explore` picks) on the collective engine (`/sm`) or the peer-copy engine (`/dma`) and
appends a `CallRecord` (schedule, engine) to `plait.runtime.context.runtime_of(group).records`.

One module per concern: `dense` (the two dense pairs), `collectives` (plain reduce-scatter and
all-gather), `experts` (the two expert-parallel pairs), `fp8` (the scaled variants),
`checkpointing` (the selective checkpointing policy), `common` (what every call shares); a
group in any form resolves through `plait.runtime.context` (`group_key`, `runtime_of`).
"""

from plait.ops.checkpointing import sac_policy, sac_save_ops
from plait.ops.collectives import reduce_scatter
from plait.ops.dense import REDUCE_OPS, all_gather_matmul, matmul_reduce_scatter
from plait.ops.experts import (
    all_to_all_matmul,
    expert_blocks,
    expert_unblocks,
    matmul_all_to_all,
)
from plait.ops.fp8 import all_gather_scaled_matmul, scaled_matmul_reduce_scatter
from plait.runtime.context import GroupLike, group_key, runtime_of

__all__ = ["REDUCE_OPS", "GroupLike", "all_gather_matmul", "all_gather_scaled_matmul",
           "all_to_all_matmul", "expert_blocks", "expert_unblocks", "group_key",
           "matmul_all_to_all", "matmul_reduce_scatter", "reduce_scatter", "runtime_of",
           "sac_policy", "sac_save_ops", "scaled_matmul_reduce_scatter"]
