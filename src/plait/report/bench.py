"""Presenting `plait bench`: every schedule measured next to its prediction, the held-out
validation, and the emulated link."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from plait.report.tables import Column, fitted_table

if TYPE_CHECKING:
    from plait.measure.bench import BenchResult


def bench_table(r: BenchResult, width: int) -> Table:
    """Every schedule measured, fastest first: engine, time, speedup, the ideal saving
    realized, the prediction; what the measurements cannot say in the caption."""
    from plait.measure.bench import contradictions

    s = r.spec
    experts = f" x{s.experts} experts" if s.experts > 1 else ""
    title = (f"plait bench: {s.op} M={s.m} N={s.n} K={s.k}{experts} {s.dtype} on {s.ranks} "
             f"ranks; GEMM {r.gemm_s * 1e3:.2f} ms, transfer {r.comm_s * 1e3:.2f} ms (fastest "
             f"engine), ideal {r.ideal_s * 1e3:.2f} ms (predicted on {r.hardware}: GEMM "
             f"{r.predicted_gemm_s * 1e3:.2f}, collective {r.predicted_comm_s * 1e3:.2f})")
    cols = (Column("schedule", 0), Column("engine", 2), Column("measured ms", 0, True),
            Column("speedup", 0, True), Column("of ideal saving", 3, True),
            Column("predicted ms", 1, True), Column("pred/meas", 1, True))
    rows = [(row.schedule, row.engine, f"{row.measured_s * 1e3:.2f}", f"{row.speedup:.2f}x",
             f"{row.saving_achieved:+.0%}", f"{row.predicted_s * 1e3:.2f}",
             f"{row.predicted_s / row.measured_s:.2f}")
            for row in sorted(r.rows, key=lambda x: x.measured_s)]
    t = fitted_table(title, cols, rows, width)
    notes = contradictions(r)
    if notes:
        t.caption = "note: " + "; ".join(notes) + (f"\n{t.caption}" if t.caption else "")
    return t


def validation_table(v: dict[str, Any], title: str, width: int) -> Table:
    """Per held-out shape: the measured best and the predicted best (never cut: they are what
    the table is for), how the pick fared; the summary in the caption."""
    cols = (Column("shape", 0), Column("measured best", 0), Column("ms", 1, True),
            Column("predicted best", 0), Column("its ms", 1, True), Column("pick", 0),
            Column("median |err|", 2, True))
    rows = [(sh["shape"], sh["measured_best"], f"{sh['measured_best_s'] * 1e3:.2f}",
             sh["predicted_best"], f"{sh['predicted_best_measured_s'] * 1e3:.2f}",
             "exact" if sh["exact"] else ("within 5%" if sh["within_5pct"] else "miss"),
             f"{sh['median_abs_error']:.0%}") for sh in v["shapes"]]
    t = fitted_table(title, cols, rows, width)
    sm = v["summary"]
    summary = (f"{sm['runs']} runs: median |error| {sm['median_abs_error']:.0%}, p90 "
               f"{sm['p90_abs_error']:.0%}; predicted best = measured best in "
               f"{sm['pick_exact']:.0%} of shapes, within 5% in {sm['pick_within_5pct']:.0%}; "
               f"heuristic's pick within 5% in {sm['heuristic_within_5pct']:.0%}"
               + ("" if sm["repeat_within_5pct"] is None else
                  f"; noise floor: half of the repeats picks within 5% of the other half's "
                  f"best in {sm['repeat_within_5pct']:.0%}"))
    t.caption = summary + (f"\n{t.caption}" if t.caption else "")
    return t


def emulate_table(r: dict[str, Any], width: int) -> Table:
    """Each /dma schedule against the emulated link: measured and predicted."""
    m, n, k = r["shape"]
    title = (f"emulated link on {r['device']}: AG->GEMM {m}x{n}x{k}, {r['ranks']} ranks "
             f"(1 real); link {r['link_bytes_per_s'] / 1e9:.1f} GB/s + "
             f"{r['copy_overhead_s'] * 1e6:.1f} us a copy, "
             f"{r['call_overhead_s'] * 1e6:.0f} us a call; GEMM {r['gemm_s'] * 1e3:.3f} ms, "
             f"transfer {r['link_s'] * 1e3:.3f} ms; predicted: simulator + the call's fixed "
             f"cost, {r.get('calibration') or 'preset ' + str(r.get('hardware', ''))}")
    cols = (Column("schedule", 0), Column("measured ms", 0, True),
            Column("predicted ms", 0, True), Column("pred/meas", 1, True))
    rows = [(s, f"{v * 1e3:.3f}", f"{r['predicted_s'][s] * 1e3:.3f}",
             f"{r['predicted_s'][s] / v:.2f}")
            for s, v in sorted(r["measured_s"].items(), key=lambda kv: kv[1])]
    return fitted_table(title, cols, rows, width)
