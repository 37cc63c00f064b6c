"""A workload operator as a simulator task: its standalone time from the cost model and the
resources it holds, so that operators of two strands can share a GPU in the simulator."""

from __future__ import annotations

from plait.cost import contention
from plait.cost.comm import collective_cost, elementwise_time
from plait.cost.gemm import attention_time, gemm_cost
from plait.sim.engine import Task
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Attention, Collective, Elementwise, Gemm, Op


def op_task(op: Op, cluster: ClusterSpec, name: str, stream: str,
            deps: tuple[str, ...] = ()) -> Task:
    if isinstance(op, Collective):
        c = collective_cost(op, cluster)
        return Task(name, stream, c.duration, contention.SM_COMM, deps, c.uses, c.reserves,
                    contention.slowdowns(cluster)[contention.SM_COMM], label=op.name)
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
