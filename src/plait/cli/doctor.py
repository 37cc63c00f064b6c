"""`plait doctor`: the environment and libraries that decide whether overlap can happen."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import console_for, to_stdout, user_errors, writable, write_json


def doctor_command(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the checks as JSON ('-' "
                                                  "for stdout)")] = None,
) -> None:
    """Check torch, NCCL, the driver, symmetric memory, peer access, multicast and the
    environment variables that serialize streams; say what could not be checked here."""
    from plait.measure.doctor import run_checks
    from plait.report.doctor import doctor_table

    console = console_for(json_out)
    with user_errors():
        writable(json=json_out)
    doc = run_checks(os.environ)
    if not to_stdout(json_out):
        console.print(doctor_table(doc))
    if json_out is not None:
        write_json(json_out, doc, None if to_stdout(json_out) else console)
