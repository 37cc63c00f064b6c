"""The `plait` command line. Each command lives in its own module; this file only wires them."""

from __future__ import annotations

from typing import Annotated

import typer

from plait import __version__
from plait.cli import analyze, bench, coexec, doctor, explore, plan, presets, profile, tune
from plait.cli.common import err_console
from plait.errors import UnsupportedTorch

app = typer.Typer(
    name="plait",
    help="Hide communication behind computation: plan, simulate, run, measure, calibrate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    invoke_without_command=True,
    rich_markup_mode="markdown",  # a docstring's paragraphs flow to the terminal's width
)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", help="Print plait's version and "
                                                "exit", is_eager=True)] = False) -> None:
    """Hide communication behind computation: plan, simulate, run, measure, calibrate."""
    if version:
        print(f"plait {__version__}")
        raise typer.Exit()


app.command("explore")(explore.explore_command)
app.command("plan")(plan.plan_command)
app.command("presets")(presets.presets_command)
app.command("bench")(bench.bench_command)
app.command("profile")(profile.profile_command)
app.command("tune")(tune.tune_command)
app.command("analyze")(analyze.analyze_command)
app.command("doctor")(doctor.doctor_command)
app.add_typer(coexec.app, name="coexec")

def main() -> None:
    """`plait`: the commands, and a torch plait does not run on said in one line (exit 2),
    wherever a command first imports the runtime."""
    try:
        app()
    except UnsupportedTorch as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
