"""Presenting a trace `Analysis`: tables fitted to the terminal, a JSON document, a PNG, and the
user's own trace with the exposed communication added as a track per device (Perfetto).

How the parts add up, on every device: span = compute + exposed communication + memory alone +
idle; communication = overlapped + exposed; exposed = waiting for other ranks + transferring."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from plait import __version__
from plait.analyze.analysis import Analysis, TraceAnalysis
from plait.analyze.breakdown import category_rows
from plait.analyze.kineto import load_trace
from plait.report.tables import Column, fitted_table
from plait.report.trace_file import write_trace

if TYPE_CHECKING:
    from plait.analyze.advice import Advice

_TRACK = 1_000_000_001  # tid of the added track: far from any real thread or stream id
ADD_UP = ("span = compute + exposed communication + memory alone + idle; "
          "exposed = waiting for other ranks + transferring")


def _ms(us: float | None, steps: int = 0, bound: bool = False) -> str:
    """Microseconds as milliseconds, per step when `steps`; "—" when unknown (waiting for
    other ranks is known only when several ranks' traces were given); "≥" before a lower
    bound."""
    if us is None:
        return "—"
    return ("≥" if bound else "") + f"{(us / steps if steps else us) / 1e3:,.2f}"


def _per_step(steps: int) -> str:
    """The unit of a table whose figures are per step (or totals, without steps)."""
    return (f"ms per step, over {steps} step{'s' * (steps != 1)}" if steps
            else "ms, totals over the whole trace")


def _totals(t: TraceAnalysis) -> str:
    """The unit of a table whose figures are totals over the window."""
    steps = max((d.steps for d in t.exposure), default=0)
    return (f"ms, totals over the window's {steps} step{'s' * (steps != 1)}" if steps
            else "ms, totals over the whole trace")


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "—"


def render(a: Analysis, console: Console, top: int = 10, every_rank: bool = False) -> None:
    """Every trace in detail; with several, a table of all ranks and then the details of the
    one that exposes the most communication (all of them with `every_rank`)."""
    w = console.width
    console.print(f"window: {a.window.note}")
    for note in a.notes:
        console.print(f"note: {note}")
    shown = a.traces
    if len(a.traces) > 1:
        console.print(_ranks(a, w))
        if a.straggler is not None:
            s = a.straggler
            b = "≥" if s.bound else ""
            world = max((t.trace.world or 0 for t in a.traces), default=0)
            hedge = (f" A guess: only {len(a.traces)} of {world} ranks were traced, and a rank "
                     "not traced may wait less still." if s.bound else "")
            console.print(f"straggler: rank {s.rank} waits least for the others "
                          f"({b}{s.waiting_us / 1e3:,.2f} ms per step, the others {b}"
                          f"{s.others_us / 1e3:,.2f} ms on average): they wait for it.{hedge}")
        if not every_rank:
            worst = max(a.traces, key=lambda t: sum(d.exposed_us for d in t.exposure))
            console.print(f"details of {worst.trace.path}, the most exposed ("
                          "--every-rank for all):")
            shown = (worst,)
    for t in shown:
        who = f"rank {t.trace.rank} of {t.trace.world}" if t.trace.rank is not None else "trace"
        console.print(f"[bold]{t.trace.path}[/] · {who}"
                      + (f" · {t.trace.gpu_name}" if t.trace.gpu_name else ""))
        if t.left_out:
            console.print(f"{t.left_out} events outside the window left out")
        console.print(_devices(t, a.waiting_is_bound, w))
        if len(t.step_rows) > 1:
            console.print(_steps(t, w))
        console.print(_rules(t, w))
        console.print(_collectives(t, top, a.waiting_is_bound, w))
        console.print(_kernels(t, top, w))
        if t.idle:
            console.print(_idle(t, w))
        if t.regions:
            console.print(_regions(t, w))
        if t.advice:
            console.print(_pairs(t, a.hardware or "", top, w))
        if t.graded:
            console.print(_graded(t, a.hardware, w))
        for f in t.findings:
            console.print(f"[bold yellow]what stopped overlap[/] ({f.device}): {f.what}. "
                          f"Evidence: {f.evidence}. Fix: {f.fix}.")
        console.print(_summary(t, a.hardware, a.waiting_is_bound))


def _ranks(a: Analysis, width: int) -> Any:
    cols = (Column("rank", 0), Column("device", 2), Column("span", 0, True),
            Column("communication", 1, True), Column("exposed", 0, True),
            Column("of it waiting", 0, True), Column("exposed / span", 1, True),
            Column("plait saves", 3, True))
    rows = []
    for t in a.traces:
        for d in t.exposure:
            s = d.steps
            saved = saving_us(tuple(ad for ad in t.advice if ad.device == d.device))
            rows.append((str(t.trace.rank if t.trace.rank is not None else t.trace.path),
                         d.device, _ms(d.span_us, s), _ms(d.comm_us, s), _ms(d.exposed_us, s),
                         _ms(d.waiting_us, s, a.waiting_is_bound), _pct(d.exposed_us, d.span_us),
                         _ms(saved, s) if a.hardware else "—"))
    steps = max((d.steps for t in a.traces for d in t.exposure), default=0)
    return fitted_table(f"every rank ({_per_step(steps)})", cols, rows, width)


def _devices(t: TraceAnalysis, bound: bool, width: int) -> Any:
    cols = (Column("device", 0), Column("steps", 3, True), Column("span", 0, True),
            Column("compute", 1, True), Column("communication", 0, True),
            Column("overlapped", 2, True), Column("exposed", 0, True),
            Column("of it waiting", 1, True), Column("memory", 3, True), Column("idle", 2, True),
            Column("exposed / span", 1, True))
    rows = [(d.device, str(d.steps or "—"), _ms(d.span_us, d.steps), _ms(d.compute_us, d.steps),
             _ms(d.comm_us, d.steps), _ms(d.overlapped_us, d.steps),
             _ms(d.exposed_us, d.steps), _ms(d.waiting_us, d.steps, bound),
             _ms(d.memory_us, d.steps), _ms(d.idle_us, d.steps),
             _pct(d.exposed_us, d.span_us)) for d in t.exposure]
    steps = max((d.steps for d in t.exposure), default=0)
    return fitted_table(f"time per device ({_per_step(steps)}; memory: copies and memsets "
                        "alone)", cols, rows, width)


def _steps(t: TraceAnalysis, width: int) -> Any:
    cols = (Column("device", 2), Column("step", 0, True), Column("span", 0, True),
            Column("compute", 1, True), Column("communication", 0, True),
            Column("exposed", 0, True), Column("window", 1))
    rows = [(r.device, str(r.step), _ms(r.span_us), _ms(r.compute_us), _ms(r.comm_us),
             _ms(r.exposed_us), "in" if r.in_window else "left out") for r in t.step_rows]
    return fitted_table("each step (ms, that step alone; its span runs from its first event to "
                        "its last, and steps may overlap on the GPU, so the spans need not add "
                        "up to the window's)", cols, rows, width)


def _rules(t: TraceAnalysis, width: int) -> Any:
    cols = (Column("device", 2), Column("rule", 0), Column("kernels", 1, True),
            Column("time", 0, True), Column("exposed", 0, True), Column("exposed %", 1, True))
    rows = [(r.device, r.rule, str(r.kernels), _ms(r.time_us), _ms(r.exposed_us),
             f"{r.exposed_us / r.time_us:.0%}" if r.time_us else "—") for r in t.rules]
    return fitted_table(f"communication by rule ({_totals(t)}; --comm-kernel adds rules)",
                        cols, rows, width)


def _collectives(t: TraceAnalysis, top: int, bound: bool, width: int) -> Any:
    cols = (Column("device", 4), Column("collective", 0), Column("rule", 5),
            Column("ranks", 2, True), Column("MB", 1, True), Column("dtype", 3),
            Column("calls", 2, True), Column("time", 0, True), Column("exposed", 0, True),
            Column("of it waiting", 1, True), Column("exposed %", 1, True))
    rows = [(r.device, r.kind, r.rule, str(r.group or "?"),
             f"{r.nbytes / 1e6:,.2f}" if r.nbytes else "?", r.dtype or "?", str(r.calls),
             _ms(r.comm_us), _ms(r.exposed_us), _ms(r.waiting_us, 0, bound),
             f"{r.exposed_us / r.comm_us:.0%}" if r.comm_us else "—")
            for r in t.collectives[:top]]
    return fitted_table(f"collectives, most exposed first ({_totals(t)})", cols, rows, width)


def _kernels(t: TraceAnalysis, top: int, width: int) -> Any:
    cols = (Column("device", 3), Column("kind", 1), Column("kernel", 0),
            Column("calls", 2, True), Column("time", 0, True), Column("share", 0, True))
    caption = "; ".join(f"{r.device} {r.category} {r.share:.1%}"
                        for r in category_rows(t.kernels))
    room = max(24, width - 32)  # what the name may take beside its time and share
    rows = [(r.device, r.category, r.kernel if len(r.kernel) <= room else r.kernel[:room - 1]
             + "…", str(r.calls), _ms(r.time_us), f"{r.share:.1%}") for r in t.kernels[:top]]
    return fitted_table(f"top kernels by time ({_totals(t)}; of all kernel time: {caption})",
                        cols, rows, width)


def _idle(t: TraceAnalysis, width: int) -> Any:
    spans = {d.device: d.span_us for d in t.exposure}
    cols = (Column("device", 2), Column("cause", 0), Column("gaps", 1, True),
            Column("time", 0, True), Column("of the span", 0, True))
    rows = [(r.device, r.cause, str(r.gaps), _ms(r.time_us), _pct(r.time_us, spans[r.device]))
            for r in t.idle]
    return fitted_table(f"idle time by cause ({_totals(t)}; the CPU had not launched the next "
                        "kernel yet, or it waited on another stream, event or sync)", cols, rows,
                        width)


def _regions(t: TraceAnalysis, width: int) -> Any:
    cols = (Column("device", 2), Column("range", 0), Column("count", 1, True),
            Column("time", 0, True), Column("communication", 0, True),
            Column("exposed", 0, True), Column("exposed / time", 1, True))
    rows = [(r.device, r.region, str(r.count), _ms(r.span_us), _ms(r.comm_us),
             _ms(r.exposed_us), _pct(r.exposed_us, r.span_us)) for r in t.regions]
    return fitted_table(f"by record_function range ({_totals(t)})", cols, rows, width)


def _pairs(t: TraceAnalysis, hardware: str, top: int, width: int) -> Any:
    cols = (Column("device", 5), Column("pair", 0), Column("calls", 2, True),
            Column("GEMM", 3, True), Column("transfer", 3, True), Column("exposed", 1, True),
            Column("of it waiting", 4, True), Column("now", 0, True),
            Column("plait schedule", 0), Column("plait", 0, True), Column("saving", 0, True),
            Column("saving/step (ms)", 1, True))
    steps = max((d.steps for d in t.exposure), default=0)
    rows = [(ad.device, ad.pair.name, str(ad.calls), f"{ad.gemm_us:,.0f}", f"{ad.comm_us:,.0f}",
             f"{ad.exposed_us:,.0f}", f"{ad.exposed_wait_us:,.0f}", f"{ad.now_us:,.0f}",
             str(ad.report.chosen.schedule), f"{ad.plait_us:,.0f}",
             f"{ad.saving_us:,.0f}" if ad.saving_us > 0 else "hidden already",
             _ms(max(ad.saving_us, 0.0) * ad.calls, steps)) for ad in t.advice[:top]]
    return fitted_table(f"dependent pairs: measured now vs plait's best schedule (predicted on "
                        f"{hardware}, against the pair run one after the other); µs per call",
                        cols, rows, width)


def _graded(t: TraceAnalysis, hardware: str | None, width: int) -> Any:
    from plait.schedule.verdict import TOLERANCE

    planned = 0 if any(g.planned for g in t.graded) else 3
    cols = (Column("call", 0), Column("pair", planned), Column("GEMM", 4),
            Column("planned", planned), Column("ran", 0), Column("engine", 5),
            Column("calls", 3, True), Column("µs/call", 0, True), Column("exposed", 2, True),
            Column("predicted", 1, True), Column("plain", 2, True),
            Column("decomp", 4, True), Column("contend", 4, True), Column("verdict", 0))
    rows = [(g.call.label, g.pair or "—", f"{g.call.m}x{g.call.n}x{g.call.k}",
             g.planned or "—", g.call.schedule, g.call.engine, str(g.calls),
             f"{g.time_us:,.0f}", f"{g.exposed_us:,.0f}",
             "—" if g.predicted_us is None else f"{g.predicted_us:,.0f}",
             "—" if g.plain_us is None else f"{g.plain_us:,.0f}"
             + ("" if g.plain_measured else "*"),
             "—" if g.decomposition_loss is None else f"{g.decomposition_loss:+.0%}",
             "—" if g.contention_loss is None else f"{g.contention_loss:+.0%}", g.verdict)
            for g in t.graded]
    where = f"predicted on {hardware}" if hardware else "no prediction (-H none)"
    table = fitted_table(f"plait's calls, graded (µs per call, median; {where}; as predicted: "
                         f"within ±{TOLERANCE:.0%}; plain: the collective then the GEMM, "
                         "measured here or * predicted)", cols, rows, width)
    return table


def saving_us(advice: tuple[Advice, ...]) -> float:
    """What plait's schedules are predicted to save over the whole trace (positive parts)."""
    return sum(max(a.saving_us, 0.0) * a.calls for a in advice)


def _summary(t: TraceAnalysis, hardware: str | None, bound: bool) -> str:
    lines = []
    for d in t.exposure:
        waiting = "" if d.waiting_us is None else (
            f"; of it {_ms(d.waiting_us, d.steps, bound)} ms is waiting for other ranks and "
            f"{_ms(d.exposed_us - d.waiting_us, d.steps, False)} ms transferring")
        own = "" if not d.plait_us else (
            f" ({_ms(d.plait_us, d.steps)} ms of the communication is plait's own shape check)")
        lines.append(f"{d.device}: {_ms(d.exposed_us, d.steps)} ms of "
                     f"{_ms(d.span_us, d.steps)} ms "
                     f"{'per step ' if d.steps else ''}is communication nothing hides "
                     f"({d.exposed_fraction:.1%}){waiting}.{own}")
    lines.append(f"How the parts add up: {ADD_UP}.")
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
    s = a.straggler
    return {"plait_version": __version__, "hardware": a.hardware,
            "window": {"steps": list(a.window.steps), "note": a.window.note,
                       "dropped_last": a.window.dropped_last,
                       "dropped_first": a.window.dropped_first},
            "notes": list(a.notes), "waiting_is_lower_bound": a.waiting_is_bound,
            "how_parts_add_up": ADD_UP,
            "straggler": None if s is None else {"rank": s.rank, "waiting_us_per_step":
                                                 s.waiting_us, "others_us_per_step": s.others_us},
            "traces": [_trace_dict(t) for t in a.traces]}


def _trace_dict(t: TraceAnalysis) -> dict[str, Any]:
    return {
        "path": t.trace.path, "rank": t.trace.rank, "world": t.trace.world,
        "gpu": t.trace.gpu_name, "events_left_out": t.left_out,
        "findings": [{"device": f.device, "what": f.what, "evidence": f.evidence, "fix": f.fix}
                     for f in t.findings],
        "graded": [{"device": g.device, "op": g.call.op, "call": g.call.label,
                    "pair": g.pair, "gemm_mnk": [g.call.m, g.call.n, g.call.k],
                    "ranks": g.call.ranks, "dtype": g.call.dtype, "planned": g.planned,
                    "ran": g.call.schedule, "engine": g.call.engine, "calls": g.calls,
                    "time_us": g.time_us, "per_step_us": g.per_step_us,
                    "exposed_us": g.exposed_us, "predicted_us": g.predicted_us,
                    "predicted_exposed_us": g.predicted_exposed_us, "plain_us": g.plain_us,
                    "plain_measured": g.plain_measured, "verdict": g.verdict, "why": g.why,
                    "decomposition_loss": g.decomposition_loss,
                    "contention_loss": g.contention_loss}
                   for g in t.graded],
        "devices": [{"device": d.device, "steps": d.steps, "span_us": d.span_us,
                     "compute_us": d.compute_us, "comm_us": d.comm_us,
                     "overlapped_us": d.overlapped_us, "exposed_us": d.exposed_us,
                     "waiting_us": d.waiting_us, "memory_us": d.memory_us,
                     "idle_us": d.idle_us, "plait_check_us": d.plait_us,
                     "exposed_fraction": d.exposed_fraction}
                    for d in t.exposure],
        "steps": [{"device": r.device, "step": r.step, "span_us": r.span_us,
                   "compute_us": r.compute_us, "comm_us": r.comm_us, "exposed_us": r.exposed_us,
                   "in_window": r.in_window} for r in t.step_rows],
        "rules": [{"device": r.device, "rule": r.rule, "kernels": r.kernels,
                   "time_us": r.time_us, "exposed_us": r.exposed_us} for r in t.rules],
        "collectives": [{"device": r.device, "kind": r.kind, "rule": r.rule, "ranks": r.group,
                         "bytes": r.nbytes, "dtype": r.dtype, "calls": r.calls,
                         "comm_us": r.comm_us, "exposed_us": r.exposed_us,
                         "waiting_us": r.waiting_us}
                        for r in t.collectives],
        "kernels": [{"device": r.device, "category": r.category, "kernel": r.kernel,
                     "calls": r.calls, "time_us": r.time_us, "share": r.share}
                    for r in t.kernels],
        "idle": [{"device": r.device, "cause": r.cause, "gaps": r.gaps, "time_us": r.time_us}
                 for r in t.idle],
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
        "saving_us": saving_us(t.advice)}


def write_exposed_trace(t: TraceAnalysis, path: str | Path) -> Path:
    """The analyzed trace with one more track per device: its exposed communication. The
    document is marked as plait's (`plait` key), so reading a folder skips it."""
    doc, events = load_trace(t.trace.path)
    if isinstance(doc, list):  # a bare event list: wrap it so it can carry the mark
        doc = {"traceEvents": events}
    doc["plait"] = {"written_by": "plait analyze --trace", "version": __version__,
                    "source": t.trace.path}
    for dev, d in zip(t.trace.devices, t.exposure, strict=True):
        events.append({"ph": "M", "name": "thread_name", "pid": dev.pid, "tid": _TRACK,
                       "args": {"name": "plait: exposed communication"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": dev.pid, "tid": _TRACK,
                       "args": {"sort_index": -1}})
        events += [{"ph": "X", "cat": "plait", "name": "exposed", "pid": dev.pid, "tid": _TRACK,
                    "ts": s, "dur": e - s} for s, e in d.exposed]
    return write_trace(path, doc)


def plot_analysis(a: Analysis, path: str | Path) -> Path:
    """One bar per device: compute alone, communication hidden under compute, exposed
    communication, memory copies alone, idle; per step when the trace marks steps."""
    from plait.report.plots import pyplot, save_figure

    plt = pyplot()
    rows = [(f"{Path(t.trace.path).stem}\n{d.device}", d) for t in a.traces for d in t.exposure]
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.5 * len(rows)))
    colors = {"compute only": "#4C72B0", "communication, hidden": "#55A868",
              "communication, exposed": "#C44E52", "memory copies / sets": "#DD8452",
              "idle": "#DDDDDD"}
    for y, (_label, d) in enumerate(rows):
        s = d.steps or 1
        parts = {"compute only": d.compute_us - d.overlapped_us,
                 "communication, hidden": d.overlapped_us,
                 "communication, exposed": d.exposed_us,
                 "memory copies / sets": d.memory_us, "idle": d.idle_us}
        left = 0.0
        for k, v in parts.items():
            ax.barh(y, v / s / 1e3, left=left, color=colors[k], label=k if y == 0 else None)
            left += v / s / 1e3
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms" + (" per step" if any(d.steps for _, d in rows) else ""))
    ax.set_title(f"where the time goes: measured in the profiler trace ({a.window.note})",
                 loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return save_figure(fig, path)
