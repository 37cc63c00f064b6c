"""`plait profile`: measure this machine, write a calibration file (and plots)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress

from plait.cli.common import user_errors, writable
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.measure.profile import ProfilePlan


Out = Annotated[Path, typer.Option("--out", "-o", help="Calibration file to write (YAML)")]
Quick = Annotated[bool, typer.Option("--quick/--full", help="Small grid (minutes) or full")]
Ranks = Annotated[int, typer.Option(help="Local gloo ranks to start (under torchrun: its ranks, "
                                    "NCCL on GPUs)")]
Local = Annotated[bool, typer.Option("--local", help="One device in this process (a GPU, or the "
                                     "CPU): GEMMs, splits, and contention with stand-in "
                                     "transfers; no link measurements")]
Device = Annotated[str, typer.Option(help="With --local: cuda, cuda:N, cpu, or auto (a GPU when "
                                     "there is one)")]
Dtypes = Annotated[str, typer.Option(help="Comma-separated: fp32,bf16")]
Repeats = Annotated[int, typer.Option(help="Timed repeats per item")]
Hardware = Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset (or file) the "
                                       "calibration refines")]
Resume = Annotated[bool, typer.Option("--resume/--restart", help="Continue from the partial "
                                      "results of an interrupted run")]
Plot = Annotated[Path | None, typer.Option(help="Folder for decomposition / contention PNGs")]
Timeout = Annotated[float, typer.Option(help="Seconds before the run is abandoned")]


def profile_command(
    out: Out = Path("out/calibration.yaml"), quick: Quick = True, ranks: Ranks = 2,
    local: Local = False, device: Device = "auto", dtypes: Dtypes = "fp32", repeats: Repeats = 5,
    hardware: Hardware = "cpu", resume: Resume = True, plot: Plot = None,
    timeout: Timeout = 3600,
) -> None:
    """Measure GEMM splits, transfers per engine and contention; write a calibration file.
    (Co-execution block costs: `plait coexec profile`.)"""
    import torch.distributed as dist

    from plait.measure.profile import (
        calibration_from,
        command_line,
        profile_plan,
        profile_rank,
        read_partial,
    )
    from plait.runtime.launch import leave_group
    from plait.spec.calibration import save_calibration
    from plait.spec.hardware import load_hardware

    console = Console()
    under_torchrun = "WORLD_SIZE" in os.environ and not local
    with user_errors():
        writable(out=out)
        if not (timeout > 0 and timeout != float("inf")):
            raise SpecError("timeout", f"{timeout} s", "use a positive number of seconds")
        base = load_hardware(hardware)
        plan = profile_plan(quick, ranks, local, device, dtypes, repeats, under_torchrun)
    partial = out.with_suffix(out.suffix + ".partial.json")
    measured: dict[str, Any] = {}
    if resume and partial.exists():  # every rank reads it: they all skip the same items
        with user_errors():
            measured = read_partial(partial)
        console.print(f"resuming: {len(measured)} items already measured in {partial}")
    if under_torchrun and dist.get_rank() != 0:  # rank 0 reports and writes
        profile_rank(dist.get_rank(), plan.ranks, plan, plan.todo(measured), lambda _item: None)
        leave_group()
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    _measure(console, plan, measured, partial, under_torchrun, timeout)
    if under_torchrun:
        leave_group()  # every rank measured its last item: the group is done
    doc = calibration_from(measured, plan, base, command_line(plan, under_torchrun))
    with user_errors():
        save_calibration(doc, out, base)
    partial.unlink(missing_ok=True)
    console.print(f"wrote {out}")
    if plot is not None:
        from plait.report.plots import plot_profile

        for p in plot_profile(doc, plot):
            console.print(f"wrote {p}")


def _measure(console: Console, plan: ProfilePlan, measured: dict[str, Any], partial: Path,
             under_torchrun: bool, timeout: float) -> None:
    """Measure the items not yet in `measured` under a progress bar, saving each as it comes
    (a failed run keeps them for --resume)."""
    from plait.measure.profile import profile_local, profile_rank
    from plait.runtime.launch import RankError, run_ranks

    todo = plan.todo(measured)
    with Progress(console=console) as bar:
        where = f"one {plan.device} device" if plan.local else \
            f"{plan.ranks} {plan.device} ranks"
        task = bar.add_task(f"profiling on {where}", total=len(plan.items()),
                            completed=len(plan.items()) - len(todo))

        def got(_rank: int, item: tuple[str, Any]) -> None:
            key, value = item
            measured[key] = value
            partial.write_text(json.dumps(measured))
            bar.update(task, advance=1, description=f"profiling: {key}")

        if todo and plan.local:
            profile_local(plan, todo, lambda item: got(0, item))
        elif todo and under_torchrun:
            profile_rank(0, plan.ranks, plan, todo, lambda item: got(0, item))
        elif todo:
            try:
                run_ranks(plan.ranks, profile_rank, plan, todo,
                          timeout_s=timeout, progress=got)
            except RankError as exc:
                console.print(f"[bold red]profile failed:[/] {exc}\npartial results kept in "
                              f"{partial}; run the same command again to resume")
                raise typer.Exit(1) from exc
