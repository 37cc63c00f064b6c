"""`plait presets`: the built-in models and hardware."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from plait.cli.common import user_errors
from plait.errors import SpecError


def presets_command(
    show: Annotated[str | None, typer.Option(
        "--show", help="Print every number of this hardware preset with its source")] = None,
) -> None:
    """List the built-in model and hardware presets."""
    from plait.spec.hardware import HARDWARE_PRESETS
    from plait.spec.model import MODEL_PRESETS

    console = Console()
    if show is not None:
        with user_errors():
            if show not in HARDWARE_PRESETS:
                raise SpecError("--show", f"no hardware preset {show!r}",
                                f"use one of {', '.join(HARDWARE_PRESETS)}")
        _show(console, show)
        return
    models = Table(title="models", title_justify="left")
    for col in ("name", "layers", "hidden", "heads", "kv", "ffn", "vocab", "moe"):
        models.add_column(col)
    for name, make in MODEL_PRESETS.items():
        m = make()
        moe = f"{m.moe.experts}e top{m.moe.top_k}" if m.moe else "—"
        models.add_row(name, str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads),
                       str(m.ffn), str(m.vocab), moe)
    hw = Table(title="hardware", title_justify="left")
    for col in ("name", "gpu", "bf16 TFLOP/s", "HBM TB/s", "units", "topology", "GB/s/dir"):
        hw.add_column(col)
    for name, make_cluster in HARDWARE_PRESETS.items():
        c = make_cluster()
        links = c.topology.links_per_gpu if c.topology.kind == "mesh" else 1
        hw.add_row(name, c.gpu.name, f"{c.gpu.peak_flops.get('bf16', 0) / 1e12:.0f}",
                   f"{c.gpu.hbm_bytes_per_s / 1e12:.2f}", str(c.gpu.compute_units),
                   f"{c.gpus_per_node}x {c.topology.kind}",
                   f"{links} x {c.topology.link_bytes_per_s / 1e9:.0f}")
    console.print(models)
    console.print(hw)


def _show(console: Console, name: str) -> None:
    from plait.spec.hardware import HARDWARE_PRESETS
    from plait.spec.sources import numbers, sources

    c = HARDWARE_PRESETS[name]()
    found = sources(name)
    t = Table(title=f"{name} ({c.gpu.name}, {c.gpus_per_node}x {c.topology.kind}): every "
              "number and its source (SI units: s, bytes/s, FLOP/s)", title_justify="left")
    t.add_column("field", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    t.add_column("source")  # wraps: the one column that may take several lines
    for path, value in numbers(c.model_dump()).items():
        t.add_row(path, f"{value:.6g}", found.get(path, "no source recorded"))
    console.print(t)
