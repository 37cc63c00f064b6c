"""`plait explore`: which overlap schedule wins for every dependent pair, and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from plait.cli.common import user_errors
from plait.errors import SpecError
from plait.planner.explore import explore
from plait.report.explore import render, to_dict
from plait.report.gantt import plot_gantt
from plait.report.sim_trace import write_chrome_trace
from plait.spec.calibration import load_calibration
from plait.spec.hardware import load_hardware
from plait.spec.io import validate
from plait.spec.model import load_model
from plait.spec.parallel import ParallelSpec


def explore_command(
    model: Annotated[str, typer.Option("--model", "-m", help="Preset name, HF config.json or "
                                       "plait model YAML/JSON")] = "llama3-70b",
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Preset name or cluster "
                                          "YAML/JSON")] = "mi300x",
    calibration: Annotated[Path | None, typer.Option(help="Calibration file to apply")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size")] = 8,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism")] = True,
    cp: Annotated[int, typer.Option(help="Context-parallel size")] = 1,
    ep: Annotated[int, typer.Option(help="Expert-parallel size")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline stages")] = 1,
    dp: Annotated[int, typer.Option(help="Data-parallel replicas")] = 1,
    micro_batch: Annotated[int, typer.Option(help="Sequences per micro-batch")] = 1,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence")] = 8192,
    micro_batches: Annotated[int, typer.Option(help="Micro-batches per step")] = 1,
    dtype: Annotated[str, typer.Option(help="fp32, bf16, fp16 or fp8")] = "bf16",
    capacity_factor: Annotated[float, typer.Option(help="MoE: expert rows as a multiple of "
                                                   "balanced routing (>= 1)")] = 1.0,
    nodes: Annotated[int | None, typer.Option(help="Override the cluster's node count")] = None,
    pair: Annotated[str | None, typer.Option(help="Also rank every schedule of this pair")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the full result as "
                                                  "JSON ('-' for stdout)")] = None,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome/Perfetto trace of one "
                                               "layer, sequential vs plait")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG Gantt chart of one layer (and "
                                              "a schedule map beside it)")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Pick schedules by heuristics instead of "
                                       "simulating every one")] = False,
    why: Annotated[bool, typer.Option("--why", help="Print the heuristics' one-line reason per "
                                      "pair")] = False,
) -> None:
    """Find the best compute-communication overlap schedule for every dependent pair of a layer.

    Default: Llama-3-70B, TP=8 with SP, bf16, sequence 8192, micro-batch 1, one MI300X node.
    """
    console = Console()
    console.width = max(console.width, 200)  # the pair table is wide; wrap rather than elide
    with user_errors():
        spec = load_model(model)
        cluster = load_hardware(hardware)
        if calibration is not None:
            cluster = load_calibration(calibration).apply(cluster)
        if nodes is not None:
            cluster = cluster.with_(nodes=nodes)
        par = validate(ParallelSpec, dict(tp=tp, sp=sp, cp=cp, ep=ep, pp=pp, dp=dp,
                                          micro_batch=micro_batch, seq_len=seq_len,
                                          num_micro_batches=micro_batches, dtype=dtype,
                                          capacity_factor=capacity_factor),
                       "parallel")
        if par.world > cluster.gpus_per_node * cluster.nodes:
            raise SpecError("parallel", f"tp*cp*pp*dp={par.world} GPUs exceed the "
                            f"{cluster.gpus_per_node * cluster.nodes} of {cluster.name}",
                            "raise --nodes or shrink the parallel sizes")
        result = explore(spec, par, cluster, fast=fast)
        if pair is not None and pair not in result.plan:
            raise SpecError("pair", f"no dependent pair named {pair!r}",
                            f"use one of {', '.join(result.plan)}")
    if json_out is not None and str(json_out) == "-":
        print(json.dumps(to_dict(result), indent=2))
        return
    render(result, console, pair)
    if why:
        for r in result.pairs:
            if r.heuristic is not None:
                console.print(f"[bold]{r.pair.name}[/] {r.heuristic.schedule}: "
                              f"{r.heuristic.reason}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(to_dict(result), indent=2))
        console.print(f"wrote {json_out}")
    timelines = {f"sequential {ph.name}": ph.timeline for ph in result.sequential}
    timelines |= {f"plait {ph.name}": ph.timeline for ph in result.chosen}
    if trace is not None:
        console.print(f"wrote {write_chrome_trace(trace, timelines)} (open in ui.perfetto.dev)")
    if plot is not None:
        title = f"one layer of {spec.name} on {cluster.name}: sequential vs plait"
        console.print(f"wrote {plot_gantt(plot, timelines, title)}")
        from plait.report.schedule_map import write_schedule_map

        console.print(f"wrote {write_schedule_map(result, plot.with_name(plot.stem + '-map.png'))}")
