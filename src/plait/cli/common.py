"""Shared CLI plumbing: turning plait's errors into clear messages and exit codes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

from plait.errors import InfeasibleError, SpecError

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
    """`run_ranks(world, fn, *args)` under a progress bar advanced by rank 0's reports;
    rank 0's result. A failed run prints why and exits with status 1."""
    from rich.progress import Progress

    from plait.runtime.launch import RankError, run_ranks

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        try:
            return run_ranks(world, fn, *args, timeout_s=timeout,
                             progress=lambda _rank, _msg: bar.advance(task))[0]
        except RankError as exc:
            console.print(f"[bold red]{label} failed:[/] {exc}")
            raise typer.Exit(1) from exc
