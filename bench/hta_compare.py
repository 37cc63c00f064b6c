"""`plait analyze` next to Meta's HolisticTraceAnalysis (HTA) on the real traces in
../shared/data/traces, rank by rank.

    python bench/hta_compare.py [--hta-python /path/to/venv/bin/python] [--traces DIR] [--save]

For each trace set it gives plait's figures on its own window (whole profiler steps, an outlier
last step left out) and on HTA's window, next to HTA's on that window. HTA's window: the GPU
kernels whose launch (the CPU runtime call with their correlation id) came before the start of
the last ProfilerStep, and only those with a launch event; with one step or none, every
kernel. On that window both compute communication overlap (of the communication time, the
share compute kernels cover), idle, compute, and the rest ("non-compute": exposed
communication and memory copies) as shares of the span.

HTA is not a plait dependency: install it in a separate environment
(`python -m venv /tmp/hta && /tmp/hta/bin/pip install holistictraceanalysis`) and pass its
interpreter; without one only plait's figures are written. Also times `plait analyze`'s
start-up and its analysis of the largest trace. Writes out/hta_compare.json (and .md), or
bench/results/ with --save.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_io
from plait.analyze.analysis import analyze
from plait.analyze.kineto import RankTrace, read_trace

SETS = {  # name -> files, relative to the traces folder
    "deepseek-v3 dualpipe chunk pair": ["deepseek-v3-train-dualpipe-chunk-pair.json.gz"],
    "hta nccl-parser-config": ["hta/hta-nccl-parser-config/nccl_data.json.gz"],
    "hta trace-filter-2rank": ["hta/hta-trace-filter-2rank/sampled_rank-0.json.gz",
                               "hta/hta-trace-filter-2rank/sampled_rank-1.json.gz"],
    "hta df-index-resolver": ["hta/hta-df-index-resolver/df_index_resolver.json.gz"],
}

HTA_SCRIPT = r"""
import json, logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
out = {}
try:
    for _, r in a.get_comm_comp_overlap(visualize=False).iterrows():
        out.setdefault(int(r["rank"]), {})["overlap_pct"] = float(r["comp_comm_overlap_pctg"])
except Exception as exc:  # no communication kernel HTA knows
    out["error"] = f"get_comm_comp_overlap: {type(exc).__name__}: {exc}"
for _, r in a.get_temporal_breakdown(visualize=False).iterrows():
    out.setdefault(int(r["rank"]), {}).update(
        idle_pct=float(r["idle_time_pctg"]), compute_pct=float(r["compute_time_pctg"]),
        non_compute_pct=float(r["non_compute_time_pctg"]), span_us=float(r["kernel_time(us)"]))
print(json.dumps(out))
"""


def hta_window(t: RankTrace) -> RankTrace:
    """The kernels HTA keeps: launched (with a launch event) before the last step started."""
    if len(t.steps) < 2:
        return t
    last = t.steps[-1].start

    def keep(x: Any) -> bool:
        return x.launched is not None and x.launched < last

    return dataclasses.replace(t, devices=tuple(dataclasses.replace(
        d, comms=tuple(c for c in d.comms if keep(c)),
        compute=tuple(g for g in d.compute if keep(g)),
        memory=tuple(m for m in d.memory if keep(m))) for d in t.devices))


def plait_rows(traces: list[RankTrace], steps: str | None) -> tuple[list[dict[str, Any]], str]:
    a = analyze(traces, None, steps=steps)
    rows = []
    for t in a.traces:
        for d in t.exposure:
            s = d.steps or 1
            rows.append({"rank": t.trace.rank, "device": d.device, "steps": d.steps,
                         "comm_ms": d.comm_us / s / 1e3, "overlapped_ms": d.overlapped_us / s / 1e3,
                         "exposed_ms": d.exposed_us / s / 1e3,
                         "waiting_ms": None if d.waiting_us is None else d.waiting_us / s / 1e3,
                         "overlap_pct": 100 * d.overlapped_us / d.comm_us if d.comm_us else None,
                         "idle_pct": 100 * d.idle_us / d.span_us,
                         "compute_pct": 100 * d.compute_us / d.span_us,
                         "non_compute_pct": 100 * (d.exposed_us + d.memory_us) / d.span_us,
                         "span_us": d.span_us,
                         "rules": {r.rule: r.time_us / s / 1e3 for r in t.rules}})
    return rows, a.window.note


def run_hta(python: str, files: list[Path]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            (Path(tmp) / f.name).symlink_to(f.resolve())
        res = subprocess.run([python, "-c", HTA_SCRIPT, tmp], capture_output=True, text=True,
                             timeout=600)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr else "failed"}
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def timings(largest: Path) -> dict[str, float]:
    def best(cmd: list[str]) -> float:
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=False)
            runs.append(time.perf_counter() - t0)
        return min(runs)

    plait = [sys.executable, "-m", "plait"]
    return {"startup_s": best([*plait, "analyze", "--help"]),
            "largest_trace_s": best([*plait, "analyze", str(largest), "-H", "none"]),
            "largest_trace_mb_gz": largest.stat().st_size / 1e6}


def markdown(doc: dict[str, Any]) -> str:
    lines = ["| trace | rank | plait's window | comm ms/step | overlapped | exposed | "
             "of it waiting | on HTA's window: overlap % plait / HTA | idle % plait / HTA | "
             "compute % plait / HTA |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in doc["sets"].items():
        for own, same in zip(s["plait"], s["plait_on_hta_window"], strict=True):
            h = s["hta"].get(str(own["rank"]), {}) if isinstance(s["hta"], dict) else {}

            def pair(key: str, same: dict[str, Any] = same, h: dict[str, Any] = h) -> str:
                mine = same.get(key)
                theirs = h.get(key)
                return (f"{mine:.1f}" if mine is not None else "—") + " / " + (
                    f"{theirs:.1f}" if theirs is not None else "—")

            window = s["window"].split(" (")[0].split(";")[0] + (
                " (last left out)" if "left out" in s["window"] else "")
            wait = own["waiting_ms"]
            lines.append(f"| {name} | {own['rank']} | {window} | {own['comm_ms']:.2f} | "
                         f"{own['overlapped_ms']:.2f} | {own['exposed_ms']:.2f} | "
                         + ("—" if wait is None else f"{wait:.2f}") + " | "
                         f"{pair('overlap_pct')} | {pair('idle_pct')} | {pair('compute_pct')} |")
    rules = [f"- {name}, rank {r['rank']}: " + ", ".join(
        f"{k} {v:.2f} ms/step" for k, v in r["rules"].items())
        for name, s in doc["sets"].items() for r in s["plait"]]
    lines += ["", "Communication by rule (plait's window):", *rules]
    t = doc["timing"]
    lines.append(f"\n`plait analyze --help`: {t['startup_s']:.2f} s; the largest trace "
                 f"({t['largest_trace_mb_gz']:.1f} MB gzipped): {t['largest_trace_s']:.2f} s "
                 "end to end (best of 3).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--hta-python", help="the interpreter of an environment with HTA")
    ap.add_argument("--traces", type=Path, default=results_io.ROOT.parent / "shared/data/traces")
    args = ap.parse_args()
    doc: dict[str, Any] = {"hta": None, "sets": {}}
    if args.hta_python:
        ver = subprocess.run([args.hta_python, "-c", "import importlib.metadata as m; "
                              "print(m.version('HolisticTraceAnalysis'))"],
                             capture_output=True, text=True)
        doc["hta"] = ver.stdout.strip() or None
    for name, rel in SETS.items():
        files = [args.traces / r for r in rel]
        read = [read_trace(f) for f in files]
        own, note = plait_rows(read, None)
        same, _ = plait_rows([hta_window(t) for t in read], "all")
        doc["sets"][name] = {"files": rel, "window": note, "plait": own,
                             "plait_on_hta_window": same,
                             "hta": run_hta(args.hta_python, files) if args.hta_python else {}}
        print(f"{name}: {note}")
    doc["timing"] = timings(max((args.traces / r for rs in SETS.values() for r in rs),
                                key=lambda p: p.stat().st_size))
    text = markdown(doc)
    print(text)
    path = results_io.write("hta_compare.json", doc, args.save)
    path.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
