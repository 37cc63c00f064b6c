"""`plait analyze`: measured exposed communication in a profiler trace, and what plait predicts
it would save, per device, per collective and per dependent pair.

The order: check the rank set (`analyze.ranks`), choose the window of steps
(`analyze.window`), tell each transfer's waiting for the last rank apart (every rank's same
calls in the window), then per device: exposure, collectives, communication rules, kernels,
idle time and (with a cluster) plait's schedule for each dependent pair."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from plait import tracing
from plait.analyze import window as win
from plait.analyze.breakdown import IdleRow, KernelRow, Straggler, idle_rows, kernel_rows, straggler
from plait.analyze.exposure import (
    CollectiveRow,
    DeviceExposure,
    RegionRow,
    RuleRow,
    align_ranks,
    collective_rows,
    device_exposure,
    region_rows,
    rule_rows,
)
from plait.analyze.findings import Finding, findings
from plait.analyze.grade import GradedCall, PlannedPair, grade
from plait.analyze.kineto import RankTrace, read_trace
from plait.analyze.ranks import rank_set
from plait.analyze.rules import user_rules
from plait.errors import SpecError

if TYPE_CHECKING:  # the planner (for the pairs' advice) is imported only when a cluster is given
    from plait.analyze.advice import Advice
    from plait.spec.hardware import ClusterSpec

@dataclass(frozen=True, slots=True)
class TraceAnalysis:
    trace: RankTrace  # its devices restricted to the window
    exposure: tuple[DeviceExposure, ...]
    collectives: tuple[CollectiveRow, ...]
    advice: tuple[Advice, ...]  # empty without a cluster
    regions: tuple[RegionRow, ...] = ()  # by record_function range, when asked for
    rules: tuple[RuleRow, ...] = ()
    kernels: tuple[KernelRow, ...] = ()
    idle: tuple[IdleRow, ...] = ()
    step_rows: tuple[win.StepRow, ...] = ()  # every step of the trace, in or out of the window
    left_out: int = 0  # events outside the window
    findings: tuple[Finding, ...] = ()  # what stopped overlap (analyze.findings)
    graded: tuple[GradedCall, ...] = ()  # plait's own calls against prediction and plan


@dataclass(frozen=True, slots=True)
class Analysis:
    traces: tuple[TraceAnalysis, ...]
    hardware: str | None  # the cluster plait's predictions are for (None: none made)
    window: win.Window = win.WHOLE
    notes: tuple[str, ...] = ()  # what the rank-set check skipped or found partial
    waiting_is_bound: bool = False  # a partial rank set: waiting is a lower bound
    straggler: Straggler | None = None


def analyze(traces: Sequence[str | Path | RankTrace], cluster: ClusterSpec | None,
            by: str | None = None, *, steps: str | None = None, drop_last: bool | None = None,
            drop_first: bool | None = None, plan: Sequence[PlannedPair] = (),
            comm_kernels: Sequence[str] = (), expect_copy_engines: bool = False) -> Analysis:
    """Every trace's exposure, collectives and (with a cluster) pairs; `traces` are paths or
    traces already read. Given several ranks' traces, each transfer's time waiting for the last
    rank is told apart from its transfer. `by`: also per record_function range whose name
    starts with it. `steps`, `drop_last`, `drop_first`: the window (`analyze.window`);
    `comm_kernels`: more kernel-name patterns that are communication (when reading paths);
    `plan`: the pairs plait's calls are graded against (`analyze.grade`);
    `expect_copy_engines`: the job asked NCCL for copy-engine collectives (`analyze.findings`)."""
    extra = user_rules(comm_kernels)
    ranks = rank_set([t if isinstance(t, RankTrace) else read_trace(t, extra) for t in traces])
    read = ranks.traces
    every_step = [tuple(r for d in t.devices for r in win.step_rows(d)) for t in read]
    window = win.choose(read, [r for rows in every_step for r in rows], steps, drop_last,
                        drop_first)
    kept = [tuple(win.restrict(d, window.steps) for d in t.devices) for t in read]
    aligned, unaligned = align_ranks(kept)
    notes = ranks.notes + ((f"waiting for other ranks unknown: {unaligned}",) if unaligned
                           else ()) + tuple(_unlaunched(t) for t in read if _unlaunched(t)) + tuple(
        f"{t.path}: {t.unreadable} event(s) skipped: their times are missing, not numbers, "
        "negative or beyond any clock" for t in read if t.unreadable) + tuple(
        f"{t.path}: {t.odd_shapes} operator(s) recorded shapes that are not lists of sizes "
        "(strings): their GEMM or message sizes are unknown" for t in read if t.odd_shapes)
    out = []
    for t, devices, rows in zip(read, aligned, every_step, strict=True):
        left = sum(win.left_out(d, window.steps) for d in t.devices)
        t = replace(t, devices=tuple(devices))
        exposure = tuple(device_exposure(d) for d in t.devices)
        both = list(zip(t.devices, exposure, strict=True))
        advice: tuple[Advice, ...] = ()
        if cluster is not None:
            from plait.analyze.advice import advise

            advice = tuple(a for d, e in both for a in advise(d, e.compute, cluster))
        regions = () if by is None else tuple(r for d, e in both for r in region_rows(d, e, by))
        chosen = set(window.steps) or {r.step for r in rows}  # empty: the whole trace
        out.append(TraceAnalysis(
            t, exposure, tuple(r for d, e in both for r in collective_rows(d, e)), advice,
            regions, tuple(r for d, e in both for r in rule_rows(d, e)),
            tuple(r for d in t.devices for r in kernel_rows(d)),
            tuple(r for d in t.devices for r in idle_rows(d)),
            tuple(replace(r, in_window=r.step in chosen) for r in rows), left,
            tuple(findings(t.devices, exposure, _runs_plait(t), expect_copy_engines)),
            tuple(g for d, e in both for g in grade(d, e, cluster, plan))))
    lag = straggler([(a.trace.rank if a.trace.rank is not None else a.trace.path,
                      max(a.exposure, key=lambda e: e.comm_us)) for a in out if a.exposure],
                    ranks.waiting_is_bound)
    return Analysis(tuple(out), cluster.name if cluster else None, window, notes,
                    ranks.waiting_is_bound, lag)


def _runs_plait(t: RankTrace) -> bool:
    """The trace shows plait's own calls (its shape check, or its ranges)."""
    return any(c.plaits_own for d in t.devices for c in d.comms) or any(
        name.startswith(tracing.PREFIX) for d in t.devices for name, _, _ in d.regions)


def _unlaunched(t: RankTrace) -> str:
    """A note on the GPU events of `t` whose launching runtime event the trace misses (they
    started before the profiler's first runtime events), or "" when there are none."""
    gpus = [d for d in t.devices if d.device.startswith("gpu")]
    n = sum(c.launched is None for d in gpus for c in d.comms)
    n += sum(k.launched is None for d in gpus for k in (*d.compute, *d.memory))
    if not n:
        return ""
    return (f"{t.path}: {n} GPU event(s) without their launch in the trace (started before "
            "the profiler's first runtime events): each counted in the step its start lies "
            "in, so the first step may be inflated (an outlier first step is left out)")


def detect_hardware(trace: RankTrace) -> str | None:
    """The hardware preset for the trace's GPU, `cpu` for a CPU-only trace, None if unknown."""
    if trace.gpu_name is None:
        return "cpu" if all(d.device.startswith("cpu") for d in trace.devices) else None
    from plait.spec.hardware import preset_of_device

    return preset_of_device(trace.gpu_name)


def require_communication(a: Analysis, extra_rules: bool) -> None:
    """Refuse an analysis that found no communication, naming what was looked for and the
    kernels that took the most time (so the user can add a --comm-kernel rule)."""
    if any(d.comms for t in a.traces for d in t.trace.devices):
        return
    raise SpecError("trace", "no communication found (looked for: NCCL/RCCL, symmetric "
                    "memory, userbuffers and DeepEP/NVSHMEM kernels, peer memcopies, "
                    "gloo work" + (", --comm-kernel patterns" if extra_rules else "")
                    + "); the kernels taking the most time: " + _top_kernels(a),
                    "if one of them is communication, pass --comm-kernel REGEX "
                    "matching its name; else profile a distributed step, with the "
                    "collectives inside the profiled region")


def _top_kernels(result: Analysis, n: int = 5) -> str:
    rows = sorted((r for t in result.traces for r in t.kernels), key=lambda r: -r.time_us)
    return ", ".join(f"{r.kernel} ({r.time_us / 1e3:,.2f} ms)" for r in rows[:n]) or "none"
