"""PNG Gantt charts of simulated timelines: one panel per timeline, one row per stream."""

from __future__ import annotations

import textwrap
from pathlib import Path

from plait.sim.engine import Timeline

_COLORS = {"compute": "#4C72B0", "sm_comm": "#DD8452", "dma": "#55A868",
           # pipeline steps (plait.sim.pipeline)
           "forward": "#4C72B0", "backward": "#C44E52", "backward (input)": "#DA8BC3",
           "weight gradient": "#8172B3", "forward + backward": "#937860"}


def plot_gantt(path: str | Path, timelines: dict[str, Timeline], title: str = "") -> Path:
    from matplotlib.patches import Patch

    from plait.report.plots import pyplot, save_figure

    plt = pyplot()
    rows = sum(len(tl.streams) for tl in timelines.values())
    fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                             figsize=(12, 1.2 + 0.45 * rows + 0.5 * len(timelines)))
    horizon = max(tl.makespan for tl in timelines.values()) * 1e3
    for ax, (name, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        ypos = {s: i for i, s in enumerate(tl.streams)}
        for sp in tl.spans:
            ax.barh(ypos[sp.task.stream], sp.duration * 1e3, left=sp.start * 1e3, height=0.7,
                    color=_COLORS.get(sp.task.category, "#888888"), edgecolor="white",
                    linewidth=0.3)
            label = sp.task.label or sp.task.name
            if sp.duration * 1e3 > horizon * 0.012 * max(len(label), 3) / 3:  # it fits
                ax.text((sp.start + sp.duration / 2) * 1e3, ypos[sp.task.stream], label,
                        ha="center", va="center", fontsize=6, color="white", clip_on=True)
        ax.set_yticks(range(len(tl.streams)), tl.streams)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(f"{name}: {tl.makespan * 1e3:.3f} ms", loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("time (ms)")
    present = {sp.task.category for tl in timelines.values() for sp in tl.spans}
    handles = [Patch(color=c, label=k) for k, c in _COLORS.items() if k in present]
    fig.legend(handles=handles, loc="upper right", ncol=3, fontsize=8)
    if title:  # wrapped clear of the legend at the right
        fig.suptitle("\n".join(textwrap.wrap(title, 80)), x=0.01, ha="left", fontsize=10)
    return save_figure(fig, path)
