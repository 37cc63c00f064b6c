"""`plait analyze`: how much communication nothing hides in your own job, from its profiler
trace, and what plait's schedules would save."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import console_for, load_cluster, to_stdout, user_errors, write_json
from plait.cli.options import OUTPUTS, Values, takes

Traces = Annotated[list[Path], typer.Argument(help="torch.profiler Chrome traces (.json or "
                                              ".json.gz), one per rank, or folders of them")]
Hardware = Annotated[str | None, typer.Option(
    "--hardware", "-H", help="Preset name or cluster YAML/JSON for plait's predictions "
    "(default or 'auto': detected from the trace's device; 'none' for no predictions)")]
Calibration = Annotated[Path | None, typer.Option(help="Calibration file to apply")]
Top = Annotated[int, typer.Option(help="Rows shown per table")]
EveryRank = Annotated[bool, typer.Option(
    "--every-rank", help="With several traces: every rank in detail, not only the most exposed")]
By = Annotated[str | None, typer.Option(
    help="Also per record_function range whose name starts with this, e.g. 'layer' or 'bench:'")]
CommKernel = Annotated[list[str] | None, typer.Option(
    "--comm-kernel", help="A regular expression over kernel names that are communication "
    "too (repeatable), beside the built-in rules (NCCL/RCCL, symmetric memory, "
    "userbuffers, DeepEP/NVSHMEM, peer memcopies)")]
Steps = Annotated[str | None, typer.Option(
    help="Profiler steps to analyse: A:B (ProfilerStep#A to #B, inclusive), A:, :B, N, "
    "or 'all' (every event, in a step or not; default: every step)")]
DropLast = Annotated[bool | None, typer.Option(
    "--drop-last/--keep-last", help="Leave out the window's last step, or keep it (default: "
    "left out when it is an outlier, >1.5x the median communication or span of the "
    "others)", show_default=False)]
DropFirst = Annotated[bool | None, typer.Option(
    "--drop-first/--keep-first", help="Leave out the window's first step, or keep it (default: "
    "left out when it is an outlier, as for the last)", show_default=False)]
Plan = Annotated[Path | None, typer.Option(
    "--plan", help="A plan written by `plait explore --json` or `plait tune --json`: grade "
    "plait's calls against the schedules it chose for them")]
ExpectCopyEngines = Annotated[bool, typer.Option(
    "--expect-copy-engines", help="The job asked NCCL for copy-engine collectives (its "
    "zero-CTA policy, NCCL_CTA_POLICY=2): name NCCL all-gathers and all-to-alls that ran "
    "as SM kernels")]
ANALYZE_OUTPUTS = OUTPUTS.helps(
    trace="Write the first trace again with an 'exposed communication' track per device",
    plot="Write a PNG: where each device's time goes")


@takes(outputs=ANALYZE_OUTPUTS)
def analyze_command(
    traces: Traces, hardware: Hardware = None, calibration: Calibration = None, top: Top = 10,
    every_rank: EveryRank = False, by: By = None, comm_kernel: CommKernel = None,
    steps: Steps = None, drop_last: DropLast = None, drop_first: DropFirst = None,
    plan: Plan = None, expect_copy_engines: ExpectCopyEngines = False, *, outputs: Values,
) -> None:
    """Measure exposed communication in your job's profiler trace, and plait's schedule per pair.

    Each exposed collective is matched with the GEMM it feeds or that feeds it, and plait's
    best schedule for the pair is predicted next to what it costs now.

    Record the trace with torch.profiler.profile(record_shapes=True) and
    prof.export_chrome_trace(path); on GPUs, NCCL/RCCL kernels are the communication.
    """
    from plait.analyze.analysis import analyze, detect_hardware, require_communication
    from plait.analyze.grade import read_plan
    from plait.analyze.kineto import read_paths
    from plait.analyze.rules import user_rules
    from plait.report.analysis import plot_analysis, render, to_dict, write_exposed_trace

    console = console_for(outputs.json_out)
    with user_errors():
        extra = user_rules(comm_kernel or ())
        read, skipped = read_paths(traces, extra)
        for note in skipped:
            console.print(f"note: {note}")
        if hardware in (None, "auto"):
            hardware = detect_hardware(read[0])
            if hardware is not None:
                console.print(f"hardware: {hardware} (detected from the trace; -H to change)")
        cluster = None if hardware in (None, "none") else load_cluster(hardware, calibration)
        planned = () if plan is None else read_plan(plan)
        result = analyze(read, cluster, by, steps=steps, drop_last=drop_last,
                         drop_first=drop_first, plan=planned,
                         expect_copy_engines=expect_copy_engines)
        require_communication(result, bool(extra))
    if to_stdout(outputs.json_out):
        write_json(outputs.json_out, to_dict(result))
        return
    render(result, console, top, every_rank)
    if outputs.json_out is not None:
        write_json(outputs.json_out, to_dict(result), console)
    if outputs.trace is not None:
        written = write_exposed_trace(result.traces[0], outputs.trace)
        console.print(f"wrote {written} (open in ui.perfetto.dev)")
    if outputs.plot is not None:
        console.print(f"wrote {plot_analysis(result, outputs.plot)}")
