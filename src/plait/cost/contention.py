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


def compute_slowdowns(cluster: ClusterSpec) -> dict[str, float]:
    """Rate multipliers of a compute task while tasks of each category run beside it."""
    p = cluster.params
    return {SM_COMM: 1.0 - p.gemm_slowdown_sm_comm, DMA: 1.0 - p.gemm_slowdown_dma}


def comm_slowdowns(cluster: ClusterSpec, category: str) -> dict[str, float]:
    """Rate multipliers of a transfer (`SM_COMM` or `DMA`) while compute runs beside it."""
    p = cluster.params
    s = p.sm_comm_slowdown_under_compute if category == SM_COMM else p.dma_slowdown_under_compute
    return {COMPUTE: 1.0 - s}


def slowdowns(cluster: ClusterSpec) -> dict[str, dict[str, float]]:
    """Per task category, its rate multipliers beside each other category (`compute_slowdowns`,
    `comm_slowdowns`); built once per cluster, the same maps for every task of a category."""
    return cluster.cached("slowdowns", lambda: {COMPUTE: compute_slowdowns(cluster),
                                                SM_COMM: comm_slowdowns(cluster, SM_COMM),
                                                DMA: comm_slowdowns(cluster, DMA)})
