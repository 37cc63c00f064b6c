"""The `plait` command line. Each command lives in its own module; this file only wires them."""

from __future__ import annotations

import typer

from plait.cli import analyze, bench, coexec, explore, presets, profile

app = typer.Typer(
    name="plait",
    help="Hide communication behind computation: plan, simulate, run, measure, calibrate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("explore")(explore.explore_command)
app.command("presets")(presets.presets_command)
app.command("bench")(bench.bench_command)
app.command("profile")(profile.profile_command)
app.command("analyze")(analyze.analyze_command)
app.add_typer(coexec.app, name="coexec")

if __name__ == "__main__":
    app()
