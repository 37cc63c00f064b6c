"""`plait analyze`: how much communication nothing hides in your own job, from its profiler
trace, and what plait's schedules would save."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import console_for, load_cluster, to_stdout, user_errors, writable, write_json
from plait.errors import SpecError


# A typer command's signature is its option list: most of its length.
def analyze_command(
    traces: Annotated[list[Path], typer.Argument(help="torch.profiler Chrome traces (.json or "
                                                 ".json.gz), one per rank, or folders of them")],
    hardware: Annotated[str | None, typer.Option(
        "--hardware", "-H", help="Preset name or cluster YAML/JSON for plait's predictions "
        "(default or 'auto': detected from the trace's device; 'none' for no predictions)")
    ] = None,
    calibration: Annotated[Path | None, typer.Option(help="Calibration file to apply")] = None,
    top: Annotated[int, typer.Option(help="Rows shown per table")] = 10,
    every_rank: Annotated[bool, typer.Option(
        "--every-rank", help="With several traces: every rank in detail, not only the most "
        "exposed")] = False,
    by: Annotated[str | None, typer.Option(
        help="Also per record_function range whose name starts with this, e.g. 'layer' or "
        "'bench:'")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON "
                                                  "('-' for stdout)")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Write the first trace again with an 'exposed communication' track per device")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: where each device's time "
                                              "goes")] = None,
) -> None:
    """Measure exposed communication in your job's profiler trace, and plait's schedule per pair.

    Each exposed collective is matched with the GEMM it feeds or that feeds it, and plait's
    best schedule for the pair is predicted next to what it costs now.

    Record the trace with torch.profiler.profile(record_shapes=True) and
    prof.export_chrome_trace(path); on GPUs, NCCL/RCCL kernels are the communication.
    """
    from plait.analyze.analysis import analyze, detect_hardware
    from plait.analyze.kineto import read_trace
    from plait.report.analysis import plot_analysis, render, to_dict, write_exposed_trace

    console = console_for(json_out)
    console.width = max(console.width, 160)  # its tables are not fitted to the terminal yet
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        read = [read_trace(p) for p in _expand(traces)]
        if hardware in (None, "auto"):
            hardware = detect_hardware(read[0])
            if hardware is not None:
                console.print(f"hardware: {hardware} (detected from the trace; -H to change)")
        cluster = None
        if hardware not in (None, "none"):
            cluster = load_cluster(hardware, calibration)
        result = analyze(read, cluster, by)
        if not any(d.comms for t in result.traces for d in t.trace.devices):
            raise SpecError("trace", "no communication found (looked for NCCL/RCCL kernels, "
                            "peer memcopies and gloo work)",
                            "profile a distributed step, with the collectives inside the "
                            "profiled region")
    if json_out is not None and to_stdout(json_out):
        write_json(json_out, to_dict(result))
        return
    render(result, console, top, every_rank)
    if json_out is not None:
        write_json(json_out, to_dict(result), console)
    if trace is not None:
        written = write_exposed_trace(result.traces[0], trace)
        console.print(f"wrote {written} (open in ui.perfetto.dev)")
    if plot is not None:
        console.print(f"wrote {plot_analysis(result, plot)}")


def _expand(paths: list[Path]) -> list[Path]:
    """Folders stand for the traces in them (*.json, *.json.gz), in name order."""
    out = []
    for p in paths:
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            if not found:
                raise SpecError("trace", f"folder {str(p)!r} holds no .json or .json.gz trace",
                                "pass the folder the ranks exported their traces to")
            out += found
        else:
            out.append(p)
    return out
