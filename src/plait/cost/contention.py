"""Contention: how concurrently running compute and communication slow each other.

Three mechanisms, each a parameter of `CostParams`:
1. Compute units: a collective kernel reserves `comm_compute_units`; a GEMM running beside it
   gets the rest (its rate scales with the units left). Copy engines take none.
2. Memory bandwidth: every task declares the share of HBM bandwidth it uses at full speed; when
   the shares exceed 1, all users slow proportionally (the simulator does this).
3. Interference beyond bandwidth (caches, memory-controller queues): a fixed fractional slowdown
   of a GEMM while SM collectives (`gemm_slowdown_sm_comm`) or copy engines
   (`gemm_slowdown_dma`) run, and of a transfer while compute runs
   (`sm_comm_slowdown_under_compute`, `dma_slowdown_under_compute`).
"""

from __future__ import annotations

from plait.spec.hardware import ClusterSpec

# Task categories the simulator matches slowdowns against.
COMPUTE = "compute"
SM_COMM = "sm_comm"
DMA = "dma"


def slowdowns(cluster: ClusterSpec) -> dict[str, dict[str, float]]:
    """Per task category, its rate multipliers while tasks of each other category run beside
    it: a GEMM beside collective kernels or copy engines, a transfer (either engine) beside
    compute. Built once per cluster: every task of a category holds the same map."""
    def build() -> dict[str, dict[str, float]]:
        p = cluster.params
        return {COMPUTE: {SM_COMM: 1.0 - p.gemm_slowdown_sm_comm, DMA: 1.0 - p.gemm_slowdown_dma},
                SM_COMM: {COMPUTE: 1.0 - p.sm_comm_slowdown_under_compute},
                DMA: {COMPUTE: 1.0 - p.dma_slowdown_under_compute}}

    return cluster.cached("slowdowns", build)
