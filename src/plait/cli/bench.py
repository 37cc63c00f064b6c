"""`plait bench`: measured time of every schedule of one pair, next to the simulator's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from plait.cli.common import (
    console_for,
    load_cluster,
    run_with_progress,
    user_errors,
    writable,
    write_json,
)
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec

Op = Annotated[str, typer.Option(help="ag (all_gather_matmul), rs (matmul_reduce_scatter), a2a "
                                 "(all_to_all_matmul) or mm_a2a (matmul_all_to_all)")]
Shape = Annotated[str, typer.Option(help="GEMM MxNxK: M rows (gathered / scattered), N "
                                    "columns, K reduction")]
Ranks = Annotated[int, typer.Option(help="CPU ranks to start (ignored under torchrun)")]
Experts = Annotated[int, typer.Option(help="a2a/mm_a2a: local experts per rank, sharing the M "
                                      "rows")]
Dtype = Annotated[str, typer.Option(help="fp32, bf16 or fp16")]
Warmup = Annotated[int, typer.Option(help="Untimed calls per schedule")]
Repeats = Annotated[int, typer.Option(help="Timed calls per schedule (median reported)")]
Schedules = Annotated[str, typer.Option(help="Comma-separated schedules, or 'all'")]
Hardware = Annotated[str, typer.Option("--hardware", "-H", help="Hardware the prediction uses "
                                       "(preset or cluster YAML/JSON)")]
Calibration = Annotated[Path | None, typer.Option(help="Calibration file for it")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results as JSON")]
Trace = Annotated[Path | None, typer.Option(help="torch.profiler Chrome trace (rank 0)")]
Timeout = Annotated[float, typer.Option(help="Seconds before the run is abandoned")]
Validate = Annotated[bool, typer.Option("--validate", help="Instead: held-out shapes, every "
                                        "schedule, predicted vs measured")]
Quick = Annotated[bool, typer.Option("--quick", help="With --validate: half the shapes")]
Plot = Annotated[Path | None, typer.Option(help="With --validate: predicted-vs-measured PNG")]
EmulateLink = Annotated[bool, typer.Option("--emulate-link", help="Instead: on one device, "
                                           "virtual peers behind host-to-device copies")]


def bench_command(
    op: Op = "ag", shape: Shape = "4096x256x2048", ranks: Ranks = 2, experts: Experts = 1,
    dtype: Dtype = "fp32", warmup: Warmup = 2, repeats: Repeats = 5, schedules: Schedules = "all",
    hardware: Hardware = "cpu", calibration: Calibration = None,
    json_out: JsonOut = Path("out/bench.json"), trace: Trace = Path("out/bench-trace.json"),
    timeout: Timeout = 900, validate: Validate = False, quick: Quick = False, plot: Plot = None,
    emulate_link: EmulateLink = False,
) -> None:
    """Run every schedule of one all-gather->GEMM or GEMM->reduce-scatter on local ranks."""
    from plait.measure.bench import check_run

    console = console_for(json_out)
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        check_run(ranks, warmup, repeats, timeout, dtype)
        cluster = load_cluster(hardware, calibration)
    if validate:
        _validate(console, ranks, repeats, warmup, cluster, json_out, plot, quick, timeout)
    elif emulate_link:
        _emulate(console, shape, ranks, warmup, repeats, hardware, calibration, json_out)
    else:
        _bench(console, op, shape, ranks, experts, dtype, warmup, repeats, schedules, cluster,
               json_out, trace, timeout)


def _bench(console: Console, op: str, shape: str, ranks: int, experts: int, dtype: str,
           warmup: int, repeats: int, schedules: str, cluster: ClusterSpec,
           json_out: Path | None, trace: Path | None, timeout: float) -> None:
    import torch

    from plait.measure.bench import bench_rank, bench_spec, bench_under_torchrun, summarize
    from plait.report.bench import bench_table

    under_torchrun = "WORLD_SIZE" in os.environ
    with user_errors():
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else ranks
        trace_path = str(trace) if trace is not None and str(trace) not in ("", ".") else None
        spec = bench_spec(op, shape, world, experts, dtype, warmup, repeats, schedules,
                          trace_path, gpu=under_torchrun and torch.cuda.is_available())
    if under_torchrun:
        measured = bench_under_torchrun(spec)
        if measured is None:
            return
    else:
        measured = run_with_progress(console, f"bench {op} {shape} on {world} ranks",
                                     repeats, world, bench_rank, spec, timeout=timeout)
    result = summarize(spec, measured, cluster)
    console.print(bench_table(result, console.width))
    if json_out is not None:
        write_json(json_out, result.to_dict(), console)
    if result.trace:
        console.print(f"wrote {result.trace} (torch.profiler, rank 0)")


def _validate(console: Console, ranks: int, repeats: int, warmup: int, cluster: ClusterSpec,
              json_out: Path | None, plot: Path | None, quick: bool, timeout: float) -> None:
    from plait.measure.validate import specs_for, summarize_validation, validate_rank
    from plait.report.bench import validation_table
    from plait.report.plots import plot_predicted_vs_measured
    specs = specs_for(ranks, repeats, warmup, quick)
    measured = run_with_progress(console, f"validating {len(specs)} held-out shapes",
                                 len(specs), ranks, validate_rank, specs, timeout=timeout)
    v = summarize_validation(specs, measured, cluster)
    t = validation_table(v, f"predicted ({cluster.name}) vs measured, {ranks} ranks",
                         console.width)
    console.print(t)
    if json_out is not None:
        write_json(json_out, v, console)
    if plot is not None:
        console.print(f"wrote {plot_predicted_vs_measured(v['rows'], plot, str(t.caption))}")


def _emulate(console: Console, shape: str, ranks: int, warmup: int, repeats: int, hardware: str,
             calibration: Path | None, json_out: Path | None) -> None:
    import torch

    from plait.measure.bench import parse_shape
    from plait.measure.emulate import emulate
    from plait.report.bench import emulate_table

    cuda = torch.cuda.is_available()
    with user_errors():
        m, n, k = parse_shape(shape)
        if m % ranks:
            raise SpecError("shape", f"M={m} does not split over {ranks} ranks",
                            f"use a multiple of {ranks}")
        base = load_cluster("h200" if cuda and hardware == "cpu" else hardware, calibration)
    if not cuda:
        torch.set_num_threads(1)  # the cpu profile describes one core per rank
    r = emulate(m, n, k, ranks, torch.device("cuda" if cuda else "cpu"), base, warmup, repeats)
    r |= {"hardware": base.name, "calibration": None if calibration is None else
          f"calibration {calibration}"}
    console.print(emulate_table(r, console.width))
    if json_out is not None:
        write_json(json_out, r, console)
