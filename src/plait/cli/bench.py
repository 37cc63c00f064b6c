"""`plait bench`: measured time of every schedule of one pair, next to the simulator's."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from plait.measure.bench import BenchResult, BenchSpec

from plait.cli.common import (
    console_for,
    load_cluster,
    run_with_progress,
    user_errors,
    writable,
    write_json,
)
from plait.errors import InfeasibleError, SpecError


# A typer command's signature is its option list: most of its length.
def bench_command(
    op: Annotated[str, typer.Option(help="ag (all_gather_matmul), rs (matmul_reduce_scatter), "
                                    "a2a (all_to_all_matmul) or mm_a2a (matmul_all_to_all)")
                  ] = "ag",
    shape: Annotated[str, typer.Option(help="GEMM MxNxK: M rows (gathered / scattered), N "
                                       "columns, K reduction")] = "4096x256x2048",
    ranks: Annotated[int, typer.Option(help="CPU ranks to start (ignored under torchrun)")] = 2,
    experts: Annotated[int, typer.Option(help="a2a/mm_a2a: local experts per rank, sharing the "
                                         "M rows")] = 1,
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16")] = "fp32",
    warmup: Annotated[int, typer.Option(help="Untimed calls per schedule")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed calls per schedule (median reported)")] = 5,
    schedules: Annotated[str, typer.Option(help="Comma-separated schedules, or 'all'")] = "all",
    hardware: Annotated[str, typer.Option(help="Profile the prediction uses")] = "cpu",
    calibration: Annotated[Path | None, typer.Option(help="Calibration file for it")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON")
                        ] = Path("out/bench.json"),
    trace: Annotated[Path | None, typer.Option(help="torch.profiler Chrome trace (rank 0)")
                     ] = Path("out/bench-trace.json"),
    timeout: Annotated[float, typer.Option(help="Seconds before the run is abandoned")] = 900,
    validate: Annotated[bool, typer.Option("--validate", help="Instead: held-out shapes, every "
                                           "schedule, predicted vs measured")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="With --validate: half the shapes")
                     ] = False,
    plot: Annotated[Path | None, typer.Option(help="With --validate: predicted-vs-measured "
                                              "PNG")] = None,
    emulate_link: Annotated[bool, typer.Option("--emulate-link", help="Instead: on one device, "
                                               "virtual peers behind host-to-device copies")
                            ] = False,
) -> None:
    """Run every schedule of one all-gather->GEMM or GEMM->reduce-scatter on local ranks."""
    from plait.measure.bench import bench_rank, summarize


    console = console_for(json_out)
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        _check_run(ranks, warmup, repeats, timeout, dtype)
    if validate:
        _validate(console, ranks, repeats, warmup, hardware, calibration, json_out, plot,
                  quick, timeout)
        return
    if emulate_link:
        with user_errors():
            m, n, k = _parse_shape(shape)
            if m % ranks:
                raise SpecError("shape", f"M={m} does not split over {ranks} ranks",
                                f"use a multiple of {ranks}")
        _emulate(console, m, n, k, ranks, warmup, repeats, hardware, calibration, json_out)
        return
    under_torchrun = "WORLD_SIZE" in os.environ
    with user_errors():
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else ranks
        cluster = load_cluster(hardware, calibration)
        trace_path = str(trace) if trace is not None and str(trace) not in ("", ".") else None
        spec = _spec(op, shape, world, experts, dtype, warmup, repeats, schedules, trace_path)
        if under_torchrun:
            measured = _torchrun(spec)
            if measured is None:
                return
        else:
            measured = run_with_progress(console, f"bench {op} {shape} on {world} ranks",
                                         repeats, world, bench_rank, spec, timeout=timeout)
        result = summarize(spec, measured, cluster)
    console.print(_table(result))
    if json_out is not None:
        write_json(json_out, result.to_dict(), console)
    if result.trace:
        console.print(f"wrote {result.trace} (torch.profiler, rank 0)")


def _validate(console: Console, ranks: int, repeats: int, warmup: int, hardware: str,
              calibration: Path | None, json_out: Path | None, plot: Path | None, quick: bool,
              timeout: float) -> None:
    from plait.measure.validate import specs_for, summarize_validation, validate_rank
    from plait.report.plots import plot_predicted_vs_measured

    with user_errors():
        cluster = load_cluster(hardware, calibration)
    specs = specs_for(ranks, repeats, warmup, quick)
    measured = run_with_progress(console, f"validating {len(specs)} held-out shapes",
                                 len(specs), ranks, validate_rank, specs, timeout=timeout)
    v = summarize_validation(specs, measured, cluster)
    t = Table(title=f"predicted ({cluster.name}"
              f"{', calibrated' if calibration else ''}) vs measured, {ranks} ranks",
              title_justify="left")
    for col in ("shape", "measured best", "ms", "predicted best", "its ms", "pick",
                "median |err|"):
        t.add_column(col)
    for sh in v["shapes"]:
        t.add_row(sh["shape"], sh["measured_best"], f"{sh['measured_best_s'] * 1e3:.2f}",
                  sh["predicted_best"], f"{sh['predicted_best_measured_s'] * 1e3:.2f}",
                  "exact" if sh["exact"] else ("within 5%" if sh["within_5pct"] else "miss"),
                  f"{sh['median_abs_error']:.0%}")
    sm = v["summary"]
    t.caption = (f"{sm['runs']} runs: median |error| {sm['median_abs_error']:.0%}, p90 "
                 f"{sm['p90_abs_error']:.0%}; predicted best = measured best in "
                 f"{sm['pick_exact']:.0%} of shapes, within 5% in {sm['pick_within_5pct']:.0%}; "
                 f"heuristic's pick within 5% in {sm['heuristic_within_5pct']:.0%}"
                 + ("" if sm["repeat_within_5pct"] is None else
                    f"; noise floor: half of the repeats picks within 5% of the other half's "
                    f"best in {sm['repeat_within_5pct']:.0%}"))
    console.print(t)
    if json_out is not None:
        write_json(json_out, v, console)
    if plot is not None:
        console.print(f"wrote {plot_predicted_vs_measured(v['rows'], plot, t.caption)}")


def _emulate(console: Console, m: int, n: int, k: int, ranks: int, warmup: int, repeats: int,
             hardware: str, calibration: Path | None, json_out: Path | None) -> None:
    import torch

    from plait.measure.emulate import emulate

    cuda = torch.cuda.is_available()
    with user_errors():
        base = load_cluster("h200" if cuda and hardware == "cpu" else hardware, calibration)
    if not cuda:
        torch.set_num_threads(1)  # the cpu profile describes one core per rank
    r = emulate(m, n, k, ranks, torch.device("cuda" if cuda else "cpu"), base, warmup, repeats)
    t = Table(title=f"emulated link on {r['device']}: AG->GEMM {m}x{n}x{k}, {ranks} ranks "
              f"(1 real); link {r['link_bytes_per_s'] / 1e9:.1f} GB/s + "
              f"{r['link_latency_s'] * 1e6:.0f} us, GEMM {r['gemm_s'] * 1e3:.3f} ms, "
              f"transfer {r['link_s'] * 1e3:.3f} ms", title_justify="left")
    for col in ("schedule", "measured ms", "predicted ms", "pred/meas"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    for s, v in sorted(r["measured_s"].items(), key=lambda kv: kv[1]):
        p = r["predicted_s"][s]
        t.add_row(s, f"{v * 1e3:.3f}", f"{p * 1e3:.3f}", f"{p / v:.2f}")
    console.print(t)
    if json_out is not None:
        write_json(json_out, r, console)


def _spec(op: str, shape: str, world: int, experts: int, dtype: str, warmup: int,
          repeats: int, schedules: str, trace: str | None) -> BenchSpec:
    """The run, every option checked before a rank starts: one clear line, not every rank's
    traceback."""
    from plait.measure.bench import BenchSpec, feasible_schedules
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import check_feasible

    m, n, k = _parse_shape(shape)
    if op not in ("ag", "rs", "a2a", "mm_a2a"):
        raise SpecError("op", f"{op!r} is not a pair kind", "use ag, rs, a2a or mm_a2a")
    if experts != 1 and op not in ("a2a", "mm_a2a"):
        raise SpecError("experts", f"{op} has no experts", "use --op a2a or mm_a2a")
    if experts < 1:
        raise SpecError("experts", f"{experts} experts", "use 1 or more")
    if m % (world * experts):
        raise SpecError("shape" if experts == 1 else "experts",
                        f"M={m} rows do not split over {world} ranks"
                        + (f" x {experts} experts" if experts > 1 else ""),
                        f"use M a multiple of {world * experts}")
    spec = BenchSpec(op, m, n, k, world, dtype, warmup, repeats, (), trace, experts)
    names = feasible_schedules(spec) if schedules == "all" else \
        [str(Schedule.parse(x)) for x in schedules.split(",")]
    for name in names:
        try:
            check_feasible(spec.pair(), Schedule.parse(name))
        except InfeasibleError as exc:
            raise SpecError("schedules", str(exc), "drop it, or choose chunks that split "
                            f"M={m} into {world} ranks x chunks") from None
    if "seq/sm" not in names:
        names.insert(0, "seq/sm")
    return BenchSpec(op, m, n, k, world, dtype, warmup, repeats, tuple(names), trace, experts)


BENCH_DTYPES = ("fp32", "bf16", "fp16")  # what the CPU and GPU ranks compute in


def _check_run(ranks: int, warmup: int, repeats: int, timeout: float, dtype: str) -> None:
    """The run options, each named when it cannot work."""
    if ranks < 1:
        raise SpecError("ranks", f"{ranks} ranks", "use 1 or more")
    if warmup < 0:
        raise SpecError("warmup", f"{warmup} calls", "use 0 or more")
    if repeats < 1:
        raise SpecError("repeats", f"{repeats} timed calls", "use 1 or more")
    if not (math.isfinite(timeout) and timeout > 0):
        raise SpecError("timeout", f"{timeout} s", "use a positive number of seconds")
    if dtype not in BENCH_DTYPES:
        raise SpecError("dtype", f"{dtype!r} cannot be benchmarked",
                        f"use one of {', '.join(BENCH_DTYPES)}")


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SpecError("shape", f"cannot read {text!r}",
                        "write MxNxK, e.g. 4096x256x2048") from None
    if min(m, n, k) <= 0:
        raise SpecError("shape", f"{text!r} has a non-positive size", "use positive sizes")
    return m, n, k


def _torchrun(spec: BenchSpec) -> dict[str, Any] | None:
    import torch.distributed as dist

    from plait.measure.bench import bench_rank
    from plait.runtime.launch import init_from_env, leave_group

    init_from_env()  # NCCL and this rank's GPU when there are GPUs, else gloo
    rank = dist.get_rank()
    out = bench_rank(rank, dist.get_world_size(), spec)
    leave_group()
    return out if rank == 0 else None


def _table(r: BenchResult) -> Table:
    s = r.spec
    experts = f" x{s.experts} experts" if s.experts > 1 else ""
    t = Table(title=f"plait bench: {s.op} M={s.m} N={s.n} K={s.k}{experts} {s.dtype} on "
              f"{s.ranks} ranks; "
              f"GEMM {r.gemm_s * 1e3:.2f} ms, transfer {r.comm_s * 1e3:.2f} ms (fastest engine), "
              f"ideal "
              f"{r.ideal_s * 1e3:.2f} ms (predicted on {r.hardware}: GEMM "
              f"{r.predicted_gemm_s * 1e3:.2f}, collective {r.predicted_comm_s * 1e3:.2f})",
              title_justify="left")
    for col in ("schedule", "engine", "measured ms", "speedup", "of ideal saving",
                "predicted ms", "pred/meas"):
        t.add_column(col, justify="left" if col in ("schedule", "engine") else "right")
    for row in sorted(r.rows, key=lambda x: x.measured_s):
        t.add_row(row.schedule, row.engine, f"{row.measured_s * 1e3:.2f}",
                  f"{row.speedup:.2f}x", f"{row.saving_achieved:+.0%}",
                  f"{row.predicted_s * 1e3:.2f}", f"{row.predicted_s / row.measured_s:.2f}")
    from plait.measure.bench import contradictions

    notes = contradictions(r)
    if notes:
        t.caption = "note: " + "; ".join(notes)
        t.caption_justify = "left"
    return t
