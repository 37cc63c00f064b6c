"""The whole pipelined step of `plait coexec plan --pp P`: 1F1B, interleaved 1F1B and
DualPipeV, each as PyTorch runs it by default and with plait's overlap, simulated action by
action (`sim.pipeline`) from the layer costs of the co-execution report.

Per stage chunk of n layers: forward n T_f, backward n T_b, of which the weight gradients
(the `*_wgrad` GEMMs' share of the backward) are the zero-bubble `W`; a DualPipeV `FB` step
(forward of one chunk beside the backward of its mirror, same n) is n T_pair. The two ways:
- `default`: the baseline's layers (Megatron-LM's own overlaps), and `FB` run as its forward
  then its backward, which is what PyTorch's DualPipeV does with no OVERLAP_F_B registered;
- `plait`: the FiCCO layers of "co-execution + FiCCO", and `FB` its steady co-executed pair.
Between stages on different ranks each micro-batch's activations (sequence-sharded with SP)
cross the link between the stages' GPUs, once forward and once backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.cost.comm import route
from plait.errors import SpecError
from plait.planner.coexec.variants import CoexecPrediction, Variant
from plait.sim.pipeline import (
    Costs,
    PipelineRun,
    PipelineSchedule,
    dualpipe_v,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)

PLAIT = "co-execution + FiCCO"  # the variant plait runs a pipeline stage with


@dataclass(frozen=True)
class PipelinedRow:
    schedule: str
    way: str  # "default" or "plait"
    run: PipelineRun | None  # None: this layout cannot run the schedule (see `note`)
    chunk_layers: int  # layers in one stage chunk
    note: str = ""

    @property
    def step_s(self) -> float | None:
        return None if self.run is None else self.run.step_s

    @property
    def peak_layers(self) -> int | None:
        """Activations held at the peak on the fullest rank, in layers of one micro-batch."""
        if self.run is None:
            return None
        return max(self.run.peak_activations) * self.chunk_layers


def _wgrad_share(r: CoexecPrediction) -> float:
    """The weight gradients' share of the baseline's layer backward."""
    _, bwd = r.exploration.phases(r.baseline)
    weight_grads = set(r.exploration.layer.weight_gradients)
    w = sum(sp.duration for sp in bwd.timeline.spans if sp.task.name in weight_grads)
    return min(1.0, w / bwd.time_s) if bwd.time_s > 0 else 0.0


def transfer_s(r: CoexecPrediction) -> float:
    """One micro-batch's activations from a stage to the next (on the next GPUs of the pipe:
    tp x cp ranks further)."""
    par = r.parallel
    nbytes = par.tokens * r.model.hidden * par.dtype_bytes / (par.tp if par.sp else 1)
    link = route(r.cluster, 1, par.tp * par.cp)
    return link.latency_s + nbytes / link.bytes_per_s


def _costs(r: CoexecPrediction, v: Variant, n: int, share: float, overlap: bool) -> Costs:
    f, b = n * v.layer_fwd_s, n * v.layer_bwd_s
    pair = None if not overlap or v.pair_s is None else n * v.pair_s

    def fb(_fwd: int, _bwd: int) -> float:
        assert pair is not None
        return pair

    return Costs(lambda _s: f, lambda _s: b, lambda _s: share * b, transfer_s(r),
                 fb if pair is not None else None)


def schedules(r: CoexecPrediction) -> list[tuple[str, PipelineSchedule | str]]:
    """The schedules for this layout: each, or why it cannot run here."""
    pp, k, v = r.parallel.pp, r.k, max(2, r.parallel.virtual_stages)
    out: list[tuple[str, PipelineSchedule | str]] = []
    makers: tuple[tuple[str, Callable[[], PipelineSchedule]], ...] = (
        ("1F1B", lambda: one_f_one_b(pp, k)),
        (f"interleaved 1F1B (v={v})", lambda: interleaved_1f1b(pp, v, k)),
        ("DualPipeV", lambda: dualpipe_v(pp, k)))
    for name, make in makers:
        try:
            s = make()
        except SpecError as exc:
            out.append((name, exc.problem + f" ({exc.fix})"))
            continue
        if r.model.layers % s.stages:
            out.append((name, f"{r.model.layers} layers do not split into {s.stages} "
                              "equal chunks"))
            continue
        out.append((name, s))
    return out


def pipelined_rows(r: CoexecPrediction) -> list[PipelinedRow]:
    share = _wgrad_share(r)
    rows = []
    for name, s in schedules(r):
        for way, variant in (("default", r.baseline), ("plait", PLAIT)):
            if isinstance(s, str):
                rows.append(PipelinedRow(name, way, None, 0, s))
                continue
            n = r.model.layers // s.stages
            costs = _costs(r, r.variant(variant), n, share, overlap=way == "plait")
            rows.append(PipelinedRow(name, way, simulate(s, costs), n))
    return rows
