"""Did the plan deliver what it predicted? plait's calls in a trace, graded.

The runtime wraps every call of a plait op in a `plait:call` range that names the op, the
schedule and engine that ran and the call's GEMM (`tracing.Call`). For each distinct call on
a device: how often it ran, its measured time per call and per step, the part of its
transfers no compute covered (exposed), the prediction for the schedule that ran on the
hardware given (`-H`, `--calibration`), and the plain collective + GEMM (`seq/sm`): measured,
when the trace holds plain calls of the same shape, else predicted. Where the trace allows,
the losses measured: decomposition (the GEMM pieces at their speed alone, against the whole
GEMM of a plain call of the same shape) and contention (pieces beside a transfer against
pieces alone). With a plan (`--plan`, an
`explore --json` file) each call is matched to its planned pair by kind and per-rank GEMM
shape, and the schedule planned is shown beside the one that ran.

A verdict per call: `ambiguous plan`, `not as planned` (another schedule ran), else
`plait.schedule.verdict`'s, the vocabulary `schedule="auto"` shares: `slower than plain`,
`as predicted`, `exposed more than predicted`, or how far from the prediction it ran.

Several planned pairs can share one GEMM shape (a forward pair and another's data gradient):
a call of a backward (`.bwd`) is matched to the plan's data-gradient pairs first, a forward
call to its forward pairs, and a call still matching several names them all.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plait import tracing
from plait.analyze.exposure import DeviceExposure
from plait.analyze.kineto import DeviceTrace, Kernel
from plait.errors import SpecError
from plait.intervals import clip, length, uncovered
from plait.schedule.verdict import PLAIN, TOLERANCE, Measured, verdict
from plait.workload.operators import PairKind, Role, role_of

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec

KIND_OF = {"all_gather_matmul": PairKind.AG, "matmul_reduce_scatter": PairKind.RS,
           "all_to_all_matmul": PairKind.A2A, "matmul_all_to_all": PairKind.MM_A2A}


@dataclass(frozen=True, slots=True)
class PlannedPair:
    name: str
    schedule: str
    kind: PairKind
    m: int
    n: int
    k: int
    ranks: int


def read_plan(path: Path) -> tuple[PlannedPair, ...]:
    """The pairs of a plan file written by `plait explore --json` (each pair's chosen
    schedule) or by `plait tune --json` (each pair's measured choice)."""
    from plait.spec.io import read_mapping

    doc = read_mapping(path, "plan")
    kinds = {"all_gather": ("in", PairKind.AG), "reduce_scatter": ("out", PairKind.RS)}
    out = []
    try:
        for p in doc["pairs"]:
            if "kind" in p:  # plait tune's plan
                kind, schedule = PairKind(str(p["kind"])), str(p["choice"])
            else:
                coll, direction = str(p["collective"]), str(p["direction"])
                kind = (PairKind.A2A if direction == "in" else PairKind.MM_A2A) \
                    if coll == "all_to_all" else kinds[coll][1]
                schedule = str(p["chosen"]["schedule"])
            g = p["gemm"]
            out.append(PlannedPair(str(p["name"]), schedule, kind,
                                   int(g["m"]) * int(g.get("count", 1)), int(g["n"]),
                                   int(g["k"]), int(p["ranks"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError("plan", f"{path} is not a plan written by `plait explore --json` or "
                        f"`plait tune --json` ({type(exc).__name__}: {exc})",
                        "pass the file `plait explore --json FILE` (or tune) wrote") from exc
    return tuple(out)


@dataclass(frozen=True, slots=True)
class GradedCall:
    device: str
    call: tracing.Call  # what ran
    pair: str | None  # the plan's pair it matches (None: no plan, or no match)
    planned: str | None  # the schedule the plan chose for it
    calls: int
    time_us: float  # measured, per call (median)
    per_step_us: float | None  # measured, all its calls per step (None: no steps)
    exposed_us: float  # measured, per call (median)
    predicted_us: float | None  # the schedule that ran, on the hardware given
    predicted_exposed_us: float | None
    plain_us: float | None  # the plain collective + GEMM, per call
    plain_measured: bool  # plain_us measured in this trace (else predicted)
    verdict: str
    why: str  # the verdict's figures, in words
    # measured losses, where the trace allows (None: it does not): the GEMM pieces at their
    # speed alone against the whole GEMM of a plain call of the same shape (decomposition),
    # and the pieces beside a transfer against the pieces alone (contention)
    decomposition_loss: float | None = None
    contention_loss: float | None = None


def _plan_match(c: tracing.Call, plan: Sequence[PlannedPair]) -> PlannedPair | None:
    """The planned pair call `c` runs (see the module docstring); None when none matches."""
    kind = KIND_OF.get(c.op)
    same = [p for p in plan if p.kind is kind and (p.m, p.n, p.k, p.ranks) == (
        c.m, c.n, c.k, c.ranks)]
    role = Role.DATA_GRAD if c.label.endswith(".bwd") else Role.FORWARD
    mine = [p for p in same if role_of(p.name) is role] or same
    if not mine:
        return None
    schedules = {p.schedule for p in mine}
    return PlannedPair("/".join(p.name for p in mine),
                       schedules.pop() if len(schedules) == 1 else "?", kind or PairKind.AG,
                       c.m, c.n, c.k, c.ranks)


def _predict(c: tracing.Call, schedule: str, cluster: ClusterSpec
             ) -> tuple[float, float] | None:
    """Predicted (time, exposed) in µs of call `c` under `schedule`, None when the model has
    no such pair."""
    from plait.errors import InfeasibleError
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import simulate_pair
    from plait.workload.operators import Axis, OverlapPair

    kind = KIND_OF.get(c.op)
    if kind is None or c.ranks < 2:
        return None
    s = Schedule.parse(schedule)
    try:
        pair = OverlapPair.build(kind, c.m, c.n, c.k, c.ranks, dtype=c.dtype,
                                 axis=s.axis if kind is PairKind.AG else Axis.M)
        run = simulate_pair(pair, s, cluster)
    except (InfeasibleError, ValueError, KeyError, SpecError):
        return None
    return run.time_s * 1e6, run.exposed_comm_s * 1e6


def grade(d: DeviceTrace, e: DeviceExposure, cluster: ClusterSpec | None,
          plan: Sequence[PlannedPair] = (), tolerance: float = TOLERANCE) -> list[GradedCall]:
    """Every distinct plait call on device `d` (whose exposure is `e`), graded."""
    spans: dict[tracing.Call, list[tuple[float, float]]] = {}
    for name, start, end in d.regions:
        c = tracing.parse_call(name)
        if c is not None:
            spans.setdefault(c, []).append((start, end))
    starts = [k.start for k in d.compute]  # in start order
    plain_measured = {(c.op, c.m, c.n, c.k, c.ranks): statistics.median(b - a for a, b in s)
                      for c, s in spans.items() if c.schedule == PLAIN}
    whole = {(c.op, c.m, c.n, c.k, c.ranks): statistics.median(
        sum(k.duration for k in _pieces(d, starts, a, b)) for a, b in s)
        for c, s in spans.items() if c.schedule == PLAIN}
    out = []
    for c, s in spans.items():
        times = [b - a for a, b in s]
        exposed = [length(uncovered(clip(e.comm.spans, e.comm.starts, a, b),
                                    clip(e.compute.spans, e.compute.starts, a, b)))
                   for a, b in s]
        planned = _plan_match(c, plan)
        pred = None if cluster is None else _predict(c, c.schedule, cluster)
        plain_pred = None if cluster is None else _predict(c, PLAIN, cluster)
        measured_plain = plain_measured.get((c.op, c.m, c.n, c.k, c.ranks))
        plain = measured_plain if measured_plain is not None else (
            None if plain_pred is None else plain_pred[0])
        t, x = statistics.median(times), statistics.median(exposed)
        verdict, why = _verdict(c, t, x, pred, plain, measured_plain is not None,
                                planned.schedule if planned else None, tolerance)
        decomposition, contention = (None, None) if c.schedule == PLAIN else _losses(
            d, e, s, whole.get((c.op, c.m, c.n, c.k, c.ranks)), starts)
        out.append(GradedCall(d.device, c, planned.name if planned else None,
                              planned.schedule if planned else None, len(s), t,
                              sum(times) / e.steps if e.steps else None, x,
                              None if pred is None else pred[0],
                              None if pred is None else pred[1], plain,
                              measured_plain is not None, verdict, why, decomposition,
                              contention))
    return sorted(out, key=lambda g: -g.time_us * g.calls)


BESIDE = 0.5  # a GEMM piece at least half covered by a transfer ran beside it


# A GEMM kernel (GPU) or matmul operator (CPU); not the wrappers that contain one.
_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$|gemm|xmma|cutlass",
                   re.IGNORECASE)


def _pieces(d: DeviceTrace, starts: Sequence[float], start: float, end: float
            ) -> list[Kernel]:
    """The GEMM kernels of one call: the matmuls inside its range (`starts`: the device's
    compute start times, in order)."""
    lo, hi = bisect_left(starts, start), bisect_left(starts, end)
    return [k for k in d.compute[lo:hi] if k.end <= end and _GEMM.search(k.name)]


def _losses(d: DeviceTrace, e: DeviceExposure, spans: Sequence[tuple[float, float]],
            whole_us: float | None, starts: Sequence[float]
            ) -> tuple[float | None, float | None]:
    """(decomposition loss, contention loss) of a decomposed call's GEMM pieces, measured.

    Contention: for each kind of piece (kernel name) seen both alone and at least half beside
    a transfer, the median time beside over the median alone; their median, less one.
    Decomposition: a call's pieces summed at their speed alone (a piece beside a transfer
    divided by one plus the contention), over the whole GEMM of a plain call of the same
    shape, less one. None where the trace cannot say (no pieces alone and beside of one kind;
    no whole GEMM of the same shape)."""
    calls: list[list[tuple[str, float, bool]]] = []
    for a, b in spans:
        calls.append([(k.name, k.duration, k.duration > 0 and e.comm.of(k.start, k.end)
                       >= BESIDE * k.duration) for k in _pieces(d, starts, a, b)])
    alone: dict[str, list[float]] = {}
    beside: dict[str, list[float]] = {}
    for pieces in calls:
        for name, dur, near in pieces:
            (beside if near else alone).setdefault(name, []).append(dur)
    ratios = [statistics.median(beside[n]) / statistics.median(alone[n])
              for n in beside if n in alone and statistics.median(alone[n]) > 0]
    contention = statistics.median(ratios) - 1 if ratios else None
    sums = [sum(dur / (1 + contention) if near and contention is not None else dur
                for _, dur, near in pieces)
            for pieces in calls if pieces and (contention is not None or
                                               not any(near for _, _, near in pieces))]
    decomposition = (statistics.median(sums) / whole_us - 1) if sums and whole_us else None
    return decomposition, contention


def _verdict(c: tracing.Call, t: float, exposed: float, pred: tuple[float, float] | None,
             plain: float | None, plain_measured: bool, planned: str | None,
             tol: float) -> tuple[str, str]:
    if planned == "?":
        return "ambiguous plan", "pairs of this shape were planned differently"
    if planned is not None and planned != c.schedule:
        return "not as planned", f"the plan chose {planned}; {c.schedule} ran"
    return verdict(Measured(c.schedule, t, None if pred is None else pred[0], plain,
                            plain_measured, exposed, None if pred is None else pred[1]), tol)
