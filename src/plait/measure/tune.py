"""`plait tune`: every pair of a model's layer tuned on the real group before training.

Each pair of the layer (forward, data and weight gradients, at the model's per-rank shapes)
is called through plait's op with `schedule="auto"` until the group has decided it
(`plait.tuning`: the simulator's candidates measured, the baseline kept when overlap does
not pay). The decisions fill the tuning cache, so a training job with `schedule="auto"` on
this machine starts tuned; the plan written (`--json`) is one `plan=` takes, every pair with
each candidate's predicted and measured time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import __version__, ops, tuning
from plait.errors import SpecError
from plait.measure.bench import BENCH_DTYPES, check_memory
from plait.runtime.context import close_all, runtime_of
from plait.runtime.launch import rank_device
from plait.spec.dtypes import torch_dtype
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec
from plait.tuning.decide import Decision, error_summary
from plait.workload.operators import Axis, OverlapPair, PairKind
from plait.workload.transformer import build_layer


@dataclass(frozen=True)
class TuneSpec:
    model: ModelSpec
    parallel: ParallelSpec
    world: int
    hardware: str | None = None  # what the simulator proposes for (None: the device's)
    calibration: str | None = None
    candidates: int = tuning.Settings.candidates
    warmup: int = tuning.Settings.warmup
    calls: int = tuning.Settings.calls
    cache: str | bool = True  # a file, True: the default one, False: none

    def pairs(self) -> tuple[OverlapPair, ...]:
        return build_layer(self.model, self.parallel).pairs


def tune_spec(model: ModelSpec, parallel: ParallelSpec, world: int, **settings: Any
              ) -> TuneSpec:
    """The run, checked before a rank starts: the group is the pairs' group, the dtype one
    the ranks compute in, the operands fit in memory, the settings valid."""
    spec = TuneSpec(model, parallel, world, **settings)
    tuning.configure(hardware=spec.hardware, calibration=spec.calibration,
                     candidates=spec.candidates, warmup=spec.warmup, calls=spec.calls,
                     cache=False)  # a bad setting fails here, in one line, before any rank
    pairs = spec.pairs()
    if not pairs:
        raise SpecError("tp", f"a layer of {model.name} at tp={parallel.tp}, ep={parallel.ep} "
                        "has no dependent pair to tune", "use --tp 2 or more (or --ep)")
    sizes = sorted({p.ranks for p in pairs})
    if sizes != [world]:
        raise SpecError("ranks", f"the layer's pairs run on groups of {sizes} ranks, but "
                        f"{world} ranks were started",
                        f"start {sizes[0]} ranks (--ranks, or torchrun --nproc-per-node)"
                        if len(sizes) == 1 else "tune a layout whose pairs share one group")
    if parallel.dtype not in BENCH_DTYPES:
        raise SpecError("dtype", f"{parallel.dtype} is not one the ranks compute in",
                        f"use one of {', '.join(BENCH_DTYPES)}")
    for p in pairs:
        g = p.gemm
        check_memory(p.kind.value, g.m * g.count, g.n, g.k, world, g.count, parallel.dtype)
    return spec


def tune_rank(rank: int, world: int, spec: TuneSpec,
              report: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Body run on every rank: each pair called with "auto" until the group decided it;
    returns this rank's decisions by pair and what tuning cost."""
    tuning.configure(hardware=spec.hardware, calibration=spec.calibration,
                     candidates=spec.candidates, warmup=spec.warmup, calls=spec.calls,
                     cache=spec.cache)
    torch.manual_seed(1234 + rank)
    tuner = tuning.tuner()
    decided: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for pair in spec.pairs():
            call = _call(pair, world, torch_dtype(spec.parallel.dtype), rank_device())
            calls, decision = 0, None
            while decision is None:  # the group decides at the same call on every rank
                call()
                calls += 1
                decision = tuner.last
            decided[pair.name] = {"decision": decision.to_dict(), "calls": calls}
            if report is not None and rank == 0:
                report(pair.name)
    close_all()
    return {"pairs": decided, "measurement_calls": tuner.measurement_calls,
            "warnings": list(tuner.warnings), "hardware": tuner.cluster().name}


def tune_under_torchrun(spec: TuneSpec) -> dict[str, Any] | None:
    """`tune_rank` on torchrun's ranks; rank 0's result, None on the others."""
    from plait.runtime.launch import init_from_env, leave_group

    init_from_env()
    rank = dist.get_rank()
    out = tune_rank(rank, dist.get_world_size(), spec)
    leave_group()
    return out if rank == 0 else None


def _call(pair: OverlapPair, world: int, dtype: torch.dtype, device: torch.device
          ) -> Callable[[], object]:
    """One call of `pair` through plait's op at its per-rank shapes, with "auto"."""
    g = pair.gemm
    rows = g.m * g.count  # the GEMM's rows over its local experts

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    kind, group = pair.kind, runtime_of(None)
    if kind is PairKind.AG and pair.axis is Axis.K:  # A^T (rows: n) gathered along k
        a, w = rand(g.n, g.k // world), rand(g.k, g.m)
        return lambda: ops.all_gather_matmul(a, [w], group, gather_dim=-1, schedule="auto")
    if kind is PairKind.AG:
        a, w = rand(rows // world, g.k), rand(g.k, g.n)
        return lambda: ops.all_gather_matmul(a, [w], group, schedule="auto")
    if kind is PairKind.RS:
        a, w = rand(rows, g.k), rand(g.k, g.n)
        return lambda: ops.matmul_reduce_scatter(a, w, group, schedule="auto")
    w = rand(g.count, g.k, g.n) if g.count > 1 else rand(g.k, g.n)
    x = rand(rows, g.k)
    if kind is PairKind.A2A:
        return lambda: ops.all_to_all_matmul(x, w, group, schedule="auto")
    return lambda: ops.matmul_all_to_all(x, w, group, schedule="auto")


@dataclass(frozen=True)
class TunedPair:
    name: str
    pair: OverlapPair
    decision: Decision
    calls: int  # calls of the pair until decided


@dataclass(frozen=True)
class TuneResult:
    spec: TuneSpec
    pairs: tuple[TunedPair, ...]
    measurement_calls: int
    warnings: tuple[str, ...]
    hardware: str

    @property
    def plan(self) -> dict[str, str]:
        return {p.name: p.decision.choice for p in self.pairs}

    def prediction(self) -> dict[str, float | int | None]:
        return error_summary([p.decision for p in self.pairs])

    def to_dict(self) -> dict[str, Any]:
        """The plan file (`plan=` and `plait.nn.load_plan` read it; `plait explore --json`'s
        shape) with every pair's candidates, predicted and measured, and the choice."""
        pairs = []
        for p in self.pairs:
            g = p.pair.gemm
            pairs.append({"name": p.name, "kind": p.pair.kind.value, "axis": p.pair.axis.value,
                          "ranks": p.pair.ranks, "gemm": {"m": g.m, "n": g.n, "k": g.k,
                                                          "count": g.count},
                          "calls": p.calls, "speedup": p.decision.speedup,
                          **p.decision.to_dict()})
        return {"plait_version": __version__, "made_by": "plait tune",
                "model": self.spec.model.model_dump(),
                "parallel": self.spec.parallel.model_dump(), "hardware": self.hardware,
                "plan": self.plan, "pairs": pairs, "prediction": self.prediction(),
                "measurement_calls": self.measurement_calls, "warnings": list(self.warnings)}


def tune_result(spec: TuneSpec, measured: dict[str, Any]) -> TuneResult:
    by_name = {p.name: p for p in spec.pairs()}
    pairs = tuple(TunedPair(name, by_name[name], Decision.from_dict(v["decision"]),
                            int(v["calls"])) for name, v in measured["pairs"].items())
    return TuneResult(spec, pairs, int(measured["measurement_calls"]),
                      tuple(measured["warnings"]), str(measured["hardware"]))


def cache_option(text: str | None) -> str | bool:
    """--cache: a file, "off" for none; unset: the default file."""
    if text is None:
        return True
    return False if text.strip().lower() == "off" else str(Path(text).expanduser())
