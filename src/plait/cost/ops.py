"""Standalone time of any operator of the workload model: one dispatch table, one cost model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.cost.comm import collective_time, elementwise_time
from plait.cost.gemm import attention_time, gemm_time
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import Attention, Collective, Elementwise, Gemm, Op

_TIME: dict[type, Callable[[Any, ClusterSpec], float]] = {
    Gemm: gemm_time,
    Attention: attention_time,
    Elementwise: lambda op, cluster: elementwise_time(op.bytes, cluster),
    Collective: collective_time,
}


def op_time(op: Op, cluster: ClusterSpec) -> float:
    """Seconds `op` takes alone on `cluster`."""
    return _TIME[type(op)](op, cluster)
