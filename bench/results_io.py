"""Where a benchmark writes: `out/<name>` by default, the committed `bench/results/<name>`
only when asked (`--save`), so a casual run never rewrites the figures the README quotes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--save", action="store_true",
                    help="update the committed result in bench/results/ (default: out/)")
    return ap


def write(name: str, doc: dict[str, Any], save: bool) -> Path:
    """Write `doc` (with the date and the command that ran) as JSON; returns the path."""
    path = ROOT / ("bench/results" if save else "out") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join([Path(sys.argv[0]).relative_to(ROOT).as_posix()
                                if Path(sys.argv[0]).is_absolute() else sys.argv[0],
                                *sys.argv[1:]])
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": cmd, **doc},
                               indent=2))
    print(f"wrote {path}")
    return path
