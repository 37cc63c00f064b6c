"""Shared CLI plumbing: errors as one clear line and an exit code, ranks under a progress bar,
the cluster from hardware + calibration, JSON output, outputs checked before any work. The
options several commands share are spelled once in `options.py`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from plait.errors import InfeasibleError, SpecError

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec
    from plait.spec.layout import ParallelSpec

err_console = Console(stderr=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """Report `SpecError`/`InfeasibleError` as one red line and exit with status 2."""
    try:
        yield
    except (SpecError, InfeasibleError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc


def run_with_progress(console: Console, label: str, total: int | None, world: int,
                      fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """`run_ranks(world, fn, *args)` under a progress bar advanced by rank 0's reports
    (`progress_bar`); rank 0's result. A failed run prints why and exits with status 1."""
    from plait.runtime.launch import RankError, run_ranks

    with progress_bar(console, label, total) as done:
        try:
            return run_ranks(world, fn, *args, timeout_s=timeout,
                             progress=lambda _rank, msg: done(str(msg)))[0]
        except RankError as exc:
            console.print(f"[bold red]{label} failed:[/] {exc}")
            raise typer.Exit(1) from exc


@contextmanager
def progress_bar(console: Console, label: str, total: int | None
                 ) -> Iterator[Callable[[str], None]]:
    """Progress on `console`: a bar on a terminal (gone when done), else a line at the start,
    at every tenth of the work or every 10 s, and at the end (a job's log, a pipe); the
    callback advances it and says what was just done."""
    if not console.is_terminal:
        lines = ProgressLines(console, label, total)
        yield lines.advance
        lines.finish()
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda what: bar.update(task, advance=1, description=f"{label}: {what}")


class ProgressLines:
    """`progress_bar` where no bar is drawn: lines, never more often than every tenth of the
    work or `every_s` seconds."""

    def __init__(self, console: Console, label: str, total: int | None,
                 every_s: float = 10.0) -> None:
        self.console, self.label, self.total, self.every_s = console, label, total, every_s
        self.done, self.start = 0, time.monotonic()
        self.last_s, self.last_tenth = self.start, 0
        console.print(f"{label}: started" + (f", {total} steps" if total else ""))

    def advance(self, what: str = "") -> None:
        self.done += 1
        now = time.monotonic()
        tenth = 10 * self.done // self.total if self.total else 0
        if tenth > self.last_tenth or now - self.last_s >= self.every_s:
            self.last_tenth, self.last_s = tenth, now
            of = f"/{self.total}" if self.total else ""
            self.console.print(f"{self.label}: {self.done}{of} after {now - self.start:.0f} s"
                               + (f" ({what})" if what else ""))

    def finish(self) -> None:
        self.console.print(f"{self.label}: done, {self.done} steps in "
                           f"{time.monotonic() - self.start:.0f} s")


def load_cluster(hardware: str, calibration: Path | None = None,
                 nodes: int | None = None) -> ClusterSpec:
    """The cluster a command predicts for: a preset or file, refined by a calibration file,
    with `nodes` nodes (default: the cluster's own count)."""
    from plait.spec.calibration import load_calibration
    from plait.spec.hardware import load_hardware

    cluster = load_hardware(hardware)
    if calibration is not None:  # every header that names the cluster names it too
        cal = load_calibration(calibration)
        base = cal.meta.get("hardware_base")
        if base is not None and base != cluster.name:
            err_console.print(f"[yellow]warning:[/] {calibration.name} was measured for "
                              f"'{base}' ({cal.meta.get('device', 'unknown device')}); applying "
                              f"it to '{cluster.name}'")
        cluster = cal.apply(cluster)
        cluster = cluster.with_(name=f"{cluster.name}{CALIBRATED_BY}{calibration.name}")
    return cluster if nodes is None else cluster.with_(nodes=nodes)


CALIBRATED_BY = ", calibrated by "


def cluster_label(cluster: ClusterSpec) -> str:
    """The cluster as a picture's header names it: with its calibration (`load_cluster` puts
    that in the name), or saying it has none."""
    return cluster.name if CALIBRATED_BY in cluster.name else f"{cluster.name} (no calibration)"


def console_for(json_out: Path | None) -> Console:
    """Where a command's tables and messages go: standard output, or standard error when the
    JSON document goes to standard output (`--json -`), so that stdout is clean JSON."""
    return Console(stderr=to_stdout(json_out))


def writable(**outputs: Path | None) -> None:
    """Fail before any work when an output path (`--<name>`) cannot be written (its folder is
    made)."""
    for name, path in outputs.items():
        option = f"--{name}"
        if path is None or to_stdout(path):
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            ok = os.access(path.parent, os.W_OK) and not path.is_dir()
        except OSError:
            ok = False
        if not ok:
            raise SpecError(option, f"cannot write {path}", "choose a writable file path")


def to_stdout(path: Path | None) -> bool:
    """`--json -`: the document goes to standard output instead of a file (and nothing else)."""
    return path is not None and str(path) == "-"


def write_json(path: Path, doc: Any, console: Console | None = None, indent: int | None = 2
               ) -> None:
    """Write `doc` as JSON to `path` (folders made; `-`: standard output), and say so."""
    text = json.dumps(doc, indent=indent)
    if to_stdout(path):
        print(text)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        err_console.print(f"[bold red]error:[/] --json: cannot write {path}: "
                          f"{exc.strerror or exc}. Fix: choose a writable path")
        raise typer.Exit(2) from exc
    if console is not None:
        console.print(f"wrote {path}")


def parallel_spec(**fields: Any) -> ParallelSpec:
    """A validated `ParallelSpec` from the command's options (`micro_batches` is its
    `num_micro_batches`); a bad value is a `SpecError` naming the field."""
    from plait.spec.io import validate
    from plait.spec.layout import ParallelSpec

    if "micro_batches" in fields:
        fields["num_micro_batches"] = fields.pop("micro_batches")
    return validate(ParallelSpec, fields, "parallel")


def check_fits(par: ParallelSpec, cluster: ClusterSpec) -> None:
    """Refuse a layout that needs more GPUs than the cluster has."""
    if par.world > cluster.gpus_per_node * cluster.nodes:
        raise SpecError("parallel", f"tp*cp*pp*dp={par.world} GPUs exceed the "
                        f"{cluster.gpus_per_node * cluster.nodes} of {cluster.name}",
                        "raise --nodes or shrink the parallel sizes")
