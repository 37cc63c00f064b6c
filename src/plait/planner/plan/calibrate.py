"""A measured step feeds back into `plait plan`: the one parameter that makes the prediction
of the measured layout equal the measurement.

The parameter is the part's sustained clock (`CostParams.clock_fraction`): every compute-bound
kernel (GEMM, attention) runs at it, so a slower measured step lowers it and a faster one
raises it up to the rated clock. It carries what the model lacks alongside the clock itself
(gaps between kernels, host overhead), so it is a fitted value, named as such where it is
reported; the ranking of other layouts under it follows from the model, not from the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.errors import InfeasibleError, SpecError
from plait.planner.plan.space import Layout, Overlap
from plait.planner.plan.step import Job, Prediction
from plait.spec.hardware import LOWEST_CLOCK

_TOLERANCE = 1e-3  # relative step-time error at which the fit stops
_ITERATIONS = 12


@dataclass(frozen=True)
class ClockFit:
    """The measured layout's prediction before and after the fit."""

    measured_tokens_per_s_per_gpu: float
    before: Prediction
    after: Prediction
    clock_fraction: float  # fitted
    preset_clock_fraction: float  # the cluster's before the fit

    @property
    def ratio(self) -> float:
        """Predicted over measured tokens/s/GPU, before the fit."""
        return self.before.tokens_per_s_per_gpu / self.measured_tokens_per_s_per_gpu


def at_clock(job: Job, clock_fraction: float) -> Job:
    """`job` on the same cluster at another sustained clock (layer times predicted anew),
    the cluster's name saying so."""
    params = job.cluster.params.model_copy(update={"clock_fraction": clock_fraction})
    name = f"{job.cluster.name}, clock {clock_fraction:.3f}"
    return Job(job.model, job.cluster.model_copy(update={"params": params, "name": name}),
               job.gpus, job.seq_len, job.global_batch, job.memory_bytes, job.dtype,
               job.kernels, job.attention)


def fit_clock(job: Job, layout: Layout, overlap: Overlap,
              measured_tokens_per_s_per_gpu: float) -> tuple[ClockFit, Job]:
    """The clock at which `layout` running `overlap` takes the measured step, and the job at
    that clock. Secant steps on log(step) against log(clock), bracketed in
    [`LOWEST_CLOCK`, 1]; raises `InfeasibleError` where even the rated clock predicts a
    slower step than measured."""
    if not 0 < measured_tokens_per_s_per_gpu < math.inf:
        raise SpecError("measured", f"{measured_tokens_per_s_per_gpu} tokens/s/GPU is not a "
                        "positive finite rate", "pass the run's tokens per second per GPU")
    target = job.global_batch * job.seq_len / job.gpus / measured_tokens_per_s_per_gpu
    preset = job.cluster.params.clock_fraction

    def step(clock: float) -> tuple[float, Prediction, Job]:
        j = job if clock == preset else at_clock(job, clock)
        p = j.predict(layout, (overlap,))
        return p.step_s, p, j

    before_s, before, _ = step(preset)
    lo, hi = LOWEST_CLOCK, 1.0
    best = (abs(math.log(before_s / target)), preset, before, job)
    x0, y0 = math.log(preset), math.log(before_s / target)
    x1 = math.log(min(hi, max(lo, preset * before_s / target)))  # compute-bound guess
    for _ in range(_ITERATIONS):
        s, p, j = step(math.exp(x1))
        y1 = math.log(s / target)
        if abs(y1) < best[0]:
            best = (abs(y1), math.exp(x1), p, j)
        if abs(y1) < _TOLERANCE:
            break
        if x1 >= math.log(hi) and y1 > 0:  # compared in logs: exp(log(x)) need not be x
            raise InfeasibleError(
                f"the measured {measured_tokens_per_s_per_gpu:,.0f} tokens/s/GPU is faster "
                f"than plait predicts for {layout.label()} at the part's rated clock "
                f"({p.tokens_per_s_per_gpu:,.0f}). Fix: check the layout, dtype, kernels and "
                "attention match the run; no fit raises the clock above its rating")
        if x1 <= math.log(lo) and y1 < 0:
            raise InfeasibleError(
                f"the measured {measured_tokens_per_s_per_gpu:,.0f} tokens/s/GPU is slower "
                f"than plait predicts for {layout.label()} even at {lo:.0%} of the clock "
                f"({p.tokens_per_s_per_gpu:,.0f}): the step is not compute-bound in the model. "
                "Fix: check the layout, dtype, kernels and attention match the run")
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else -1.0
        x0, y0 = x1, y1
        x1 = min(0.0, max(math.log(lo), x1 - y1 / (slope if slope < 0 else -1.0)))
    miss, clock, after, fitted = best
    if miss >= _TOLERANCE:
        raise InfeasibleError(
            f"no clock makes {layout.label()} take the measured step: the closest, "
            f"{clock:.3f} of the rated one, predicts {after.tokens_per_s_per_gpu:,.0f} "
            f"tokens/s/GPU against the measured {measured_tokens_per_s_per_gpu:,.0f} "
            f"({math.exp(miss) - 1:.1%} off) after {_ITERATIONS} steps. Fix: check the layout, "
            "dtype, kernels and attention match the run")
    return ClockFit(measured_tokens_per_s_per_gpu, before, after, clock, preset), fitted
