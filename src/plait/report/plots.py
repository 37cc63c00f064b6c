"""PNG pictures of measurements and plans: decomposition-loss curves, contention heat map,
predicted-vs-measured scatter, schedule map."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG (folders created) and close it."""
    plt = pyplot()
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (imported only when drawing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(doc: dict[str, Any], folder: str | Path) -> list[Path]:
    """Decomposition-loss curves and the contention heat map of a calibration document."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items: dict[str, Any] = doc.get("measurements", {}).get("items", {})
    written = []
    # 1. Decomposition loss: split time / whole time - 1, per shape and axis.
    curves: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for key, v in items.items():
        if key.startswith("split/"):
            _, dt, m, n, k, ax, parts = key.split("/")
            whole = items.get(f"gemm/{dt}/{m}/{n}/{k}") or _whole(items, dt, m, n, k)
            if whole:
                curves[(f"{dt} {m}x{n}x{k}", ax)][int(parts)] = v / whole - 1
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (shape, axis), pts in sorted(curves.items()):
            xs = sorted(pts)
            ax.plot(xs, [100 * pts[x] for x in xs], marker="o",
                    linestyle="-" if axis == "M" else "--", label=f"{shape} split {axis}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pieces")
        ax.set_ylabel("decomposition loss (%)")
        ax.set_title(f"GEMM decomposition loss — {doc['meta'].get('device', '')}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(save_figure(fig, folder / "decomposition_loss.png"))
    # 2. Contention heat map: per engine and size, the GEMM's and the transfer's slowdown
    #    (their rates beside each other, as the calibration derived them).
    cells: dict[tuple[str, int], tuple[float, float]] = {}
    for key, r in doc.get("measurements", {}).get("contention_rates", {}).items():
        eng, kb = key.split("/")
        c = r["comm_rate"]
        cells[(eng, int(kb))] = (100 * (1 / r["gemm_rate"] - 1),
                                 float("nan") if c is None else 100 * (1 / c - 1))
    if cells:
        sizes = sorted({kb for _, kb in cells})
        engines = [e for e in ("sm", "dma", "d2d") if any(e == x for x, _ in cells)]
        rows = [(e, side) for e in engines for side in (0, 1)]
        grid = [[cells.get((e, kb), (float("nan"),) * 2)[side] for kb in sizes]
                for e, side in rows]
        fig, ax = plt.subplots(figsize=(3.5 + 1.3 * len(sizes), 3.2))
        im = ax.imshow(grid, cmap="magma_r", aspect="auto", vmin=0)
        ax.set_xticks(range(len(sizes)), [f"{kb} KiB" for kb in sizes])
        ax.set_yticks(range(len(rows)), [f"GEMM beside {e} transfer" if side == 0 else
                                         f"{e} transfer beside GEMM" for e, side in rows])
        top = max((x for r in grid for x in r if x == x), default=1.0)
        for i, row in enumerate(grid):
            for j, val in enumerate(row):
                text = "too short\nto tell" if val != val else f"+{val:.0f}%"
                ax.text(j, i, text, ha="center", va="center", fontsize=8,
                        color="white" if val == val and val > 0.6 * top else "black")
        fig.colorbar(im, ax=ax, label="time slowdown (%)")
        ax.set_title("contention: slowdown when run together", fontsize=9)
        written.append(save_figure(fig, folder / "contention.png"))
    return written


def _whole(items: dict[str, Any], dt: str, m: str, n: str, k: str) -> float | None:
    return items.get(f"split/{dt}/{m}/{n}/{k}/M/1")


def plot_predicted_vs_measured(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Scatter of predicted against measured times (log-log), one point per schedule run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs = [1e3 * r["measured_s"] for r in rows]
    ys = [1e3 * r["predicted_s"] for r in rows]
    ax.scatter(xs, ys, s=12, alpha=0.7)
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=8)
    return save_figure(fig, path)


def plot_schedule_map(cells: dict[tuple[int, float], str], path: str | Path, title: str,
                      xlabel: str = "M (tokens)", ylabel: str = "communication bytes",
                      fmt_y: Callable[[float], str] = lambda b: f"{b / 2**20:.0f} MiB",
                      mark: tuple[int, float] | None = None) -> Path:
    """Which schedule wins at each (M, bytes) cell: colour per schedule (a legend), text
    label; `mark`: a cell to box (the model's operating point)."""
    from matplotlib.patches import Patch, Rectangle

    plt = pyplot()
    ms = sorted({m for m, _ in cells})
    bs = sorted({b for _, b in cells})
    names = sorted(set(cells.values()))
    idx = {n: i for i, n in enumerate(names)}
    grid = [[idx[cells[(m, b)]] for m in ms] for b in bs]
    fig, ax = plt.subplots(figsize=(1.8 + 1.25 * len(ms), 1.2 + 0.55 * len(bs)))
    ax.imshow(grid, cmap="tab20", aspect="auto", vmin=0, vmax=max(19, len(names)))
    for i, b in enumerate(bs):
        for j, m in enumerate(ms):
            ax.text(j, i, cells[(m, b)].replace("/", "/\n", 1), ha="center", va="center",
                    fontsize=6)
    ax.set_xticks(range(len(ms)), [str(m) for m in ms])
    ax.set_yticks(range(len(bs)), [fmt_y(b) for b in bs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if mark is not None and mark in cells:
        ax.add_patch(Rectangle((ms.index(mark[0]) - 0.5, bs.index(mark[1]) - 0.5), 1, 1,
                               fill=False, edgecolor="black", linewidth=2.5))
    cmap = plt.get_cmap("tab20")
    top = max(19, len(names))
    ax.legend(handles=[Patch(color=cmap(idx[n] / top), label=n) for n in names],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, title="schedule",
              title_fontsize=8)
    return save_figure(fig, path)
