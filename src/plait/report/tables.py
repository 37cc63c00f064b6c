"""Tables that fit the terminal: columns carry a priority, and the least important are left out
(and named in the caption) until the rest fit the width, so no cell is cut."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    priority: int  # 0: always shown; higher: left out first
    right: bool = False  # right-justified (numbers)


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]],
                 width: int, elsewhere: str = "a wider terminal, or --json") -> Table:
    """A rich table of `rows` with as many of `columns` as fit in `width` characters; the
    caption names what was left out and `elsewhere` has it."""
    need = [max([len(c.header)] + [len(r[i]) for r in rows]) + 3 for i, c in enumerate(columns)]
    keep = list(range(len(columns)))
    for i in sorted(keep, key=lambda i: -columns[i].priority):
        if sum(need[k] for k in keep) + 1 <= width or columns[i].priority == 0:
            break
        keep.remove(i)
    dropped = [columns[i].header for i in range(len(columns)) if i not in keep]
    t = Table(title=title, title_justify="left",
              caption=(f"left out to fit {width} columns: {', '.join(dropped)} "
                       f"({elsewhere}, has them)") if dropped else None,
              caption_justify="left")
    for i in keep:
        t.add_column(columns[i].header, justify="right" if columns[i].right else "left",
                     no_wrap=True)
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    return t
