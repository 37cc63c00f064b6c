"""Chrome trace JSON (Perfetto, chrome://tracing) from simulated timelines.

One process per timeline (e.g. "sequential", "plait"), one thread (track) per stream or engine,
complete events ("ph": "X", microseconds), and flow arrows for the dependencies inside a pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.report.trace_file import write_trace
from plait.sim.engine import Timeline


def chrome_trace(timelines: dict[str, Timeline]) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    flow_id = 0
    for pid, (proc, tl) in enumerate(timelines.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": proc}})
        tids = {s: i for i, s in enumerate(tl.streams)}
        for stream, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        ends = {sp.task.name: sp for sp in tl.spans}
        for sp in tl.spans:
            t = sp.task
            args = {"label": t.label, "standalone_us": t.duration * 1e6,
                    "slowdown": (sp.duration / t.duration) if t.duration > 0 else 1.0,
                    **{k: _jsonable(v) for k, v in t.args.items()}}
            events.append({"ph": "X", "name": t.label or t.name, "cat": t.category,
                           "pid": pid, "tid": tids[t.stream], "ts": sp.start * 1e6,
                           "dur": sp.duration * 1e6, "args": args})
            for d in t.deps:
                src = ends.get(d)
                if src is None:
                    continue
                flow_id += 1
                events.append({"ph": "s", "id": flow_id, "name": "dep", "cat": "dep", "pid": pid,
                               "tid": tids[src.task.stream], "ts": src.end * 1e6 - 1e-3})
                events.append({"ph": "f", "bp": "e", "id": flow_id, "name": "dep", "cat": "dep",
                               "pid": pid, "tid": tids[t.stream], "ts": sp.start * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _jsonable(v: object) -> object:
    return v if isinstance(v, int | float | str | bool) or v is None else str(v)


def write_chrome_trace(path: str | Path, timelines: dict[str, Timeline]) -> Path:
    return write_trace(path, chrome_trace(timelines))
