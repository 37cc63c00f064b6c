"""`plait coexec plan` and `plait coexec run`: micro-batch co-execution (DHelix)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from plait.cli.common import (
    CalibrationOpt,
    CapacityOpt,
    CpOpt,
    DpOpt,
    DtypeOpt,
    EpOpt,
    HardwareOpt,
    JsonOpt,
    MicroBatchOpt,
    ModelOpt,
    PpOpt,
    RegatherOpt,
    SeqLenOpt,
    SpOpt,
    TpOpt,
    VirtualStagesOpt,
    check_fits,
    cluster_label,
    console_for,
    load_cluster,
    parallel_spec,
    run_with_progress,
    user_errors,
    writable,
    write_json,
)
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.planner.coexec.pipelined import PipelinedRow
    from plait.planner.coexec.variants import CoexecReport
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import ModelSpec

app = typer.Typer(help="Micro-batch co-execution: plan and run forward(n) beside backward(n-1).",
                  no_args_is_help=True)


RUN_DTYPES = ("fp32", "fp64")  # what the executed small models compute in


def _small_model(name: str, ranks: int, layers: int, hidden: int, heads: int, kv_heads: int,
                 ffn: int, vocab: int, seq_len: int, micro_batches: int, dtype: str,
                 experts: int = 0, top_k: int = 2, regather: bool = True
                 ) -> tuple[ModelSpec, ParallelSpec]:
    """The small model `run` and `profile` execute, validated for `ranks`: TP over them, or,
    with `experts`, MoE layers expert-parallel over them (TP 1, EP = DP = ranks: each rank
    its own data). The parallel spec carries fp32 for the cost model (which has no fp64
    peaks); the run dtype travels apart."""
    from plait.spec.io import validate
    from plait.spec.layout import check_shardable
    from plait.spec.model import ModelSpec

    if dtype not in RUN_DTYPES:
        raise SpecError("dtype", f"{dtype!r} cannot be run here", f"use {' or '.join(RUN_DTYPES)}")
    moe = dict(moe=dict(experts=experts, top_k=top_k, expert_ffn=ffn)) if experts else {}
    spec = validate(ModelSpec, dict(name=name, layers=layers, hidden=hidden, heads=heads,
                                    kv_heads=kv_heads, ffn=ffn, vocab=vocab, **moe), "model")
    layout = dict(tp=1, ep=ranks, dp=ranks) if experts else dict(tp=ranks)
    par = parallel_spec(**layout, seq_len=seq_len, micro_batches=micro_batches, dtype="fp32",
                        regather=regather)
    check_shardable(spec, par)
    return spec, par


@app.command("plan")
def plan_command(
    model: ModelOpt = "llama3-70b",
    hardware: HardwareOpt = "h100",
    calibration: CalibrationOpt = None,
    tp: TpOpt = 8,
    sp: SpOpt = True,
    cp: CpOpt = 1,
    ep: EpOpt = 1,
    pp: PpOpt = 1,
    virtual_stages: VirtualStagesOpt = 1,
    dp: DpOpt = 1,
    seq_len: SeqLenOpt = 8192,
    micro_batch: MicroBatchOpt = 1,
    micro_batches: Annotated[int, typer.Option(help="Micro-batches per step (>= 2)")] = 8,
    dtype: DtypeOpt = "bf16",
    capacity_factor: CapacityOpt = 1.0,
    regather: RegatherOpt = True,
    nodes: Annotated[int | None, typer.Option(help="Override the cluster's node count")] = None,
    json_out: JsonOpt = None,
    trace: Annotated[Path | None, typer.Option(help="Chrome trace of the plan")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG Gantt of the plan")] = None,
) -> None:
    """The co-execution plan of one layer pair and the predicted step of five variants."""
    from plait.planner.coexec.pipelined import pipelined_rows
    from plait.planner.coexec.variants import coexec_report
    from plait.spec.model import load_model

    console = console_for(json_out)
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        spec = load_model(model)
        if micro_batches < 2:
            raise SpecError("micro_batches", "co-execution needs two micro-batches in flight",
                            "use --micro-batches 2 or more")
        par = parallel_spec(tp=tp, sp=sp, cp=cp, ep=ep, dp=dp, seq_len=seq_len,
                            micro_batch=micro_batch, micro_batches=micro_batches, pp=pp,
                            virtual_stages=virtual_stages, dtype=dtype,
                            capacity_factor=capacity_factor, regather=regather)
        cluster = load_cluster(hardware, calibration, nodes)
        check_fits(par, cluster)
        r = coexec_report(spec, par, cluster)
        pipelined = pipelined_rows(r) if par.pp > 1 else []  # the whole step, each schedule
    _print_report(console, r, pipelined)
    if json_out is not None:
        write_json(json_out, _report_dict(r, pipelined), console)
    steps = {f"{row.schedule}, {row.way} (pipelined step)": row.run.timeline()
             for row in pipelined if row.run is not None}
    if trace is not None:
        from plait.report.sim_trace import write_chrome_trace

        console.print(f"wrote {write_chrome_trace(trace, {**r.timelines, **steps})}")
    if plot is not None:
        from plait.report.gantt import plot_gantt

        label = cluster_label(r.cluster, calibration)
        title = (f"{spec.name} on {label}: co-execution plans (speedups vs {r.baseline}: the "
                 "table)")
        console.print(f"wrote {plot_gantt(plot, r.timelines, title)}")
        if steps:
            pipe = plot.with_name(f"{plot.stem}-pipeline{plot.suffix}")
            title = (f"{spec.name} on {label}, pp={par.pp}, "
                     f"{par.num_micro_batches} "
                     f"micro-batches: the pipelined step, predicted (default: the {r.baseline} "
                     "layers, OVERLAP_F_B run forward then backward; plait: FiCCO layers and "
                     "co-executed OVERLAP_F_B)")
            console.print(f"wrote {plot_gantt(pipe, steps, title)}")


def _print_report(console: Console, r: CoexecReport, pipelined: list[PipelinedRow]) -> None:
    from plait.report.explore import BASELINE_TEXT
    from plait.report.tables import Column, fitted_table

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


def _print_pipelined(console: Console, r: CoexecReport, rows: list[PipelinedRow]) -> None:
    from plait.planner.coexec.pipelined import transfer_s
    from plait.report.tables import Column, fitted_table

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


def _report_dict(r: CoexecReport, pipelined: list[PipelinedRow]) -> dict[str, Any]:
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


@app.command("run")
# A typer command's signature is its option list: most of its length.
def run_command(
    ranks: Annotated[int, typer.Option(help="Local gloo ranks (the TP group)")] = 2,
    layers: Annotated[int, typer.Option()] = 4,
    hidden: Annotated[int, typer.Option()] = 512,
    heads: Annotated[int, typer.Option()] = 8,
    kv_heads: Annotated[int, typer.Option()] = 4,
    ffn: Annotated[int, typer.Option()] = 1024,
    vocab: Annotated[int, typer.Option()] = 256,
    seq_len: Annotated[int, typer.Option()] = 512,
    micro_batches: Annotated[int, typer.Option()] = 4,
    dtype: Annotated[str, typer.Option(help="fp32 or fp64")] = "fp32",
    repeats: Annotated[int, typer.Option()] = 3,
    hardware: Annotated[str, typer.Option(help="Profile the prediction uses")] = "cpu",
    calibration: Annotated[Path | None, typer.Option()] = None,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    timeout: Annotated[float, typer.Option()] = 900,
    costs: Annotated[Path | None, typer.Option(help="Plan from a measured cost table "
                                               "(plait coexec profile) instead of the "
                                               "simulator")] = None,
    pp: Annotated[int, typer.Option(help="Pipeline ranks: > 1 times a pipelined step of "
                                    "--layers MLP blocks (1F1B, DualPipeV, DualPipeV with "
                                    "plait's OVERLAP_F_B) on --ranks = pp x tp ranks")] = 1,
    schedule: Annotated[str, typer.Option(help="With --pp: the plait schedule of the "
                                          "blocks' linears")] = "fine/sm/c2/g1/M",
    trace: Annotated[Path | None, typer.Option(help="With --pp: a folder for one profiled "
                                               "step of each schedule (a Chrome trace of "
                                               "all ranks each, and a PNG)")] = None,
    experts: Annotated[int, typer.Option(help="MoE layers with this many experts (FFN "
                                         "--ffn each), expert-parallel over the ranks "
                                         "(TP 1, EP = DP = ranks)")] = 0,
    top_k: Annotated[int, typer.Option(help="With --experts: experts per token")] = 2,
    regather: RegatherOpt = True,
) -> None:
    """Train one step of a small model four ways (plain, FiCCO, co-executed, co-executed +
    FiCCO); measured vs predicted. With --pp, a pipelined step three ways instead (PyTorch's
    1F1B and DualPipeV, and DualPipeV with plait's OVERLAP_F_B)."""
    from plait.measure.coexec import coexec_rank
    from plait.planner.coexec.variants import coexec_report

    console = console_for(json_out)
    if pp > 1:
        _run_pipelined(console, pp, ranks, layers, hidden, ffn, seq_len, micro_batches,
                       schedule, repeats, json_out, timeout, trace)
        return
    with user_errors():
        spec, par = _small_model("coexec-run", ranks, layers, hidden, heads, kv_heads, ffn,
                                 vocab, seq_len, micro_batches, dtype, experts, top_k, regather)
        if micro_batches < 2:
            raise SpecError("micro_batches", "co-execution needs two micro-batches in flight",
                            "use --micro-batches 2 or more")
        report = coexec_report(spec, par, load_cluster(hardware, calibration))
        plan = report.plan
        if costs is not None:
            from plait.planner.coexec.plan import MeasuredCosts, plan_dp
            from plait.planner.coexec.plan import validate as validate_plan
            from plait.spec.io import read_mapping

            table = MeasuredCosts(read_mapping(costs, "costs"))
            measured = table.table.get("meta", {}).get("regather", True)
            if measured != regather:
                raise SpecError("costs", f"{costs} was measured on the layer that "
                                f"{'re-gathers' if measured else 'keeps'} its gathered inputs",
                                f"run with {'--regather' if measured else '--keep-gathered'}, "
                                "or profile this layer (plait coexec profile "
                                f"{'--regather' if regather else '--keep-gathered'})")
            c = report.costs
            plan = plan_dp(c.fwd, c.bwd, c.collective, table.solo, table.pair)
            validate_plan(plan, c.fwd, c.bwd, c.collective)
    chosen = {r.pair.name: str(r.chosen.schedule) for r in report.exploration.pairs}
    runs = {"plain": {"plan": None, "fused": None}, "ficco": {"plan": None, "fused": chosen},
            "coexec": {"plan": plan.to_json(), "fused": None},
            "coexec+ficco": {"plan": (report.plan_fused if costs is None else plan).to_json(),
                             "fused": chosen}}
    m = run_with_progress(console, f"coexec run: {layers} layers x {micro_batches} "
                          f"micro-batches on {ranks} ranks", repeats + 1, ranks, coexec_rank,
                          spec, par, json.dumps(runs), repeats, dtype, timeout=timeout)
    predicted = {"plain": "sequential", "ficco": "intra-batch overlap (FiCCO)",
                 "coexec": "co-execution", "coexec+ficco": "co-execution + FiCCO"}
    pred = {name: report.step(report.variant(v)) for name, v in predicted.items()}
    moe = (f" (MoE: {experts} experts top-{top_k}, EP = DP = {ranks})" if experts else "")
    moe += "" if regather else " (gathered inputs kept)"
    t = Table(title=f"coexec run: {layers} layers{moe}, hidden {hidden}, seq {seq_len}, "
              f"{micro_batches} micro-batches, {ranks} ranks ({dtype}); predicted on "
              f"{hardware}{f' + {calibration.name}' if calibration else ''}",
              title_justify="left")
    for col in ("run", "step ms", "speedup", "pred. ms", "pred. x", "pred/meas",
                "act. MiB"):
        t.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    plain = m["plain"]
    for name in predicted:
        r = m[name]
        t.add_row(name, f"{r['step_s'] * 1e3:.1f}", f"{plain['step_s'] / r['step_s']:.2f}x",
                  f"{pred[name] * 1e3:.1f}", f"{pred['plain'] / pred[name]:.2f}x",
                  f"{pred[name] / r['step_s']:.2f}", f"{r['peak_activation_bytes'] / 2**20:.1f}")
    same = all(abs(plain["loss"] - m[n]["loss"]) <= 1e-5 * abs(plain["loss"]) for n in m)
    t.caption = ("measured, then predicted (pred.); speedups over plain; runs: "
                 + "; ".join(f"{n} = {v}" for n, v in predicted.items())
                 + f". Loss {plain['loss']:.6g}, the same in every run: {same}. FiCCO "
                 "schedules (explore's choice): "
                 + ", ".join(f"{n} {s}" for n, s in chosen.items())
                 + f"; co-execution + FiCCO ran {m['coexec+ficco']['filled_units']} compute "
                 "units inside the FiCCO units' communication waits")
    console.print(t)
    if json_out is not None:
        write_json(json_out, {"measured": m, "predicted": pred, "plan": plan.to_json(),
                              "runs": runs, "costs": "measured" if costs else "simulated"},
                   console)


def _run_pipelined(console: Console, pp: int, ranks: int, layers: int, hidden: int, ffn: int,
                   seq_len: int, micro_batches: int, schedule: str, repeats: int,
                   json_out: Path | None, timeout: float, trace: Path | None) -> None:
    from plait.measure.pipeline import KINDS, PipelineJob, pipeline_rank, predict
    from plait.schedule.schedule import Schedule

    with user_errors():
        Schedule.parse(schedule)
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
        job = PipelineJob(pp=pp, blocks=layers, hidden=hidden, ffn=ffn, tokens=seq_len,
                          micro_batches=micro_batches, schedule=schedule, repeats=repeats,
                          trace=None if trace is None else str(trace))
        job.check(ranks)
    tp = ranks // pp
    m = run_with_progress(console, f"coexec run --pp {pp}: {layers} blocks x {micro_batches} "
                          f"micro-batches on {ranks} ranks", len(KINDS), ranks, pipeline_rank,
                          job, timeout=timeout)
    chunk = m["chunk"]
    pred = predict(job, m)
    t = Table(title=f"coexec run --pp {pp}: {layers} MLP blocks (hidden {hidden}, FFN {ffn}, "
              f"{schedule}), {seq_len} tokens x {micro_batches} micro-batches, {ranks} gloo "
              f"ranks (PP={pp} x TP={tp})", title_justify="left")
    for col in ("schedule", "measured step ms", "predicted ms", "peak activations MiB",
                "predicted MiB"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    for kind in KINDS:
        t.add_row(kind, f"{m[kind]['step_s'] * 1e3:.1f}", f"{pred[kind]['step_s'] * 1e3:.1f}",
                  f"{m[kind]['peak_saved_bytes'] / 2**20:.2f}",
                  f"{pred[kind]['peak_saved_bytes'] / 2**20:.2f}")
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
    console.print(t)
    if json_out is not None:
        write_json(json_out, {"job": dataclasses.asdict(job), "ranks": ranks, "measured": m,
                              "predicted": pred}, console)
    if trace is not None:
        _write_pipeline_traces(console, trace, ranks, job, title=str(t.title or ""))


def _write_pipeline_traces(console: Console, folder: Path, ranks: int, job: Any,
                           title: str) -> None:

    from plait.measure.pipeline import KINDS, rank_trace, slug
    from plait.report.gantt import plot_gantt
    from plait.report.pipeline_trace import merge, read, timeline

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


@app.command("profile")
def profile_command(
    ranks: Annotated[int, typer.Option(help="Local gloo ranks (the TP group)")] = 2,
    hidden: Annotated[int, typer.Option()] = 512,
    heads: Annotated[int, typer.Option()] = 8,
    kv_heads: Annotated[int, typer.Option()] = 4,
    ffn: Annotated[int, typer.Option()] = 1024,
    seq_len: Annotated[int, typer.Option()] = 512,
    dtype: Annotated[str, typer.Option(help="fp32 or fp64")] = "fp32",
    repeats: Annotated[int, typer.Option()] = 3,
    out: Annotated[Path, typer.Option("--out", "-o")] = Path("out/coexec-costs.json"),
    timeout: Annotated[float, typer.Option()] = 1800,
    regather: RegatherOpt = True,
) -> None:
    """Measure every segment alone and every legal segment pair together (one layer)."""
    import time

    from plait.measure.coexec import block_costs_rank

    console = Console()
    with user_errors():
        spec, par = _small_model("coexec-profile", ranks, 1, hidden, heads, kv_heads, ffn, 64,
                                 seq_len, 1, dtype, regather=regather)
    table = run_with_progress(console, "coexec profile: block costs", None, ranks,
                              block_costs_rank, spec, par, repeats, dtype, timeout=timeout)
    table["meta"] = {"ranks": ranks, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                     "ffn": ffn, "seq_len": seq_len, "dtype": dtype, "regather": regather,
                     "date": time.strftime("%Y-%m-%d"), "command": "plait coexec profile"}
    write_json(out, table, indent=1)
    console.print(f"measured {len(table['solo'])} segments and {len(table['pair'])} pairs; "
                  f"wrote {out}")
