"""`plait explore`: which overlap schedule wins for every dependent pair, and why."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from plait.cli.common import (
    check_fits,
    cluster_label,
    console_for,
    progress_bar,
    to_stdout,
    user_errors,
    write_json,
)
from plait.cli.options import CLUSTER, MODEL, OUTPUTS, PARALLEL, Values, takes
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import ModelSpec

EXPLORE_OUTPUTS = OUTPUTS.helps(
    trace="Write a Chrome/Perfetto trace of one layer: sequential, megatron and plait",
    plot="Write a PNG Gantt chart of one layer (and a schedule map beside it)")


@takes(outputs=EXPLORE_OUTPUTS, model=MODEL, cluster=CLUSTER, parallel=PARALLEL)
def explore_command(
    *, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec,
    pair: Annotated[str | None, typer.Option(help="Also rank every schedule of this pair")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Pick schedules by heuristics instead of "
                                       "simulating every one")] = False,
    why: Annotated[bool, typer.Option("--why", help="Print the heuristics' one-line reason per "
                                      "pair")] = False,
    outputs: Values,
) -> None:
    """Find the best compute-communication overlap schedule for every dependent pair of a layer.

    Default: Llama-3-70B, TP=8 with SP, bf16, sequence 8192, micro-batch 1, one H100 node.
    """
    from plait.planner.explore import explore
    from plait.report.explore import render, render_reasons, to_dict, write_pictures
    from plait.workload.transformer import build_layer

    console = console_for(outputs.json_out)
    with user_errors():
        check_fits(parallel, cluster)
        pairs = len(build_layer(model, parallel).pairs)
        with progress_bar(console, "exploring", pairs) as done:
            result = explore(model, parallel, cluster, fast=fast, progress=done)
        if pair is not None and pair not in result.plan:
            raise SpecError("pair", f"no dependent pair named {pair!r}",
                            f"use one of {', '.join(result.plan)}")
    if to_stdout(outputs.json_out):
        write_json(outputs.json_out, to_dict(result))
        return
    render(result, console, pair)
    if why:
        render_reasons(result, console)
    if outputs.json_out is not None:
        write_json(outputs.json_out, to_dict(result), console)
    write_pictures(result, console, outputs.trace, outputs.plot,
                   cluster_label(cluster), pair)
