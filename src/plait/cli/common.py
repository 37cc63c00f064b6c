"""Shared CLI plumbing: turning plait's errors into clear messages and exit codes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import typer
from rich.console import Console

from plait.errors import InfeasibleError, SpecError

T = TypeVar("T")
err_console = Console(stderr=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """Report `SpecError`/`InfeasibleError` as one red line and exit with status 2."""
    try:
        yield
    except (SpecError, InfeasibleError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc


def call(fn: Callable[[], T]) -> T:
    with user_errors():
        return fn()
