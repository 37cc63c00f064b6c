"""From a measured trace to plait's schedules: for each dependent pair the trace shows
(`analyze.pairing`), what plait predicts on the given hardware. Each distinct pair is explored
once (`explore_pair`: every schedule simulated), and the predicted gain is applied to the
measured times.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.analyze.exposure import exposed_of, exposed_waiting
from plait.analyze.kineto import DeviceTrace
from plait.analyze.pairing import dependent_pairs
from plait.intervals import Covered
from plait.planner.explore import PairReport, explore_pair
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import OverlapPair


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
    found: dict[OverlapPair, list[tuple[float, ...]]] = {}
    for pair, calls in dependent_pairs(device).items():
        found[pair] = [(g.duration, c.duration, exposed_of(c, compute), c.wait or 0.0,
                        exposed_waiting(c, compute) or 0.0) for c, g in calls]
    out = []
    for pair, seen in found.items():
        n = len(seen)
        mean = [sum(col) / n for col in zip(*seen, strict=True)]
        out.append(Advice(device.device, explore_pair(pair, cluster), n, *mean))
    return sorted(out, key=lambda a: -a.saving_us * a.calls)
