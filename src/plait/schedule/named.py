"""The defaults of the tools users would otherwise pick, as named points of the design space.

- PyTorch async TP (symmetric memory, `fused_all_gather_matmul` / `fused_matmul_reduce_scatter`):
  shard level, one chunk per rank, peer copies on the copy engines; reduce-scatter partials pushed
  to their owners and summed at the end.
- TransformerEngine userbuffers: ring exchange (shard-level P2P on the copy engine) for the
  all-gather side; for the reduce-scatter side its pipelined method: the GEMM in 4 splits, each
  reduce-scattered by collective kernels on a share of the SMs.
- Plain NCCL/RCCL then GEMM: sequential.
Neither tool overlaps MoE all-to-all, so they have no point there.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.workload.operators import CollectiveKind, OverlapPair

TE_PIPELINE_SPLITS = 4


def pytorch_async_tp(pair: OverlapPair) -> Schedule | None:
    if pair.collective.kind not in (CollectiveKind.AG, CollectiveKind.RS):
        return None
    return Schedule(CommPattern.P2P, Engine.DMA, axis=pair.axis)


def transformer_engine(pair: OverlapPair) -> Schedule | None:
    if pair.collective.kind is CollectiveKind.AG:
        return Schedule(CommPattern.P2P, Engine.DMA, axis=pair.axis)  # ring exchange
    if pair.collective.kind is CollectiveKind.RS:
        return Schedule(CommPattern.FINE, Engine.SM, TE_PIPELINE_SPLITS, 1, pair.axis)
    return None


def nccl_sequential(pair: OverlapPair) -> Schedule:
    return Schedule()


NAMED: dict[str, Callable[[OverlapPair], Schedule | None]] = {
    "sequential": nccl_sequential,
    "pytorch": pytorch_async_tp,
    "te": transformer_engine,
}
