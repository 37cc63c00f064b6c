"""`plait coexec run`: time a training step on local ranks: plainly, with FiCCO units,
co-executed, and co-executed with FiCCO units."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.errors import SpecError
from plait.measure.coexec.small_model import build_sharded
from plait.measure.coexec.trainer import StepResult, Trainer
from plait.runtime.context import close_all, runtime_of
from plait.runtime.timing import time_calls
from plait.schedule.coexec import CoexecPlan
from plait.schedule.schedule import Schedule
from plait.spec.dtypes import torch_dtype
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec

if TYPE_CHECKING:
    from plait.planner.coexec.variants import CoexecPrediction


RUN_DTYPES = ("fp32", "fp64")  # what the executed small models compute in
# Each run of `plait coexec run` and the predicted variant it is measured against.
PREDICTED = {"plain": "sequential", "ficco": "intra-batch overlap (FiCCO)",
             "coexec": "co-execution", "coexec+ficco": "co-execution + FiCCO"}


@dataclass(frozen=True)
class Run:
    """One way to run a step: a co-execution plan (None: none) and the FiCCO schedule of each
    fused pair (None: plain units)."""
    plan: CoexecPlan | None
    fused: dict[str, Schedule] | None

    def to_dict(self) -> dict[str, Any]:
        return {"plan": None if self.plan is None else self.plan.to_json(),
                "fused": None if self.fused is None else
                {n: str(s) for n, s in self.fused.items()}}


def small_model(name: str, ranks: int, layers: int, hidden: int, heads: int, kv_heads: int,
                ffn: int, vocab: int, seq_len: int, micro_batches: int, dtype: str,
                experts: int = 0, top_k: int = 2, regather: bool = True
                ) -> tuple[ModelSpec, ParallelSpec]:
    """The small model `coexec run` and `coexec profile` execute, validated for `ranks`: TP
    over them, or, with `experts`, MoE layers expert-parallel over them (TP 1, EP = DP = ranks:
    each rank its own data). The parallel spec carries fp32 for the cost model (which has no
    fp64 peaks); the run dtype travels apart."""
    from plait.spec.io import validate
    from plait.spec.layout import check_shardable

    if dtype not in RUN_DTYPES:
        raise SpecError("dtype", f"{dtype!r} cannot be run here", f"use {' or '.join(RUN_DTYPES)}")
    moe = dict(moe=dict(experts=experts, top_k=top_k, expert_ffn=ffn)) if experts else {}
    spec = validate(ModelSpec, dict(name=name, layers=layers, hidden=hidden, heads=heads,
                                    kv_heads=kv_heads, ffn=ffn, vocab=vocab, **moe), "model")
    layout = dict(tp=1, ep=ranks, dp=ranks) if experts else dict(tp=ranks)
    par = validate(ParallelSpec, dict(**layout, seq_len=seq_len,
                                      num_micro_batches=micro_batches, dtype="fp32",
                                      regather=regather), "parallel")
    check_shardable(spec, par)
    return spec, par


def measured_plan(prediction: CoexecPrediction, costs: Path, regather: bool) -> CoexecPlan:
    """The co-execution plan from a cost table `plait coexec profile` measured, instead of the
    simulator's; refused when the table was measured on the other layer."""
    from plait.schedule.coexec import MeasuredCosts, plan_dp, validate
    from plait.spec.io import read_mapping

    table = MeasuredCosts(read_mapping(costs, "costs"))
    measured = table.table.get("meta", {}).get("regather", True)
    if measured != regather:
        raise SpecError("costs", f"{costs} was measured on the layer that "
                        f"{'re-gathers' if measured else 'keeps'} its gathered inputs",
                        f"run with {'--regather' if measured else '--keep-gathered'}, "
                        "or profile this layer (plait coexec profile "
                        f"{'--regather' if regather else '--keep-gathered'})")
    c = prediction.costs
    plan = plan_dp(c.fwd, c.bwd, c.collective, table.solo, table.pair)
    validate(plan, c.fwd, c.bwd, c.collective)
    return plan


def runs_of(prediction: CoexecPrediction, plan: CoexecPlan | None = None) -> dict[str, Run]:
    """The four runs of `plait coexec run`: plain, FiCCO units under the explorer's schedules,
    co-executed by `plan` (default: the prediction's), and both."""
    chosen = {r.pair.name: r.chosen.schedule for r in prediction.exploration.pairs}
    return {"plain": Run(None, None), "ficco": Run(None, chosen),
            "coexec": Run(plan or prediction.plan, None),
            "coexec+ficco": Run(plan or prediction.plan_fused, chosen)}


@dataclass(frozen=True)
class CoexecRunResult:
    """What `plait coexec run` measured, next to the prediction of each run."""
    measured: dict[str, Any]  # run -> step_s, all_s, loss, peak_activation_bytes, filled_units
    predicted: dict[str, float]  # run -> predicted step seconds
    runs: dict[str, Run]
    plan: CoexecPlan
    costs: str  # "measured" or "simulated"

    @classmethod
    def of(cls, prediction: CoexecPrediction, runs: dict[str, Run], measured: dict[str, Any],
           costs: str) -> CoexecRunResult:
        predicted = {name: prediction.step(prediction.variant(v))
                     for name, v in PREDICTED.items()}
        plan = runs["coexec"].plan
        assert plan is not None
        return cls(measured, predicted, runs, plan, costs)

    def same_loss(self) -> bool:
        plain = self.measured["plain"]["loss"]
        return all(abs(plain - m["loss"]) <= 1e-5 * abs(plain) for m in self.measured.values())

    def to_dict(self) -> dict[str, Any]:
        return {"measured": self.measured, "predicted": self.predicted,
                "plan": self.plan.to_json(),
                "runs": {n: r.to_dict() for n, r in self.runs.items()}, "costs": self.costs}


def _step_into(out: list[StepResult], trainer: Trainer, plan: CoexecPlan | None) -> None:
    out.append(trainer.step(plan))


def coexec_rank(rank: int, world: int, spec: ModelSpec, par: ParallelSpec, runs: dict[str, Run],
                repeats: int, dtype_name: str = "fp32", report: Any = None) -> dict[str, Any]:
    """Warm-up, then `repeats` steps of each run, round-robin; slowest rank counts."""
    rt = runtime_of(None)
    comm = rt.collective()
    dtype = torch_dtype(dtype_name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, Any] = {}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name, run in runs.items():
            model = build_sharded(spec, par, rank, seed=0, dtype=dtype)
            trainer = Trainer(model, comm, par.num_micro_batches, fused=run.fused, rt=rt)
            steps: list[StepResult] = []
            (t,) = time_calls(functools.partial(_step_into, steps, trainer, run.plan), 0, 1)
            res = steps[0]
            if rep:
                times[name].append(t)
            out[name] = {"loss": res.loss, "peak_activation_bytes": res.peak_activation_bytes,
                         "filled_units": res.filled}
        if report is not None and rank == 0:
            report(rep)
    close_all()
    for name in times:
        out[name]["step_s"] = statistics.median(times[name])
        out[name]["all_s"] = times[name]
    return out


def block_costs_rank(rank: int, world: int, spec: ModelSpec, par: ParallelSpec,
                     repeats: int, dtype_name: str = "fp32", report: Any = None
                     ) -> dict[str, Any]:
    """Measured time of every forward and backward segment alone and of every legal
    (forward, backward) segment pair run as one block: the planner's cost table.

    One layer, one micro-batch per strand; the stores hold every tensor of a full forward and
    backward, so any segment can run again on them (weight gradients simply accumulate)."""
    from plait.measure.coexec.trainer import Memory, Strand, run_blocks
    from plait.measure.coexec.units import backward_units, forward_units
    from plait.schedule.coexec import CoexecBlock, segment_ends

    comm = runtime_of(None).collective()
    dtype = torch_dtype(dtype_name)
    model = build_sharded(spec.with_(layers=1), par, rank, seed=0, dtype=dtype)
    fu, bu = forward_units(model.layer, model.shape), backward_units(model.layer, model.shape)
    fnames, bnames = tuple(u.name for u in fu), tuple(u.name for u in bu)
    mem = Memory()
    g = torch.Generator().manual_seed(1)
    rows = par.tokens // world
    f_store = {"x": torch.randn(rows, spec.hidden, generator=g, dtype=torch.float64).to(dtype)}
    fwd = Strand(fu, f_store, model.layers[0], comm, mem)
    run_blocks((CoexecBlock(fnames, ()),), fwd, None)
    b_store = dict(f_store)
    b_store["d_out"] = torch.randn_like(f_store["out"])
    bwd = Strand(bu, b_store, model.layers[0], comm, mem)
    run_blocks((CoexecBlock((), bnames),), None, bwd)

    def segments(names: tuple[str, ...], units: tuple[Any, ...]) -> list[tuple[str, ...]]:
        coll = {u.name for u in units if u.collective}
        ends = segment_ends(names, coll.__contains__)
        return [tuple(names[i:k]) for i in range(len(names)) for k in ends[i]]

    fs, bs = segments(fnames, fu), segments(bnames, bu)
    coll = {u.name for u in (*fu, *bu) if u.collective}

    def timed(block: CoexecBlock) -> float:
        def call() -> None:
            run_blocks((block,), fwd if block.fwd else None, bwd if block.bwd else None)
        return statistics.median(time_calls(call, 1, repeats))

    solo = {f"F|{','.join(s)}": timed(CoexecBlock(s, ())) for s in fs}
    solo |= {f"B|{','.join(s)}": timed(CoexecBlock((), s)) for s in bs}
    if report is not None and rank == 0:
        report("solo")
    pair = {}
    for f in fs:
        for b in bs:
            if any(n in coll for n in f) and any(n in coll for n in b):
                continue
            pair[f"{','.join(f)}|{','.join(b)}"] = timed(CoexecBlock(f, b))
        if report is not None and rank == 0:
            report(f)
    close_all()
    return {"solo": solo, "pair": pair}
