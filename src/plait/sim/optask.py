"""A workload operator as a simulator task: its standalone time from the cost model and the
resources it holds, so that operators of two strands can share a GPU in the simulator."""

from __future__ import annotations

from plait.cost import contention
from plait.cost.comm import collective_cost, elementwise_time, ring_step_cost
from plait.cost.gemm import attention_time, gemm_cost
from plait.cost.resources import Cost
from plait.sim.engine import Task
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Attention, Collective, Elementwise, Gemm, Op


def op_task(op: Op, cluster: ClusterSpec, name: str, stream: str,
            deps: tuple[str, ...] = ()) -> Task:
    if isinstance(op, Collective):
        return _comm_task(collective_cost(op, cluster), op, cluster, name, stream, deps)
    if isinstance(op, Gemm):
        c = gemm_cost(op, cluster)
        t, uses = c.duration, c.uses
    elif isinstance(op, Attention):
        t, uses = attention_time(op, cluster), {"compute": 1.0}
    elif isinstance(op, Elementwise):
        t, uses = elementwise_time(op.bytes, cluster), {"compute": 1.0, "hbm": 1.0}
    else:
        raise TypeError(f"no cost for operator {op!r}")
    return Task(name, stream, t, contention.COMPUTE, deps, uses,
                slowdowns=contention.slowdowns(cluster)[contention.COMPUTE], label=op.name)


def ring_step_task(ring: Collective, cluster: ClusterSpec, name: str, stream: str,
                   deps: tuple[str, ...] = (), nbytes: float | None = None) -> Task:
    """One step of the P2P ring `ring` passing `nbytes` (`cost.comm.ring_step_cost`) as a
    task."""
    return _comm_task(ring_step_cost(ring, cluster, nbytes), ring, cluster, name, stream, deps)


def _comm_task(c: Cost, op: Collective, cluster: ClusterSpec, name: str, stream: str,
               deps: tuple[str, ...]) -> Task:
    return Task(name, stream, c.duration, contention.SM_COMM, deps, c.uses, c.reserves,
                contention.slowdowns(cluster)[contention.SM_COMM], label=op.name)
