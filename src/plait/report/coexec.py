"""Presenting co-execution: the plan and predicted variants of `plait coexec plan` (tables,
JSON, pictures), and what `plait coexec run` measured next to the prediction."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from plait.report.explore import BASELINE_TEXT
from plait.report.tables import Column, fitted_table

if TYPE_CHECKING:
    from plait.measure.coexec.run import CoexecRunResult
    from plait.measure.pipeline import PipelineJob
    from plait.planner.coexec.pipelined import PipelinedRow
    from plait.planner.coexec.variants import CoexecPrediction


def print_plan(console: Console, r: CoexecPrediction, pipelined: list[PipelinedRow]) -> None:
    """The plan's blocks, the predicted variants and, with a pipeline, each schedule's step."""
    par = r.parallel
    t = Table(title=f"co-execution plan: {r.model.name} tp={par.tp} sp={par.sp} cp={par.cp} "
              f"seq {par.seq_len} x mb {par.micro_batch} on {r.cluster.name}; one block per "
              f"row (forward of "
              f"micro-batch n | backward of n-1)", title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("forward (layer i, micro-batch n)")
    t.add_column("backward (layer L-1-i, micro-batch n-1)")
    for i, b in enumerate(r.plan.blocks):
        t.add_row(str(i), ", ".join(b.fwd) or "—", ", ".join(b.bwd) or "—")
    console.print(t)
    cols = (Column("variant", 0), Column("layer fwd+bwd ms", 2, True),
            Column("co-executed pair ms", 3, True), Column("step ms", 0, True),
            Column(f"speedup vs {r.baseline}", 0, True), Column("hidden comm", 1, True),
            Column("est. MFU", 1, True))
    rows = [(var.name, f"{(var.layer_fwd_s + var.layer_bwd_s) * 1e3:.3f}",
             "—" if var.pair_s is None else f"{var.pair_s * 1e3:.3f}",
             f"{r.step(var) * 1e3:,.1f}", f"{r.speedup(var):.2f}x",
             f"{r.hidden(var):.0%}", f"{r.mfu(var):.1%}") for var in r.variants]
    console.print(fitted_table(f"predicted: {r.layers} layers x {r.k} micro-batches",
                               cols, rows, console.width))
    console.print(f"baseline: {BASELINE_TEXT[r.baseline]}")
    if pipelined:
        _print_pipelined(console, r, pipelined)


def _print_pipelined(console: Console, r: CoexecPrediction, rows: list[PipelinedRow]) -> None:
    from plait.planner.coexec.pipelined import transfer_s

    base = rows[0].step_s  # 1F1B as PyTorch runs it
    notes = any(row.note for row in rows)
    cols = (Column("schedule", 0), Column("runs", 0), Column("step ms", 0, True),
            Column("bubble", 1, True), Column("vs 1F1B default", 0, True),
            Column("peak activations (layers)", 2, True), *([Column("note", 1)] * notes))
    table = []
    for row in rows:
        if row.run is None:
            table.append((row.schedule, row.way, "—", "—", "—", "—", row.note)[:len(cols)])
            continue
        assert row.step_s is not None
        table.append((row.schedule, row.way, f"{row.step_s * 1e3:,.1f}",
                      f"{row.run.bubble_fraction:.1%}",
                      f"{base / row.step_s:.2f}x" if base else "—",
                      str(row.peak_layers), row.note)[:len(cols)])
    console.print(fitted_table(
        f"pipelined step: pp={r.parallel.pp}, {r.k} micro-batches, {r.model.layers} layers; "
        f"stage-to-stage transfer {transfer_s(r) * 1e3:.3f} ms", cols, table, console.width))
    console.print("default: the baseline's layers, DualPipeV's OVERLAP_F_B run forward then "
                  "backward (PyTorch without a registered overlap); plait: FiCCO layers and "
                  "the co-executed pair for each OVERLAP_F_B. Peak activations: the fullest "
                  "rank's, in layers of one micro-batch.")


def plan_dict(r: CoexecPrediction, pipelined: list[PipelinedRow]) -> dict[str, Any]:
    """The JSON document of `plait coexec plan --json`."""
    return {"model": r.model.name, "parallel": r.parallel.model_dump(), "hardware": r.cluster.name,
            "plan": [[list(b.fwd), list(b.bwd)] for b in r.plan.blocks],
            "plan_with_ficco": [[list(b.fwd), list(b.bwd)] for b in r.plan_fused.blocks],
            "ficco_units_in_steady_state": r.fused_steady,
            "baseline": r.baseline,
            "variants": [{"name": v.name, "step_s": r.step(v),
                          "speedup_vs_baseline": r.speedup(v),
                          "pair_s": v.pair_s, "hidden_comm": r.hidden(v), "mfu": r.mfu(v),
                          "phases": {"forward": {"time_s": v.layer_fwd_s,
                                                 "exposed_comm_s": v.exposed_fwd_s},
                                     "backward": {"time_s": v.layer_bwd_s,
                                                  "exposed_comm_s": v.exposed_bwd_s},
                                     "pair": None if v.pair_s is None else {
                                         "time_s": v.pair_s,
                                         "exposed_comm_s": v.exposed_pair_s}}}
                         for v in r.variants],
            "pipelined": [{"schedule": row.schedule, "runs": row.way, "step_s": row.step_s,
                           "bubble_s": None if row.run is None else row.run.bubble_s,
                           "peak_activation_layers": row.peak_layers,
                           "chunk_layers": row.chunk_layers, "note": row.note or None}
                          for row in pipelined] or None}


def write_plan_pictures(console: Console, r: CoexecPrediction, pipelined: list[PipelinedRow],
                        trace: Path | None, plot: Path | None, cluster_label: str) -> None:
    """A Chrome trace and a PNG Gantt of the co-executed layer pair (and of each pipelined
    step)."""
    steps = {f"{row.schedule}, {row.way} (pipelined step)": row.run.timeline()
             for row in pipelined if row.run is not None}
    if trace is not None:
        from plait.report.sim_trace import write_chrome_trace

        console.print(f"wrote {write_chrome_trace(trace, {**r.timelines, **steps})}")
    if plot is None:
        return
    from plait.report.gantt import plot_gantt

    title = (f"{r.model.name} on {cluster_label}: co-execution plans (speedups vs "
             f"{r.baseline}: the table)")
    console.print(f"wrote {plot_gantt(plot, r.timelines, title)}")
    if steps:
        pipe = plot.with_name(f"{plot.stem}-pipeline{plot.suffix}")
        title = (f"{r.model.name} on {cluster_label}, pp={r.parallel.pp}, "
                 f"{r.parallel.num_micro_batches} "
                 f"micro-batches: the pipelined step, predicted (default: the {r.baseline} "
                 "layers, OVERLAP_F_B run forward then backward; plait: FiCCO layers and "
                 "co-executed OVERLAP_F_B)")
        console.print(f"wrote {plot_gantt(pipe, steps, title)}")


def print_run(console: Console, r: CoexecRunResult, title: str) -> None:
    """Measured against predicted step of each run of `plait coexec run`."""
    from plait.measure.coexec.run import PREDICTED

    cols = (Column("run", 0), Column("step ms", 0, True), Column("speedup", 0, True),
            Column("pred. ms", 1, True), Column("pred. x", 0, True), Column("pred/meas", 2, True),
            Column("act. MiB", 1, True))
    m, pred = r.measured, r.predicted
    plain = m["plain"]
    rows = [(name, f"{m[name]['step_s'] * 1e3:.1f}",
             f"{plain['step_s'] / m[name]['step_s']:.2f}x", f"{pred[name] * 1e3:.1f}",
             f"{pred['plain'] / pred[name]:.2f}x", f"{pred[name] / m[name]['step_s']:.2f}",
             f"{m[name]['peak_activation_bytes'] / 2**20:.1f}") for name in PREDICTED]
    t = fitted_table(title, cols, rows, console.width)
    left_out = t.caption
    fused = r.runs["ficco"].fused or {}
    t.caption = ("measured, then predicted (pred.); speedups over plain; runs: "
                 + "; ".join(f"{n} = {v}" for n, v in PREDICTED.items())
                 + f". Loss {plain['loss']:.6g}, the same in every run: {r.same_loss()}. FiCCO "
                 "schedules (explore's choice): "
                 + ", ".join(f"{n} {s}" for n, s in fused.items())
                 + f"; co-execution + FiCCO ran {m['coexec+ficco']['filled_units']} compute "
                 "units inside the FiCCO units' communication waits"
                 + (f"\n{left_out}" if left_out else ""))
    console.print(t)


def print_pipelined_run(console: Console, job: PipelineJob, ranks: int, m: dict[str, Any],
                        pred: dict[str, dict[str, float]]) -> str:
    """Each pipeline schedule measured against its prediction; the table's title."""
    from plait.measure.pipeline import KINDS

    tp = ranks // job.pp
    cols = (Column("schedule", 0), Column("measured step ms", 0, True),
            Column("predicted ms", 0, True), Column("peak activations MiB", 1, True),
            Column("predicted MiB", 1, True))
    rows = [(kind, f"{m[kind]['step_s'] * 1e3:.1f}", f"{pred[kind]['step_s'] * 1e3:.1f}",
             f"{m[kind]['peak_saved_bytes'] / 2**20:.2f}",
             f"{pred[kind]['peak_saved_bytes'] / 2**20:.2f}") for kind in KINDS]
    t = fitted_table(f"coexec run --pp {job.pp}: {job.blocks} MLP blocks (hidden {job.hidden}, "
                     f"FFN {job.ffn}, {job.schedule}), {job.tokens} tokens x "
                     f"{job.micro_batches} micro-batches, {ranks} gloo ranks (PP={job.pp} x "
                     f"TP={tp})", cols, rows, console.width)
    left_out = t.caption
    chunk = m["chunk"]
    t.caption = (f"predicted: plait's pipeline simulation from one chunk's measured forward "
                 f"({chunk['forward_s'] * 1e3:.2f} ms) and backward "
                 f"({chunk['backward_s'] * 1e3:.2f} ms), OVERLAP_F_B with plait as a perfect "
                 "overlap, planned as its plan predicts; activations: the bytes autograd "
                 "saves for backward")
    for kind in KINDS[2:]:
        ran = m[kind]["overlap_f_b"]
        t.caption += (f". {kind}: overlapped {ran['overlapped']} of {ran['actions']} actions "
                      "on rank 0" + (f" ({ran['planned']} planned, "
                                     f"{ran['deferred_weight_grads']} weight gradients "
                                     "deferred)" if kind.endswith("plan") else "")
                      + "".join(f"; fell back: {why}" for why in ran["fell_back"]))
    if left_out:
        t.caption += f"\n{left_out}"
    console.print(t)
    return str(t.title or "")
