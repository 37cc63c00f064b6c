"""The CLI reference as Markdown, generated from the commands themselves (their docstrings,
options, defaults and help), so the documentation cannot drift from the CLI.

`python -m plait.cli.reference` prints it; the docs site builds its `cli.md` page from it.
"""

from __future__ import annotations

import re
from typing import Any

import typer


def _rows(command: Any, ctx: Any) -> list[tuple[str, str]]:
    """(option spelling, help) for every visible parameter of a command, arguments first."""
    rows = []
    for p in command.params:
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            many = " ..." if p.nargs == -1 else ""
            rows.append((f"{p.name.upper()}{many}", "required" if p.required else "optional"))
        else:
            record = p.get_help_record(ctx)
            if record is not None:
                rows.append(record)
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _command(lines: list[str], path: str, command: Any, parent: Any) -> None:
    name = path.split()[-1]
    ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
    subcommands = getattr(command, "commands", None)
    lines += [f"## `{path}`", ""]
    doc = (command.help or "").strip()
    if doc:
        lines += [doc, ""]
    if subcommands:
        for sub_name, sub in subcommands.items():
            first = (sub.help or "").strip().splitlines()[0] if sub.help else ""
            lines.append(f"- [`{path} {sub_name}`](#{_anchor(f'{path} {sub_name}')}): {first}")
        lines.append("")
        for sub_name, sub in subcommands.items():
            _command(lines, f"{path} {sub_name}", sub, ctx)
        return
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    lines += ["```", usage, "```", ""]
    rows = _rows(command, ctx)
    if rows:
        lines += ["| option | meaning |", "|---|---|"]
        lines += [f"| `{_cell(opt)}` | {_cell(help_)} |" for opt, help_ in rows]
        lines.append("")


def _anchor(title: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading `title` (in code)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def markdown_reference(app: typer.Typer) -> str:
    """Every command of `app` (subcommands included): its docstring, usage and options."""
    root: Any = typer.main.get_command(app)  # a group: its commands by name
    ctx = root.make_context("plait", [], resilient_parsing=True)
    lines = ["# CLI reference", "",
             "Generated from the commands themselves (`python -m plait.cli.reference`); "
             "`plait COMMAND --help` prints the same.", ""]
    for name, command in root.commands.items():
        _command(lines, f"plait {name}", command, ctx)
    return "\n".join(lines)


if __name__ == "__main__":
    from plait.cli.main import app as plait_app

    print(markdown_reference(plait_app))
