"""Writing a Chrome/Perfetto trace document: gzip-compressed when the name ends in `.gz` (as
`plait analyze` and the profiler read them), plain JSON otherwise."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def write_trace(path: str | Path, doc: Any) -> Path:
    """Write `doc` to `path` (folders made), compressed when the name says `.gz`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc)
    if out.suffix == ".gz":
        with gzip.open(out, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        out.write_text(text)
    return out
