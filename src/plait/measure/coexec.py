"""`plait coexec run`: time a training step on local ranks: plainly, with FiCCO units,
co-executed, and co-executed with FiCCO units."""

from __future__ import annotations

import functools
import json
import statistics
from typing import Any

import torch

from plait.coexec.small_model import build_sharded
from plait.coexec.trainer import StepResult, Trainer
from plait.measure.timing import time_calls
from plait.planner.coexec.plan import CoexecPlan
from plait.runtime.context import close_all, runtime_for
from plait.schedule.schedule import Schedule
from plait.spec.dtypes import torch_dtype
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec


def _step_into(out: list[StepResult], trainer: Trainer, plan: CoexecPlan | None) -> None:
    out.append(trainer.step(plan))


def coexec_rank(rank: int, world: int, spec: ModelSpec, par: ParallelSpec, runs_json: str,
                repeats: int, dtype_name: str = "fp32", report: Any = None) -> dict[str, Any]:
    """Warm-up, then `repeats` steps of each run, round-robin; slowest rank counts. `runs`:
    name -> {"plan": a `CoexecPlan`'s JSON or None (no co-execution), "fused": pair name -> FiCCO
    schedule or None (plain units)}."""
    rt = runtime_for(None)
    comm = rt.collective()
    runs = {name: (None if r["plan"] is None else CoexecPlan.from_json(r["plan"]),
                   None if r["fused"] is None else
                   {n: Schedule.parse(x) for n, x in r["fused"].items()})
            for name, r in json.loads(runs_json).items()}
    dtype = torch_dtype(dtype_name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, Any] = {}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name, (plan, fused) in runs.items():
            model = build_sharded(spec, par, rank, seed=0, dtype=dtype)
            trainer = Trainer(model, comm, par.num_micro_batches, fused=fused, rt=rt)
            steps: list[StepResult] = []
            (t,) = time_calls(functools.partial(_step_into, steps, trainer, plan), 0, 1)
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
    from plait.coexec.trainer import Memory, Strand, run_blocks
    from plait.coexec.units import backward_units, forward_units
    from plait.planner.coexec.plan import CoexecBlock, segment_ends

    comm = runtime_for(None).collective()
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
