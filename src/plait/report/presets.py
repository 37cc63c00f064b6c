"""Presenting the presets: the built-in models and hardware, and every number of one hardware
preset with its source."""

from __future__ import annotations

from rich.table import Table

from plait.cost.host import CALLS, EXECUTORS
from plait.report.tables import Column, fitted_table


def models_table(width: int) -> Table:
    from plait.spec.model import MODEL_PRESETS

    cols = (Column("name", 0), Column("layers", 0, True), Column("hidden", 0, True),
            Column("heads", 1, True), Column("kv", 1, True), Column("ffn", 0, True),
            Column("vocab", 2, True), Column("moe", 0))
    rows = []
    for name, make in MODEL_PRESETS.items():
        m = make()
        moe = f"{m.moe.experts}e top{m.moe.top_k}" if m.moe else "—"
        rows.append((name, str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads),
                     str(m.ffn), str(m.vocab), moe))
    return fitted_table("models", cols, rows, width, "a wider terminal")


def hardware_table(width: int) -> Table:
    from plait.spec.hardware import HARDWARE_PRESETS

    cols = (Column("name", 0), Column("gpu", 0), Column("bf16 TFLOP/s", 0, True),
            Column("HBM TB/s", 1, True), Column("units", 2, True), Column("topology", 0),
            Column("GB/s/dir", 0, True))
    rows = []
    for name, make_cluster in HARDWARE_PRESETS.items():
        c = make_cluster()
        links = c.topology.links_per_gpu if c.topology.kind == "mesh" else 1
        rows.append((name, c.gpu.name, f"{c.gpu.peak_flops.get('bf16', 0) / 1e12:.0f}",
                     f"{c.gpu.hbm_bytes_per_s / 1e12:.2f}", str(c.gpu.compute_units),
                     f"{c.gpus_per_node}x {c.topology.kind}",
                     f"{links} x {c.topology.link_bytes_per_s / 1e9:.0f}"))
    return fitted_table("hardware", cols, rows, width, "a wider terminal")


def sources_table(name: str) -> Table:
    """Every number of hardware preset `name`, with its public source or why it is an
    estimate; the source column wraps (the one column that may take several lines)."""
    from plait.spec.hardware import HARDWARE_PRESETS
    from plait.spec.sources import numbers, sources

    c = HARDWARE_PRESETS[name]()
    found = sources(name)
    t = Table(title=f"{name} ({c.gpu.name}, {c.gpus_per_node}x {c.topology.kind}): every "
              "number and its source (SI units: s, bytes/s, FLOP/s)", title_justify="left")
    t.add_column("field", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    t.add_column("source")
    for path, value in numbers(c.model_dump()).items():
        t.add_row(path, f"{value:.6g}", found.get(path, "no source recorded"))
    for key, ex in EXECUTORS.items():  # host calls per op, times params.host_call_s
        for field in CALLS:
            t.add_row(f"host_calls.{key}.{field}", str(getattr(ex, field)),
                      ex.source if field == CALLS[0] else "as above")
    return t
