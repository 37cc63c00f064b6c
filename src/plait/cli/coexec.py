"""`plait coexec plan`, `run` and `profile`: micro-batch co-execution (DHelix)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from plait.cli.common import (
    check_fits,
    cluster_label,
    console_for,
    progress_bar,
    run_with_progress,
    user_errors,
    write_json,
)
from plait.cli.options import CLUSTER, MODEL, OUTPUTS, PARALLEL, Option, OptionGroup, Values, takes
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import ModelSpec

app = typer.Typer(help="Micro-batch co-execution: plan and run forward(n) beside backward(n-1).",
                  no_args_is_help=True)


def _two_in_flight(values: Values) -> None:
    if values.micro_batches < 2:
        raise SpecError("micro_batches", "co-execution needs two micro-batches in flight",
                        "use --micro-batches 2 or more")


# The small model `run` and `profile` execute on local ranks.
SMALL_MODEL = OptionGroup((
    Option("ranks", int, 2, "Local gloo ranks (the TP group; with --experts, EP = DP)"),
    Option("layers", int, 4, "Transformer layers"),
    Option("hidden", int, 512, "Hidden size"),
    Option("heads", int, 8, "Attention heads"),
    Option("kv_heads", int, 4, "Key/value heads (grouped-query attention)"),
    Option("ffn", int, 1024, "FFN size (of each expert with --experts)"),
    Option("vocab", int, 256, "Vocabulary size"),
    Option("seq_len", int, 512, "Tokens per sequence"),
    Option("micro_batches", int, 4, "Micro-batches per step (>= 2)"),
    Option("dtype", str, "fp32", "fp32 or fp64"),
    Option("experts", int, 0, "MoE layers with this many experts (FFN --ffn each), "
           "expert-parallel over the ranks (TP 1, EP = DP = ranks)"),
    Option("top_k", int, 2, "With --experts: experts per token"),
    Option("regather", bool, True, PARALLEL.options[-1].help, ("--regather/--keep-gathered",)),
))
RUN = OptionGroup((
    Option("repeats", int, 3, "Timed steps of each run (median reported)"),
    Option("timeout", float, 900, "Seconds before the run is abandoned"),
))
CO_PARALLEL = PARALLEL.defaults(micro_batches=8).helps(
    micro_batches="Micro-batches per step (>= 2)").check(_two_in_flight)


@app.command("plan")
@takes(outputs=OUTPUTS.helps(trace="Chrome trace of the plan", plot="PNG Gantt of the plan"),
       model=MODEL, cluster=CLUSTER.defaults(hardware="h100"), parallel=CO_PARALLEL)
def plan_command(
    *, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, outputs: Values,
) -> None:
    """The co-execution plan of one layer pair and the predicted step of five variants."""
    from plait.planner.coexec.pipelined import pipelined_rows
    from plait.planner.coexec.variants import predict_coexec
    from plait.report.coexec import plan_dict, print_plan, write_plan_pictures
    from plait.workload.transformer import build_layer

    console = console_for(outputs.json_out)
    with user_errors():
        check_fits(parallel, cluster)
        pairs = len(build_layer(model, parallel).pairs)
        with progress_bar(console, "exploring", pairs) as done:
            r = predict_coexec(model, parallel, cluster, done)
        pipelined = pipelined_rows(r) if parallel.pp > 1 else []  # the whole step, each schedule
    print_plan(console, r, pipelined)
    if outputs.json_out is not None:
        write_json(outputs.json_out, plan_dict(r, pipelined), console)
    write_plan_pictures(console, r, pipelined, outputs.trace, outputs.plot,
                        cluster_label(r.cluster))



@app.command("run")
@takes(small=SMALL_MODEL, run=RUN,
       cluster=CLUSTER.only("hardware", "calibration").defaults(hardware="cpu").helps(
           hardware="Hardware the prediction uses (preset or cluster YAML/JSON)"))
def run_command(
    *, small: Values, run: Values, cluster: ClusterSpec,
    costs: Annotated[Path | None, typer.Option(help="Plan from a measured cost table "
                                               "(plait coexec profile) instead of the "
                                               "simulator")] = None,
    pp: Annotated[int, typer.Option(help="Pipeline ranks: > 1 times a pipelined step of "
                                    "--layers MLP blocks (1F1B, DualPipeV, DualPipeV with "
                                    "plait's OVERLAP_F_B) on --ranks = pp x tp ranks")] = 1,
    schedule: Annotated[str, typer.Option(help="With --pp: the plait schedule of the "
                                          "blocks' linears, or 'auto'")] = "fine/sm/c2/g1/M",
    trace: Annotated[Path | None, typer.Option(help="With --pp: a folder for one profiled "
                                               "step of each schedule (a Chrome trace of "
                                               "all ranks each, and a PNG)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON")
                        ] = None,
) -> None:
    """Train one step of a small model four ways (plain, FiCCO, co-executed, co-executed +
    FiCCO); measured vs predicted. With --pp, a pipelined step three ways instead (PyTorch's
    1F1B and DualPipeV, and DualPipeV with plait's OVERLAP_F_B)."""
    from plait.measure.coexec.run import (
        CoexecRunResult,
        coexec_rank,
        measured_plan,
        runs_of,
        small_model,
    )
    from plait.planner.coexec.variants import predict_coexec
    from plait.report.coexec import print_run

    console = console_for(json_out)
    if pp > 1:
        _run_pipelined(console, pp, small, run, schedule, json_out, trace)
        return
    with user_errors():
        _two_in_flight(small)
        spec, par = small_model("coexec-run", **small)
        prediction = predict_coexec(spec, par, cluster)
        plan = None if costs is None else measured_plan(prediction, costs, small.regather)
    runs = runs_of(prediction, plan)
    m = run_with_progress(console, f"coexec run: {small.layers} layers x {small.micro_batches} "
                          f"micro-batches on {small.ranks} ranks", run.repeats + 1, small.ranks,
                          coexec_rank, spec, par, runs, run.repeats, small.dtype,
                          timeout=run.timeout)
    result = CoexecRunResult.of(prediction, runs, m, "simulated" if costs is None else "measured")
    moe = (f" (MoE: {small.experts} experts top-{small.top_k}, EP = DP = {small.ranks})"
           if small.experts else "") + ("" if small.regather else " (gathered inputs kept)")
    print_run(console, result, f"coexec run: {small.layers} layers{moe}, hidden {small.hidden}, "
              f"seq {small.seq_len}, {small.micro_batches} micro-batches, {small.ranks} ranks "
              f"({small.dtype}); predicted on {cluster.name}")
    if json_out is not None:
        write_json(json_out, result.to_dict(), console)


def _run_pipelined(console: Console, pp: int, small: Values, run: Values, schedule: str,
                   json_out: Path | None, trace: Path | None) -> None:
    import dataclasses

    from plait.measure.pipeline import KINDS, PipelineJob, pipeline_rank, predict
    from plait.report.coexec import print_pipelined_run
    from plait.report.pipeline_trace import write_step_traces
    from plait.schedule.schedule import as_choice

    with user_errors():
        as_choice(schedule)  # a schedule, or "auto" (tuned where its calls run alone)
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
        job = PipelineJob(pp=pp, blocks=small.layers, hidden=small.hidden, ffn=small.ffn,
                          tokens=small.seq_len, micro_batches=small.micro_batches,
                          schedule=schedule, repeats=run.repeats,
                          trace=None if trace is None else str(trace))
        job.check(small.ranks)
    m = run_with_progress(console, f"coexec run --pp {pp}: {small.layers} blocks x "
                          f"{small.micro_batches} micro-batches on {small.ranks} ranks",
                          len(KINDS), small.ranks, pipeline_rank, job, timeout=run.timeout)
    pred = predict(job, m)
    title = print_pipelined_run(console, job, small.ranks, m, pred)
    if json_out is not None:
        write_json(json_out, {"job": dataclasses.asdict(job), "ranks": small.ranks,
                              "measured": m, "predicted": pred}, console)
    if trace is not None:
        write_step_traces(console, trace, small.ranks, title)


@app.command("profile")
@takes(small=SMALL_MODEL.only("ranks", "hidden", "heads", "kv_heads", "ffn", "seq_len", "dtype",
                              "regather"),
       run=RUN.defaults(timeout=1800))
def profile_command(
    *, small: Values, run: Values,
    out: Annotated[Path, typer.Option("--out", "-o", help="Cost table to write (JSON)")
                   ] = Path("out/coexec-costs.json"),
) -> None:
    """Measure every segment alone and every legal segment pair together (one layer)."""
    from plait.measure.coexec.run import block_costs_rank, small_model

    console = Console()
    with user_errors():
        spec, par = small_model("coexec-profile", layers=1, vocab=64, micro_batches=1, **small)
    table = run_with_progress(console, "coexec profile: block costs", None, small.ranks,
                              block_costs_rank, spec, par, run.repeats, small.dtype,
                              timeout=run.timeout)
    table["meta"] = {"ranks": small.ranks, "hidden": small.hidden, "heads": small.heads,
                     "kv_heads": small.kv_heads, "ffn": small.ffn, "seq_len": small.seq_len,
                     "dtype": small.dtype, "regather": small.regather,
                     "date": time.strftime("%Y-%m-%d"), "command": "plait coexec profile"}
    write_json(out, table, indent=1)
    console.print(f"measured {len(table['solo'])} segments and {len(table['pair'])} pairs; "
                  f"wrote {out}")
