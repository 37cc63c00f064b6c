"""`plait coexec run --pp P`: a pipelined training step on local ranks, four ways, measured
beside plait's prediction.

The model: `blocks` residual MLP blocks of plait's parallel linears (sequence-parallel over
the TP group, ranks / P of them), on a (pp, tp) mesh. 1F1B (PyTorch's `Schedule1F1B`) puts
blocks / P on each pipeline rank; DualPipeV (PyTorch's `ScheduleDualPipeV`) blocks / 2P on each
of its 2P stages, rank r holding stages r and 2P-1-r; once run as PyTorch runs it (each
OVERLAP_F_B a forward then a backward), once with plait's OVERLAP_F_B (`plait.pipelining`,
the strands free) and once with plait's OVERLAP_F_B from a plan (`plan=True`). Each is timed
by the one timer (`time_calls`: ranks start together, the slowest counts); the bytes autograd
saves for backward are metered on one step (`SavedBytes`).

The prediction is plait's pipeline simulation (`plait.sim.pipeline`) of each schedule's
action lists, from one chunk's measured forward and backward alone (no transfer cost), the
overlapped OVERLAP_F_B as long as the longer of its halves (a perfect overlap), a planned one
as its plan predicts (the ratio of the plan's time to the timed forward then backward); peak
activations are the simulation's most chunks held times one chunk's saved bytes.
"""

from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.errors import SpecError
from plait.runtime.timing import rank_mean, slowest, time_calls
from plait.sim.pipeline import Costs, dualpipe_v, one_f_one_b, simulate
from plait.tracing import every_thread, pipeline_action_range

KINDS = ("1F1B", "DualPipeV", "DualPipeV + plait", "DualPipeV + plait plan")


@dataclass(frozen=True)
class PipelineJob:
    pp: int = 2
    blocks: int = 8
    hidden: int = 256
    ffn: int = 1024
    tokens: int = 256  # a micro-batch's whole sequence
    micro_batches: int = 8
    schedule: str = "fine/sm/c2/g1/M"
    warmup: int = 2
    repeats: int = 5
    trace: str | None = None  # a folder: one step of each schedule profiled, a file per rank

    def check(self, world: int) -> None:
        """Refuse a layout the schedules cannot run, naming the field."""
        if world % self.pp:
            raise SpecError("ranks", f"{world} ranks do not split into pp={self.pp}",
                            f"use a multiple of {self.pp}")
        tp = world // self.pp
        for name, value, unit in (("layers", self.blocks, 2 * self.pp),
                                  ("seq_len", self.tokens, tp), ("ffn", self.ffn, tp)):
            if value % unit:
                raise SpecError(name, f"{value} does not split into {unit}",
                                f"use a multiple of {unit}")
        if self.micro_batches < 2 * self.pp:
            raise SpecError("micro_batches", f"{self.micro_batches} for DualPipeV over "
                            f"{self.pp} ranks", f"use at least {2 * self.pp}")


class SavedBytes:
    """The bytes autograd holds for backward (saved tensors), now and at the peak: each saved
    tensor counted from when the forward saves it until autograd frees it."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> _Saved:
            box = _Saved(t)
            n = t.untyped_storage().nbytes() if t.layout == torch.strided else 0
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(box, self._free, n)
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def _free(self, n: int) -> None:
        self.now -= n


class _Saved:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def record_actions(stage: Any) -> None:
    """A profiler range around each forward and backward of `stage`, named as PyTorch's
    runtime schedules name their actions (`PP:0F3`, `PP:0B3`): its `Schedule1F1B` records
    none, so its trace and picture would show no actions."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(pipeline_action_range(stage.stage_index, "F", mb)):
            return forward(mb, *args, **kwargs)

    def backward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(pipeline_action_range(stage.stage_index, "B", mb)):
            return backward(mb, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def rank_trace(folder: str | Path, kind: str, rank: int) -> Path:
    """Where rank `rank` writes its profiled step of schedule `kind`."""
    return Path(folder) / f"{slug(kind)}-rank{rank}.json"


def slug(kind: str) -> str:
    return kind.lower().replace(" + ", "-").replace(" ", "-")


class _Block(torch.nn.Module):
    """A residual around the one layer description's MLP (plait's sequence-parallel linears)."""

    def __init__(self, job: PipelineJob, group: Any) -> None:
        from plait.nn import SequenceParallelMLP

        super().__init__()
        self.mlp = SequenceParallelMLP(job.hidden, job.ffn, group, gated=False,
                                       schedule=job.schedule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x + self.mlp(x)
        return y


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = (out - target).square().mean()
    return loss


@dataclass
class _Rank:
    """This rank's place in the (pp, tp) mesh, its blocks and its micro-batches."""

    job: PipelineJob
    p: int  # pipeline rank
    tp_group: Any
    pp_group: Any
    rows: int  # this rank's sequence shard of a micro-batch
    x: torch.Tensor
    y: torch.Tensor
    overlaps: list[Any] = field(default_factory=list)  # what plait's OVERLAP_F_B ran

    @classmethod
    def of(cls, world: int, job: PipelineJob) -> _Rank:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (job.pp, world // job.pp), mesh_dim_names=("pp", "tp"))
        rows = job.tokens // mesh["tp"].size()
        return cls(job, mesh["pp"].get_local_rank(), mesh["tp"].get_group(),
                   mesh["pp"].get_group(), rows, torch.randn(job.micro_batches * rows,
                                                             job.hidden),
                   torch.randn(job.micro_batches * rows, job.hidden))

    def chunk(self, n: int) -> torch.nn.Module:
        return torch.nn.Sequential(*[_Block(self.job, self.tp_group) for _ in range(n)])

    def step(self, kind: str) -> Any:
        """One training step of schedule `kind` on this rank, as a callable."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from plait.pipelining import overlap_f_b

        job, p, pp, cpu = self.job, self.p, self.job.pp, torch.device("cpu")
        if kind == "1F1B":
            stage = PipelineStage(self.chunk(job.blocks // pp), p, pp, cpu, group=self.pp_group)
            record_actions(stage)
            sched = Schedule1F1B(stage, n_microbatches=job.micro_batches, loss_fn=_loss)
            if p == 0:
                return lambda: sched.step(self.x)
            if p == pp - 1:
                return lambda: sched.step(target=self.y)
            return sched.step
        stages: list[_PipelineStageBase] = [
            PipelineStage(self.chunk(job.blocks // (2 * pp)), s, 2 * pp, cpu,
                          group=self.pp_group) for s in (p, 2 * pp - 1 - p)]
        v = ScheduleDualPipeV(stages, n_microbatches=job.micro_batches, loss_fn=_loss)
        if kind.startswith("DualPipeV + plait"):  # timed as itself, beside PyTorch's order
            self.overlaps.append(overlap_f_b(v, plan=kind.endswith("plan"), measure=0))
        return (lambda: v.step(self.x, target=self.y)) if p == 0 else v.step


def pipeline_rank(rank: int, world: int, job: PipelineJob, report: Any = None
                  ) -> dict[str, Any]:
    """This rank's part of the runs of every schedule and of one chunk alone; the figures
    are every rank's slowest (times) or fullest (bytes)."""
    from plait.runtime.context import close_all

    torch.manual_seed(0)
    me = _Rank.of(world, job)
    out: dict[str, Any] = {}
    for n, kind in enumerate(KINDS):
        step = me.step(kind)
        out[kind] = _timed_steps(step, job)
        if kind.startswith("DualPipeV + plait"):
            out[kind] |= _overlap_figures(me.overlaps[-1], world)
        if job.trace is not None:
            _profile(step, rank_trace(job.trace, kind, rank))
        if report is not None and rank == 0:
            report(n)
    out["chunk"] = _chunk_alone(me)
    close_all()
    return out


def _timed_steps(step: Any, job: PipelineJob) -> dict[str, Any]:
    """The steps' times (after warm-up) and the bytes one step saves for backward."""
    for _ in range(job.warmup):
        step()
    meter = SavedBytes()
    with meter.hooks():
        step()
    times = time_calls(step, 0, job.repeats)
    return {"step_s": statistics.median(times), "all_s": times,
            "peak_saved_bytes": int(slowest(meter.peak))}


def _overlap_figures(overlap: Any, world: int) -> dict[str, Any]:
    """Every step this rank ran under plait's OVERLAP_F_B: overlapped, or why not; with a
    plan, every rank's plans by (forward stage, backward stage)."""
    records = overlap.records
    out: dict[str, Any] = {"overlap_f_b": {
        "actions": len(records), "overlapped": sum(r.overlapped for r in records),
        "planned": sum(r.planned for r in records),
        "deferred_weight_grads": sum(r.deferred for r in records),
        "fell_back": sorted({r.reason for r in records if not r.overlapped
                             and "timed its units" not in r.reason})}}
    if overlap.plan:
        mine = {f"{fs},{bs}": {"sequential_s": sp.sequential_s,
                               "predicted_s": sp.plan.predicted_s,
                               "blocks": len(sp.plan.blocks), "deferred": sorted(sp.deferred)}
                for (fs, bs), sp in overlap.plans.items()}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        out["plans"] = {k: v for d in every for k, v in sorted(d.items())}
    return out


def _profile(step: Any, path: Path) -> None:
    """One step profiled, every thread's ranges (the backward strand's too), to `path`."""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread()) as prof:
        step()
    prof.export_chrome_trace(str(path))


def _chunk_alone(me: _Rank) -> dict[str, Any]:
    """One DualPipeV chunk alone: its forward, its backward, what it saves. Each rank on its
    own (a pipeline rank computes at its own pace), then their mean: the cost the simulation
    charges every rank."""
    job = me.job
    m = me.chunk(job.blocks // (2 * job.pp))
    xi = torch.randn(me.rows, job.hidden, requires_grad=True)
    meter = SavedBytes()
    with meter.hooks():
        m(xi).square().mean().backward()
    holder: list[torch.Tensor] = []

    def forward() -> None:
        holder[:] = [m(xi).square().mean()]

    def both() -> None:
        m(xi).square().mean().backward()

    fwd = rank_mean(statistics.median(time_calls(forward, job.warmup, job.repeats, ranks=False)))
    fb = rank_mean(statistics.median(time_calls(both, job.warmup, job.repeats, ranks=False)))
    return {"forward_s": fwd, "backward_s": max(0.0, fb - fwd),
            "saved_bytes": int(slowest(meter.peak))}


def predict(job: PipelineJob, measured: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per schedule: the simulated step and peak activations (module docstring), from what
    `pipeline_rank` measured: one chunk's forward, backward and saved bytes, and the plans
    plait's planned OVERLAP_F_B made ("fs,bs" -> sequential and predicted seconds of its
    action): a planned OVERLAP_F_B takes the forward and backward times its plan's predicted
    ratio; without a plan, the perfect overlap."""
    chunk = measured["chunk"]
    f, b = float(chunk["forward_s"]), float(chunk["backward_s"])
    saved = int(chunk["saved_bytes"])
    plans: dict[str, dict[str, float]] = measured.get(KINDS[-1], {}).get("plans", {})
    half = Costs(lambda s: 2 * f, lambda s: 2 * b, lambda s: 0.0)  # 1F1B: a stage, 2 chunks
    chunks = Costs(lambda s: f, lambda s: b, lambda s: 0.0)
    overlapped = Costs(lambda s: f, lambda s: b, lambda s: 0.0, fb=lambda a, c: max(f, b))

    def planned(fs: int, bs: int) -> float:
        p = plans.get(f"{fs},{bs}")
        return max(f, b) if p is None else (f + b) * p["predicted_s"] / p["sequential_s"]

    dualpipe = dualpipe_v(job.pp, job.micro_batches)
    runs = {"1F1B": (simulate(one_f_one_b(job.pp, job.micro_batches), half), 2),
            "DualPipeV": (simulate(dualpipe, chunks), 1),
            "DualPipeV + plait": (simulate(dualpipe, overlapped), 1),
            "DualPipeV + plait plan": (simulate(dualpipe, Costs(
                lambda s: f, lambda s: b, lambda s: 0.0, fb=planned)), 1)}
    return {k: {"step_s": run.step_s, "peak_saved_bytes": per * max(run.peak_activations) * saved}
            for k, (run, per) in runs.items()}
