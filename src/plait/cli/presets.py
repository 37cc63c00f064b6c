"""`plait presets`: the built-in models and hardware."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from plait.cli.common import user_errors
from plait.errors import SpecError


def presets_command(
    show: Annotated[str | None, typer.Option(
        "--show", help="Print every number of this hardware preset with its source")] = None,
) -> None:
    """List the built-in model and hardware presets."""
    from plait.report.presets import hardware_table, models_table, sources_table
    from plait.spec.hardware import HARDWARE_PRESETS

    console = Console()
    if show is not None:
        with user_errors():
            if show not in HARDWARE_PRESETS:
                raise SpecError("--show", f"no hardware preset {show!r}",
                                f"use one of {', '.join(HARDWARE_PRESETS)}")
        console.print(sources_table(show))
        return
    console.print(models_table(console.width))
    console.print(hardware_table(console.width))
