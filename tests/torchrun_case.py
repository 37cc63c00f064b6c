"""Run under torchrun: separate processes (own hash seeds, own imports), the default runtime
with the cross-rank shape check on, every engine."""

import os

import torch
import torch.distributed as dist

from plait import ops
from plait.runtime.context import close_all
from plait.runtime.launch import leave_group

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
a_full, w = torch.randn(8 * world, 6), torch.randn(6, 4)
for schedule in ("seq/sm", "fine/dma/c2/g1/M", "p2p/sm/M"):
    _, (y,) = ops.all_gather_matmul(a_full.chunk(world)[rank].clone(), [w],
                                    schedule=schedule)
    assert torch.allclose(y, a_full @ w, atol=1e-5), schedule
close_all()
leave_group()
print(f"rank {rank} ok pid {os.getpid()}")
