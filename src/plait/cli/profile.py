"""`plait profile`: measure this machine, write a calibration file (and plots)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress

from plait.cli.common import user_errors, writable
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.measure.profile import ProfilePlan


def profile_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Calibration file to write (YAML)")
                   ] = Path("out/calibration.yaml"),
    quick: Annotated[bool, typer.Option("--quick/--full", help="Small grid (minutes) or full")
                     ] = True,
    ranks: Annotated[int, typer.Option(help="Local gloo ranks to start (under torchrun: its "
                                       "ranks, NCCL on GPUs)")] = 2,
    local: Annotated[bool, typer.Option("--local", help="One device in this process (a GPU, or "
                                        "the CPU): GEMMs, splits, and contention with stand-in "
                                        "transfers; no link measurements")] = False,
    device: Annotated[str, typer.Option(help="With --local: cuda, cuda:N, cpu, or auto (a GPU "
                                        "when there is one)")] = "auto",
    dtypes: Annotated[str, typer.Option(help="Comma-separated: fp32,bf16")] = "fp32",
    repeats: Annotated[int, typer.Option(help="Timed repeats per item")] = 5,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset (or file) "
                                          "the calibration refines")] = "cpu",
    resume: Annotated[bool, typer.Option("--resume/--restart", help="Continue from the partial "
                                         "results of an interrupted run")] = True,
    plot: Annotated[Path | None, typer.Option(help="Folder for decomposition / contention "
                                              "PNGs")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds before the run is abandoned")] = 3600,
) -> None:
    """Measure GEMM splits, transfers per engine and contention; write a calibration file.
    (Co-execution block costs: `plait coexec profile`.)"""
    import torch.distributed as dist
    import yaml

    from plait.measure.profile import calibration_from, profile_rank
    from plait.runtime.launch import leave_group
    from plait.spec.calibration import load_calibration
    from plait.spec.hardware import load_hardware

    console = Console()
    under_torchrun = "WORLD_SIZE" in os.environ and not local
    with user_errors():
        writable(out=out)
        base = load_hardware(hardware)
        plan = _plan(quick, ranks, local, device, dtypes, repeats, under_torchrun)
    partial = out.with_suffix(out.suffix + ".partial.json")
    measured: dict[str, Any] = {}
    if resume and partial.exists():  # every rank reads it: they all skip the same items
        with user_errors():
            measured = _partial(partial)
        console.print(f"resuming: {len(measured)} items already measured in {partial}")
    if under_torchrun and dist.get_rank() != 0:  # rank 0 reports and writes
        profile_rank(dist.get_rank(), plan.ranks, plan, frozenset(measured), lambda _item: None)
        leave_group()
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    _measure(console, plan, measured, partial, under_torchrun, timeout)
    if under_torchrun:
        leave_group()  # every rank measured its last item: the group is done
    command = "plait " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if \
        sys.argv[0].endswith(("plait", "__main__.py")) else "plait profile"
    if under_torchrun:
        command = f"torchrun --nproc-per-node {plan.ranks} -m {command}"
    doc = calibration_from(measured, plan, base, command)
    out.write_text(yaml.safe_dump(doc, sort_keys=False, width=100, default_flow_style=None))
    with user_errors():
        load_calibration(out).apply(base)  # what we wrote must load and validate
    partial.unlink(missing_ok=True)
    console.print(f"wrote {out}")
    if plot is not None:
        from plait.report.plots import plot_profile

        for p in plot_profile(doc, plot):
            console.print(f"wrote {p}")


def _partial(path: Path) -> dict[str, Any]:
    """The items an interrupted run measured, as it saved them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise SpecError("resume", f"{path} is not a saved profile: {type(exc).__name__}",
                        "delete it, or run with --restart") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SpecError("resume", f"{path} holds a {type(data).__name__}, not saved items",
                        "delete it, or run with --restart")
    return data


def _plan(quick: bool, ranks: int, local: bool, device: str, dtypes: str, repeats: int,
          under_torchrun: bool) -> ProfilePlan:
    """What to measure, and where, from the options (bad ones: a `SpecError` naming them).
    Under torchrun: its ranks and their devices (GPUs with NCCL, else CPUs with gloo)."""
    import torch
    import torch.distributed as dist

    from plait.measure.profile import DTYPES, ProfilePlan
    from plait.runtime.launch import init_from_env

    names = tuple(d.strip() for d in dtypes.split(","))
    for d in names:
        if d not in DTYPES:
            raise SpecError("dtypes", f"{d!r} is not measurable", f"use {', '.join(DTYPES)}")
    if under_torchrun:
        device, ranks = init_from_env().type, dist.get_world_size()
    elif device == "auto":
        device = "cuda" if local and torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (local or under_torchrun):
        raise SpecError("device", f"{device} needs --local, or torchrun for several GPUs "
                        "(started ranks run on CPU gloo)",
                        "add --local, or run under torchrun --nproc-per-node N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError("device", f"{device}: no CUDA device here",
                        "use --device cpu, or run on a machine with a GPU")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SpecError("device", f"{device!r} is not a device", "use cpu, cuda or cuda:N")
    return ProfilePlan(quick=quick, ranks=ranks, dtypes=names, repeats=repeats, local=local,
                       device=device)


def _measure(console: Console, plan: ProfilePlan, measured: dict[str, Any], partial: Path,
             under_torchrun: bool, timeout: float) -> None:
    """Measure the items not yet in `measured` under a progress bar, saving each as it comes
    (a failed run keeps them for --resume)."""
    from plait.measure.profile import profile_local, profile_rank
    from plait.runtime.launch import RankError, run_ranks

    todo = [k for k in plan.items() if k not in measured]
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
            profile_local(plan, frozenset(measured), lambda item: got(0, item))
        elif todo and under_torchrun:
            profile_rank(0, plan.ranks, plan, frozenset(measured), lambda item: got(0, item))
        elif todo:
            try:
                run_ranks(plan.ranks, profile_rank, plan, frozenset(measured),
                          timeout_s=timeout, progress=got)
            except RankError as exc:
                console.print(f"[bold red]profile failed:[/] {exc}\npartial results kept in "
                              f"{partial}; run the same command again to resume")
                raise typer.Exit(1) from exc
