"""Two layouts side by side (`plait plan --compare`): what each predicted step is made of, the
memory each needs and keeps, and whether the model can tell their steps apart at all.

A step splits into the busiest rank's compute (GEMMs, attention, the head and loss on the last
stage, for every micro-batch), its recomputation, the tensor/context/expert-parallel
communication the layers leave exposed, the rest of the pipeline part (the bubble, the
stage-to-stage transfers, eager kernels' traffic and what co-execution's pairing adds or
saves), the exposed data-parallel communication and what the hidden part slows, and the
optimizer step and synchronization. The parts add up to the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.plan.memory import GiB
from plait.planner.plan.space import stage_layers
from plait.planner.plan.step import Job, Prediction

# Two predicted steps closer than this are a tie: the median |error| of `plait plan`'s
# calibrated predictions against published runs (`python bench/plan_fidelity.py`: 9%).
RANKING_ERROR = 0.09

PARTS = ("compute", "recompute", "exposed TP/CP/EP comm", "bubble, PP and the rest",
         "exposed DP comm", "DP contention", "optimizer and sync")


def breakdown(job: Job, p: Prediction) -> dict[str, float]:
    """`p`'s step in seconds by `PARTS` (they add up to `p.step_s`)."""
    lay = p.layout
    base = "plain" if lay.overlap == "coexec" else lay.overlap
    lt = job.layer(lay, base)
    n, m = stage_layers(job.model, lay), lay.micro_batches
    compute = m * (n * (lt.compute_fwd + lt.compute_bwd) + job.head_s(lay))
    recompute = m * n * job.recompute_s(lay, lt.fwd["plain"])
    layers = p.parts["exposed_comm"] - p.parts["dp_exposed"]
    rest = p.parts["pipeline"] - compute - recompute - layers
    return dict(zip(PARTS, (compute, recompute, layers, rest, p.parts["dp_exposed"],
                            p.parts["dp_contention"], p.parts["optimizer"] + p.parts["sync"]),
                    strict=True))


@dataclass(frozen=True)
class Comparison:
    """Plait's choice (`chosen`) and the user's layout (`given`), each with its parts."""

    job: Job
    chosen: Prediction
    given: Prediction

    def parts(self, p: Prediction) -> dict[str, float]:
        return breakdown(self.job, p)

    def headroom_gib(self, p: Prediction) -> float:
        """What one GPU's memory keeps beyond the layout's need (negative: short)."""
        return (self.job.memory_bytes - p.memory.total) / GiB

    @property
    def difference(self) -> float:
        """The given step over the chosen one, less one."""
        return self.given.step_s / self.chosen.step_s - 1

    @property
    def tie(self) -> bool:
        """Whether the two steps are within the model's error (`RANKING_ERROR`)."""
        return abs(self.difference) <= RANKING_ERROR

    @property
    def preferred(self) -> Prediction:
        """The faster beyond the model's error; within it, the one that keeps more memory
        (near the memory limit the allocator's fragmentation and the communication
        libraries' buffers make steps slower than any model of them says)."""
        if not self.tie:
            return min((self.chosen, self.given), key=lambda p: p.step_s)
        if not self.given.fits:
            return self.chosen
        return max((self.chosen, self.given), key=self.headroom_gib)
