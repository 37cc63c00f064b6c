"""A measured pipelined step for people: every rank's profiled step in one Chrome trace (one
process per rank, one track per thread: the backward strand's has its own), and the step as
a timeline of its pipeline actions for a Gantt (one row per rank and strand).

The actions are the ranges PyTorch's schedules record (`PP:0F1`, `PP:(0F2;3B0)OVERLAP_F_B`
for the runtime schedules, `Forward 3` / `Backward 3` for 1F1B) and the ranges of
`plait.pipelining`'s two strands (`plait:F0.2`, `plait:B3.0`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.sim.engine import Span, Task, Timeline
from plait.tracing import pipeline_action


def _events(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def read(files: dict[int, Path]) -> dict[int, list[dict[str, Any]]]:
    """Rank -> the events of its trace file (read once for both `merge` and `timeline`)."""
    return {rank: _events(path) for rank, path in files.items()}


def merge(traces: dict[int, list[dict[str, Any]]], title: str) -> dict[str, Any]:
    """Rank -> its trace's events, as one trace: each rank a process named after it."""
    out: list[dict[str, Any]] = []
    for rank, events in sorted(traces.items()):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} ({title})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        for e in events:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue
            out.append({**e, "pid": rank})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def timeline(traces: dict[int, list[dict[str, Any]]]) -> Timeline:
    """The ranks' pipeline actions (their recorded ranges), from the earliest one."""
    found: list[tuple[int, str, float, float]] = []
    for rank, events in sorted(traces.items()):
        for e in events:
            name = str(e.get("name", ""))
            if e.get("ph") == "X" and pipeline_action(name) is not None:
                found.append((rank, name, float(e["ts"]), float(e.get("dur", 0.0))))
    if not found:
        return Timeline((), ())
    t0 = min(ts for _, _, ts, _ in found)
    streams: dict[str, None] = {}
    spans = []
    for n, (rank, name, ts, dur) in enumerate(sorted(found, key=lambda f: (f[0], f[2]))):
        action = pipeline_action(name)
        assert action is not None
        category, strand = action
        stream = f"rank {rank} {strand} strand" if strand else f"rank {rank}"
        streams.setdefault(stream, None)
        label = name.removeprefix("PP:").removeprefix("plait:")
        task = Task(f"{rank}:{n}:{name}", stream, dur * 1e-6, category, label=label)
        start = (ts - t0) * 1e-6
        spans.append(Span(task, start, start + dur * 1e-6))
    return Timeline(tuple(spans), tuple(streams))


def write_step_traces(console: Any, folder: Path, ranks: int, title: str) -> None:
    """Per pipeline schedule, the ranks' traces of its profiled step merged into one (a process
    per rank), and every schedule's actions per rank and strand in one PNG."""
    from plait.measure.pipeline import KINDS, rank_trace, slug
    from plait.report.gantt import plot_gantt

    steps = {}
    for kind in KINDS:
        traces = read({r: rank_trace(folder, kind, r) for r in range(ranks)})
        merged = folder / f"{slug(kind)}.json"
        merged.write_text(json.dumps(merge(traces, kind)))
        console.print(f"wrote {merged} (every rank; the per-rank files beside it are what "
                      "`plait analyze` reads)")
        step = timeline(traces)
        if step.spans:
            steps[f"{kind}, measured"] = step
        else:
            console.print(f"{kind}: its trace has no per-action ranges to draw")
    if steps:
        png = folder / "pipeline-step.png"
        console.print(f"wrote {plot_gantt(png, steps, title + ': one profiled step each')}")
