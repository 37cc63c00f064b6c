"""Presenting `plait doctor`: the checklist, a row a check, the status in colour."""

from __future__ import annotations

from typing import Any

from rich.table import Table

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "not checked": "dim"}


def doctor_table(doc: dict[str, Any]) -> Table:
    t = Table(title=f"plait doctor: what decides whether overlap can happen here (plait "
              f"{doc['plait_version']}, Python {doc['python']}, {doc['machine']})",
              title_justify="left")
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("found", overflow="fold")
    t.add_column("what it means", overflow="fold")
    for c in doc["checks"]:
        means = c["means"]
        if c["name"] == "environment" and c["status"] == "ok":  # its names: in the caption
            means = "none of the variables named below is set so"
        t.add_row(c["name"], f"[{STYLE[c['status']]}]{c['status']}[/]", c["found"], means)
    counts = {s: sum(c["status"] == s for c in doc["checks"]) for s in STYLE}
    # the variables' names below the table, where they wrap between names, not inside one
    t.caption = ", ".join(f"{n} {s}" for s, n in counts.items() if n) + (
        "; environment variables checked: " + ", ".join(doc["environment_checked"])
        if doc.get("environment_checked") else "")
    t.caption_justify = "left"
    return t
