"""From a measured trace to plait's schedules: which exposed collectives form a dependent pair
with the GEMM beside them, and what plait predicts for that pair on the given hardware.

A transfer that feeds a GEMM (all-gather, all-to-all dispatch) is paired with one of the first
GEMMs that start after it and read exactly what it moved (its A operand, M*K elements, or for a
weight gradient its B operand, K*N); one that a GEMM feeds (reduce-scatter, all-to-all combine)
with one of the last GEMMs that started before it and wrote exactly what it moves (M*N
elements). The operands' strides tell whether the gather filled the GEMM's rows (M) or its
reduction (K). Each distinct pair is explored once (`explore_pair`: every
schedule simulated), and the predicted gain is applied to the measured times.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from plait.analyze.exposure import exposed_of, exposed_waiting
from plait.analyze.kineto import Comm, DeviceTrace, Kernel
from plait.intervals import Covered
from plait.planner.explore import PairReport, explore_pair
from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Axis, Collective, CollectiveKind, Gemm, OverlapPair

LOOKAHEAD = 4  # GEMMs examined on each side of a transfer for its partner
_DIRECTIONS: dict[CollectiveKind, tuple[Literal["in", "out"], ...]] = {
    CollectiveKind.AG: ("in",), CollectiveKind.RS: ("out",), CollectiveKind.A2A: ("in", "out")}


@dataclass(frozen=True, slots=True)
class Advice:
    """One dependent pair found in the trace: what it costs now and what plait predicts."""

    device: str
    report: PairReport  # every schedule simulated on the target hardware
    calls: int
    gemm_us: float  # measured, per call
    comm_us: float  # measured, per call
    exposed_us: float  # measured, per call: the transfer time no compute covered
    wait_us: float = 0.0  # per call: of comm_us, waiting for the last rank (0: not known)
    exposed_wait_us: float = 0.0  # per call: of exposed_us, waiting for the last rank

    @property
    def pair(self) -> OverlapPair:
        return self.report.pair

    @property
    def now_us(self) -> float:
        """Wall time the pair takes now, per call: its GEMM and its exposed transfer."""
        return self.gemm_us + self.exposed_us

    @property
    def plait_us(self) -> float:
        """plait's predicted ratio (best schedule / sequential) applied to the measured
        sequential time of the pair (its GEMM plus its transfer, without waiting for other
        ranks), plus the exposed wait, which no schedule of this pair removes."""
        r = self.report
        seq = self.gemm_us + self.comm_us - self.wait_us
        return seq * r.chosen.time_s / r.sequential.time_s + self.exposed_wait_us

    @property
    def saving_us(self) -> float:
        """Per call; negative when the pair is already better hidden than plait predicts."""
        return self.now_us - self.plait_us


def advise(device: DeviceTrace, compute: Covered, cluster: ClusterSpec) -> list[Advice]:
    """The dependent pairs on `device` (whose compute intervals `compute` merges), largest
    predicted saving first."""
    gemms = [g for g in device.compute if g.gemm is not None]  # in start order
    starts = [g.start for g in gemms]
    found: dict[OverlapPair, list[tuple[float, ...]]] = {}
    for c in device.comms:
        match = _partner(c, gemms, starts)
        if match is not None:
            pair, g = match
            found.setdefault(pair, []).append((g.duration, c.duration, exposed_of(c, compute),
                                               c.wait or 0.0, exposed_waiting(c, compute) or 0.0))
    out = []
    for pair, seen in found.items():
        n = len(seen)
        mean = [sum(col) / n for col in zip(*seen, strict=True)]
        out.append(Advice(device.device, explore_pair(pair, cluster), n, *mean))
    return sorted(out, key=lambda a: -a.saving_us * a.calls)


def _partner(c: Comm, gemms: Sequence[Kernel], starts: Sequence[float]
             ) -> tuple[OverlapPair, Kernel] | None:
    if c.kind not in _DIRECTIONS or c.group < 2 or c.elems <= 0 or c.plaits_own:
        return None
    at = bisect_left(starts, c.start)  # gemms[at:] start at or after the transfer
    for direction in _DIRECTIONS[c.kind]:
        near = (gemms[at:at + LOOKAHEAD] if direction == "in"
                else gemms[max(0, at - LOOKAHEAD):at][::-1])
        for g in near:
            for axis, (m, n, k, count) in _readings(c, g, direction):
                if (m if axis is Axis.M else k) % c.group:
                    continue
                dtype = g.dtype or c.dtype or "bf16"  # a GEMM records its input types
                name = (f"{c.kind.name.lower()}:{m}x{n}x{k}" + (f"x{count}" if count > 1 else "")
                        + ("/K" if axis is Axis.K else ""))
                coll = Collective(name, c.kind, c.elems * DTYPE_BYTES[dtype], c.group)
                return OverlapPair(name, coll, Gemm(name, m, n, k, dtype, count), direction,
                                   axis), g
    return None


def _readings(c: Comm, g: Kernel, direction: str
              ) -> list[tuple[Axis, tuple[int, int, int, int]]]:
    """How GEMM `g` can be the partner of transfer `c`: the axis the transfer fills and the
    GEMM (m, n, k, count) as plait's pair has it. What an all-gather fills is the stored
    tensor's rows: A's rows (tokens, M) when A is stored as is; the reduction K when A is a
    transposed view, or when the gathered tensor is B (a weight gradient, dW = dY^T X: plait's
    pair is its transpose, X^T dY)."""
    assert g.gemm is not None
    m, n, k, count = g.gemm
    a_t, b_t = g.transposed
    if direction == "out":  # the product's rows go out
        return [(Axis.M, g.gemm)] if m * n * count == c.elems else []
    out = []
    if m * k * count == c.elems:
        out.append((Axis.K, g.gemm) if a_t and c.kind is CollectiveKind.AG
                   else (Axis.M, g.gemm))
    if c.kind is CollectiveKind.AG and not b_t and count == 1 and k * n == c.elems:
        out.append((Axis.K, (n, m, k, 1)))
    return out
