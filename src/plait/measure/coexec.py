"""`plait coexec run`: time a training step plainly and co-executed on local ranks."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from plait.coexec.execute import Trainer
from plait.coexec.model import build_sharded
from plait.coexec.plan import Plan
from plait.measure.timing import slowest
from plait.runtime.context import close_all, runtime_for
from plait.spec.model import ModelSpec
from plait.spec.parallel import ParallelSpec

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def coexec_rank(rank: int, world: int, spec: ModelSpec, par: ParallelSpec, plan_json: str,
                repeats: int, report: Any = None) -> dict[str, Any]:
    """Warm-up, then `repeats` steps of each schedule, alternating; slowest rank counts."""
    comm = runtime_for(None).collective()
    plan = Plan.from_json(plan_json)
    dtype = DTYPES.get(par.dtype, torch.float32)
    times: dict[str, list[float]] = {"plain": [], "coexec": []}
    out: dict[str, Any] = {}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name, p in (("plain", None), ("coexec", plan)):
            model = build_sharded(spec, par, rank, seed=0, dtype=dtype)
            trainer = Trainer(model, comm, par.num_micro_batches)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            res = trainer.step(p)
            t = slowest(time.perf_counter() - t0)
            if rep:
                times[name].append(t)
            out[name] = {"loss": res.loss, "peak_activation_bytes": res.peak_activation_bytes}
        if report is not None and rank == 0:
            report(rep)
    close_all()
    for name in times:
        out[name]["step_s"] = statistics.median(times[name])
        out[name]["all_s"] = times[name]
    return out
