"""`plait analyze`: measured exposed communication in a profiler trace, and what plait predicts
it would save, per device, per collective and per dependent pair."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from plait.analyze.advice import Advice, advise
from plait.analyze.exposure import (
    CollectiveRow,
    DeviceExposure,
    RegionRow,
    align_ranks,
    collective_rows,
    device_exposure,
    region_rows,
)
from plait.analyze.kineto import RankTrace, read_trace
from plait.spec.hardware import HARDWARE_PRESETS, ClusterSpec

# substrings of a device name (deviceProperties) -> hardware preset, first match wins
_GPU_PRESETS = (("h200", "h200"), ("h100", "h100"), ("h800", "h100"), ("a800", "a800"),
                ("a100", "a100"), ("a40", "a40"), ("mi300", "mi300x"))


@dataclass(frozen=True, slots=True)
class TraceAnalysis:
    trace: RankTrace
    exposure: tuple[DeviceExposure, ...]
    collectives: tuple[CollectiveRow, ...]
    advice: tuple[Advice, ...]  # empty without a cluster
    regions: tuple[RegionRow, ...] = ()  # by record_function range, when asked for


@dataclass(frozen=True, slots=True)
class Analysis:
    traces: tuple[TraceAnalysis, ...]
    hardware: str | None  # the cluster plait's predictions are for (None: none made)


def analyze(traces: Sequence[str | Path | RankTrace], cluster: ClusterSpec | None,
            by: str | None = None) -> Analysis:
    """Every trace's exposure, collectives and (with a cluster) pairs; `traces` are paths or
    traces already read. Given several ranks' traces, each transfer's time waiting for the last
    rank is told apart from its transfer. `by`: also per record_function range whose name
    starts with it."""
    read = [t if isinstance(t, RankTrace) else read_trace(t) for t in traces]
    aligned = align_ranks([t.devices for t in read])
    out = []
    for t, devices in zip(read, aligned, strict=True):
        t = replace(t, devices=tuple(devices))
        exposure = tuple(device_exposure(d) for d in t.devices)
        both = list(zip(t.devices, exposure, strict=True))
        advice = tuple(a for d, e in both for a in advise(d, e.compute, cluster)) \
            if cluster else ()
        regions = () if by is None else tuple(r for d, e in both for r in region_rows(d, e, by))
        out.append(TraceAnalysis(t, exposure, tuple(r for d, e in both
                                                    for r in collective_rows(d, e)),
                                 advice, regions))
    return Analysis(tuple(out), cluster.name if cluster else None)


def detect_hardware(trace: RankTrace) -> str | None:
    """The hardware preset for the trace's GPU, `cpu` for a CPU-only trace, None if unknown."""
    if trace.gpu_name is None:
        return "cpu" if all(d.device.startswith("cpu") for d in trace.devices) else None
    low = trace.gpu_name.lower().replace("-", "")
    name = next((preset for key, preset in _GPU_PRESETS if key in low), None)
    return name if name in HARDWARE_PRESETS else None
