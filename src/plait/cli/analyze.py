"""`plait analyze`: how much communication nothing hides in your own job, from its profiler
trace, and what plait's schedules would save."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
    comm_kernel: Annotated[list[str] | None, typer.Option(
        "--comm-kernel", help="A regular expression over kernel names that are communication "
        "too (repeatable), beside the built-in rules (NCCL/RCCL, symmetric memory, "
        "userbuffers, DeepEP/NVSHMEM, peer memcopies)")] = None,
    steps: Annotated[str | None, typer.Option(
        help="Profiler steps to analyse: A:B (ProfilerStep#A to #B, inclusive), A:, :B, N, "
        "or 'all' (every event, in a step or not; default: every step)")] = None,
    drop_last: Annotated[bool | None, typer.Option(
        "--drop-last/--keep-last", help="Leave out the window's last step, or keep it (default: "
        "left out when it is an outlier, >1.5x the median communication or span of the "
        "others)", show_default=False)] = None,
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
    from plait.analyze.rules import user_rules
    from plait.report.analysis import plot_analysis, render, to_dict, write_exposed_trace

    console = console_for(json_out)
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        extra = user_rules(comm_kernel or ())
        read, skipped = _read_all(traces, extra)
        for note in skipped:
            console.print(f"note: {note}")
        if hardware in (None, "auto"):
            hardware = detect_hardware(read[0])
            if hardware is not None:
                console.print(f"hardware: {hardware} (detected from the trace; -H to change)")
        cluster = None
        if hardware not in (None, "none"):
            cluster = load_cluster(hardware, calibration)
        result = analyze(read, cluster, by, steps=steps, drop_last=drop_last)
        if not any(d.comms for t in result.traces for d in t.trace.devices):
            raise SpecError("trace", "no communication found (looked for: NCCL/RCCL, symmetric "
                            "memory, userbuffers and DeepEP/NVSHMEM kernels, peer memcopies, "
                            "gloo work" + (", --comm-kernel patterns" if extra else "")
                            + "); the kernels taking the most time: " + _top_kernels(result),
                            "if one of them is communication, pass --comm-kernel REGEX "
                            "matching its name; else profile a distributed step, with the "
                            "collectives inside the profiled region")
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


def _read_all(paths: list[Path], extra: Any) -> tuple[list[Any], list[str]]:
    """The traces `paths` name (folders: the *.json and *.json.gz in them, in name order), and
    notes on the files skipped: what plait analyze wrote itself (a JSON result, a `--trace`)
    when it is among other traces."""
    from plait.analyze.kineto import PlaitOutput, read_trace

    files: list[tuple[Path, bool]] = []  # (path, found in a folder)
    for p in paths:
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            if not found:
                raise SpecError("trace", f"folder {str(p)!r} holds no .json or .json.gz trace",
                                "pass the folder the ranks exported their traces to")
            files += [(f, True) for f in found]
        else:
            files.append((p, False))
    read, notes = [], []
    for f, in_folder in files:
        try:
            t = read_trace(f, extra)
        except PlaitOutput:
            if not in_folder and len(files) == 1:
                raise
            notes.append(f"{f} skipped: it is plait analyze's own JSON result")
            continue
        if len(files) > 1 and t.written_by_plait:
            notes.append(f"{f} skipped: plait analyze --trace wrote it")
            continue
        read.append(t)
    if not read:
        raise SpecError("trace", "every file given is plait analyze's own output",
                        "pass the traces torch.profiler wrote")
    return read, notes


def _top_kernels(result: Any, n: int = 5) -> str:
    rows = sorted((r for t in result.traces for r in t.kernels), key=lambda r: -r.time_us)
    return ", ".join(f"{r.kernel} ({r.time_us / 1e3:,.2f} ms)" for r in rows[:n]) or "none"
