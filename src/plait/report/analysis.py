"""Presenting a trace `Analysis`: rich tables, a JSON document, a PNG, and the user's own trace
with the exposed communication added as a track per device (Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait import __version__
from plait.analyze.advice import Advice
from plait.analyze.analysis import Analysis, TraceAnalysis
from plait.analyze.kineto import load_trace

_TRACK = 1_000_000_001  # tid of the added track: far from any real thread or stream id


def _ms(us: float | None, steps: int = 0) -> str:
    """Microseconds as milliseconds, per step when `steps`; "—" when unknown (waiting for
    other ranks is known only when every rank's trace was given)."""
    return "—" if us is None else f"{(us / steps if steps else us) / 1e3:,.2f}"


def render(a: Analysis, console: Console, top: int = 10, every_rank: bool = False) -> None:
    """Every trace in detail; with several, a table of all ranks and then the details of the
    one that exposes the most communication (all of them with `every_rank`)."""
    shown = a.traces
    if len(a.traces) > 1:
        console.print(_ranks(a))
        if not every_rank:
            worst = max(a.traces, key=lambda t: sum(d.exposed_us for d in t.exposure))
            console.print(f"details of {worst.trace.path}, the most exposed ("
                          "--every-rank for all):")
            shown = (worst,)
    for t in shown:
        who = f"rank {t.trace.rank} of {t.trace.world}" if t.trace.rank is not None else "trace"
        console.print(f"[bold]{t.trace.path}[/] · {who}"
                      + (f" · {t.trace.gpu_name}" if t.trace.gpu_name else ""))
        console.print(_devices(t))
        console.print(_collectives(t, top))
        if t.regions:
            console.print(_regions(t))
        if t.advice:
            console.print(_pairs(t, a.hardware or "", top))
        console.print(_summary(t, a.hardware))


def _ranks(a: Analysis) -> Table:
    tab = Table(title="every rank (ms; per step when the traces mark steps)", title_justify="left")
    for col in ("rank", "device", "span", "communication", "exposed", "of it waiting",
                "exposed / span", "plait saves"):
        tab.add_column(col, justify="left" if col in ("rank", "device") else "right")
    for t in a.traces:
        for d in t.exposure:
            s = d.steps
            saved = saving_us(tuple(ad for ad in t.advice if ad.device == d.device))
            tab.add_row(str(t.trace.rank if t.trace.rank is not None else t.trace.path),
                        d.device, _ms(d.span_us, s), _ms(d.comm_us, s), _ms(d.exposed_us, s),
                        _ms(d.waiting_us, s), f"{d.exposed_fraction:.1%}",
                        _ms(saved, s) if a.hardware else "—")
    return tab


def _devices(t: TraceAnalysis) -> Table:
    tab = Table(title="time per device (ms; per step when the trace marks steps)",
                title_justify="left")
    for col in ("device", "steps", "span", "compute", "communication", "overlapped",
                "exposed", "of it waiting", "exposed / span"):
        tab.add_column(col, justify="left" if col == "device" else "right")
    for d in t.exposure:
        s = d.steps
        tab.add_row(d.device, str(s or "—"), _ms(d.span_us, s), _ms(d.compute_us, s),
                    _ms(d.comm_us, s), _ms(d.overlapped_us, s), _ms(d.exposed_us, s),
                    _ms(d.waiting_us, s), f"{d.exposed_fraction:.1%}")
    return tab


def _collectives(t: TraceAnalysis, top: int) -> Table:
    tab = Table(title="collectives, most exposed first (ms over the whole trace)",
                title_justify="left")
    for col in ("device", "collective", "ranks", "MB", "dtype", "calls", "time", "exposed",
                "of it waiting", "exposed %"):
        tab.add_column(col, justify="left" if col in ("device", "collective", "dtype")
                       else "right")
    for r in t.collectives[:top]:
        tab.add_row(r.device, r.kind, str(r.group or "?"), f"{r.nbytes / 1e6:,.2f}"
                    if r.nbytes else "?", r.dtype or "?", str(r.calls), _ms(r.comm_us),
                    _ms(r.exposed_us), _ms(r.waiting_us),
                    f"{r.exposed_us / r.comm_us:.0%}" if r.comm_us else "—")
    return tab


def _regions(t: TraceAnalysis) -> Table:
    tab = Table(title="by record_function range (ms over the whole trace)", title_justify="left")
    for col in ("device", "range", "count", "time", "communication", "exposed", "exposed / time"):
        tab.add_column(col, justify="left" if col in ("device", "range") else "right")
    for r in t.regions:
        tab.add_row(r.device, r.region, str(r.count), _ms(r.span_us), _ms(r.comm_us),
                    _ms(r.exposed_us), f"{r.exposed_us / r.span_us:.1%}" if r.span_us else "—")
    return tab


def _pairs(t: TraceAnalysis, hardware: str, top: int) -> Table:
    tab = Table(title=f"dependent pairs: measured now vs plait's best schedule (predicted on "
                f"{hardware}); µs per call", title_justify="left")
    for col in ("device", "pair", "calls", "GEMM", "transfer", "exposed", "of it waiting", "now",
                "plait schedule", "plait", "saving", "saving/step (ms)"):
        tab.add_column(col, justify="left" if col in ("device", "pair", "plait schedule")
                       else "right")
    steps = max((d.steps for d in t.exposure), default=0)
    for ad in t.advice[:top]:
        saving = (f"{ad.saving_us:,.0f}" if ad.saving_us > 0 else "hidden already")
        tab.add_row(ad.device, ad.pair.name, str(ad.calls), f"{ad.gemm_us:,.0f}",
                    f"{ad.comm_us:,.0f}", f"{ad.exposed_us:,.0f}", f"{ad.exposed_wait_us:,.0f}",
                    f"{ad.now_us:,.0f}",
                    str(ad.report.chosen.schedule), f"{ad.plait_us:,.0f}", saving,
                    _ms(max(ad.saving_us, 0.0) * ad.calls, steps))
    return tab


def saving_us(advice: tuple[Advice, ...]) -> float:
    """What plait's schedules are predicted to save over the whole trace (positive parts)."""
    return sum(max(a.saving_us, 0.0) * a.calls for a in advice)


def _summary(t: TraceAnalysis, hardware: str | None) -> str:
    lines = []
    for d in t.exposure:
        waiting = "" if d.waiting_us is None else (
            f"; {_ms(d.waiting_us, d.steps)} ms of it is waiting for other ranks")
        lines.append(f"{d.device}: {_ms(d.exposed_us, d.steps)} ms of "
                     f"{_ms(d.span_us, d.steps)} ms "
                     f"{'per step ' if d.steps else ''}is communication nothing hides "
                     f"({d.exposed_fraction:.1%}){waiting}.")
    if t.advice:
        steps = max((d.steps for d in t.exposure), default=0)
        saved = saving_us(t.advice)
        span = sum(d.span_us for d in t.exposure)
        share = f" ({saved / span:.1%} of the span)" if span > 0 else ""
        lines.append(f"plait's schedules for the {len(t.advice)} dependent pair(s) found are "
                     f"predicted (on {hardware}) to save {_ms(saved, steps)} ms"
                     f"{' per step' if steps else ''}{share}.")
    elif hardware is None:
        lines.append("No predictions: pass --hardware (a preset or file) to see plait's schedules.")
    else:
        lines.append("No dependent pair found: no all-gather, reduce-scatter or all-to-all moves "
                     "exactly a neighbouring GEMM's operand, outside the pairs plait's runtime "
                     "already schedules (record the trace with record_shapes=True so GEMM "
                     "shapes are known).")
    return "\n".join(lines)


def to_dict(a: Analysis) -> dict[str, Any]:
    return {"plait_version": __version__, "hardware": a.hardware, "traces": [{
        "path": t.trace.path, "rank": t.trace.rank, "world": t.trace.world,
        "gpu": t.trace.gpu_name,
        "devices": [{"device": d.device, "steps": d.steps, "span_us": d.span_us,
                     "compute_us": d.compute_us, "comm_us": d.comm_us,
                     "overlapped_us": d.overlapped_us, "exposed_us": d.exposed_us,
                     "waiting_us": d.waiting_us, "exposed_fraction": d.exposed_fraction}
                    for d in t.exposure],
        "collectives": [{"device": r.device, "kind": r.kind, "ranks": r.group,
                         "bytes": r.nbytes, "dtype": r.dtype, "calls": r.calls,
                         "comm_us": r.comm_us, "exposed_us": r.exposed_us,
                         "waiting_us": r.waiting_us}
                        for r in t.collectives],
        "regions": [{"device": r.device, "range": r.region, "count": r.count,
                     "span_us": r.span_us, "comm_us": r.comm_us, "exposed_us": r.exposed_us}
                    for r in t.regions],
        "pairs": [{"device": ad.device, "pair": ad.pair.name, "direction": ad.pair.direction,
                   "kind": ad.pair.collective.kind.value, "ranks": ad.pair.ranks,
                   "gemm_mnk": [ad.pair.gemm.m, ad.pair.gemm.n, ad.pair.gemm.k],
                   "calls": ad.calls, "gemm_us": ad.gemm_us, "comm_us": ad.comm_us,
                   "exposed_us": ad.exposed_us, "wait_us": ad.wait_us,
                   "exposed_wait_us": ad.exposed_wait_us, "now_us": ad.now_us,
                   "schedule": str(ad.report.chosen.schedule), "plait_us": ad.plait_us,
                   "predicted_sequential_us": ad.report.sequential.time_s * 1e6,
                   "predicted_best_us": ad.report.chosen.time_s * 1e6,
                   "saving_us": ad.saving_us} for ad in t.advice],
        "saving_us": saving_us(t.advice)} for t in a.traces]}


def write_exposed_trace(t: TraceAnalysis, path: str | Path) -> Path:
    """The analyzed trace with one more track per device: its exposed communication."""
    doc, events = load_trace(t.trace.path)
    for dev, d in zip(t.trace.devices, t.exposure, strict=True):
        events.append({"ph": "M", "name": "thread_name", "pid": dev.pid, "tid": _TRACK,
                       "args": {"name": "plait: exposed communication"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": dev.pid, "tid": _TRACK,
                       "args": {"sort_index": -1}})
        events += [{"ph": "X", "cat": "plait", "name": "exposed", "pid": dev.pid, "tid": _TRACK,
                    "ts": s, "dur": e - s} for s, e in d.exposed]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc))
    return out


def plot_analysis(a: Analysis, path: str | Path) -> Path:
    """One bar per device: compute alone, communication hidden under compute, exposed
    communication, idle; per step when the trace marks steps."""
    from plait.report.plots import pyplot, save_figure

    plt = pyplot()
    rows = [(f"{Path(t.trace.path).stem}\n{d.device}", d) for t in a.traces for d in t.exposure]
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.5 * len(rows)))
    colors = {"compute only": "#4C72B0", "communication, hidden": "#55A868",
              "communication, exposed": "#C44E52", "idle": "#DDDDDD"}
    for y, (_label, d) in enumerate(rows):
        s = d.steps or 1
        parts = {"compute only": d.compute_us - d.overlapped_us,
                 "communication, hidden": d.overlapped_us,
                 "communication, exposed": d.exposed_us,
                 "idle": max(0.0, d.span_us - d.compute_us - d.exposed_us)}
        left = 0.0
        for k, v in parts.items():
            ax.barh(y, v / s / 1e3, left=left, color=colors[k], label=k if y == 0 else None)
            left += v / s / 1e3
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms" + (" per step" if any(d.steps for _, d in rows) else ""))
    ax.set_title("where the time goes: measured in the profiler trace", loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return save_figure(fig, path)
