"""`plait explore`: which overlap schedule wins for every dependent pair, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import (
    CalibrationOpt,
    CapacityOpt,
    CpOpt,
    DpOpt,
    DtypeOpt,
    EpOpt,
    HardwareOpt,
    JsonOpt,
    MicroBatchesOpt,
    MicroBatchOpt,
    ModelOpt,
    PpOpt,
    RegatherOpt,
    SeqLenOpt,
    SpOpt,
    TpOpt,
    VirtualStagesOpt,
    check_fits,
    cluster_label,
    console_for,
    load_cluster,
    parallel_spec,
    to_stdout,
    user_errors,
    writable,
    write_json,
)
from plait.errors import SpecError


# A typer command's signature is its option list: most of its length.
def explore_command(
    model: ModelOpt = "llama3-70b",
    hardware: HardwareOpt = "mi300x",
    calibration: CalibrationOpt = None,
    tp: TpOpt = 8,
    sp: SpOpt = True,
    cp: CpOpt = 1,
    ep: EpOpt = 1,
    pp: PpOpt = 1,
    virtual_stages: VirtualStagesOpt = 1,
    dp: DpOpt = 1,
    micro_batch: MicroBatchOpt = 1,
    seq_len: SeqLenOpt = 8192,
    micro_batches: MicroBatchesOpt = 1,
    dtype: DtypeOpt = "bf16",
    capacity_factor: CapacityOpt = 1.0,
    regather: RegatherOpt = True,
    nodes: Annotated[int | None, typer.Option(help="Override the cluster's node count")] = None,
    pair: Annotated[str | None, typer.Option(help="Also rank every schedule of this pair")] = None,
    json_out: JsonOpt = None,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome/Perfetto trace of one "
                                               "layer: sequential, megatron and plait")] = None,
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
    from plait.planner.explore import explore
    from plait.report.explore import render, to_dict
    from plait.report.gantt import plot_gantt
    from plait.report.sim_trace import write_chrome_trace
    from plait.spec.model import load_model

    console = console_for(json_out)
    with user_errors():
        writable(json=json_out, trace=trace, plot=plot)
        spec = load_model(model)
        cluster = load_cluster(hardware, calibration, nodes)
        par = parallel_spec(tp=tp, sp=sp, cp=cp, ep=ep, pp=pp, virtual_stages=virtual_stages,
                            dp=dp, micro_batch=micro_batch, seq_len=seq_len,
                            micro_batches=micro_batches, dtype=dtype,
                            capacity_factor=capacity_factor, regather=regather)
        check_fits(par, cluster)
        result = explore(spec, par, cluster, fast=fast)
        if pair is not None and pair not in result.plan:
            raise SpecError("pair", f"no dependent pair named {pair!r}",
                            f"use one of {', '.join(result.plan)}")
    if json_out is not None and to_stdout(json_out):
        write_json(json_out, to_dict(result))
        return
    render(result, console, pair)
    if why:
        for r in result.pairs:
            if r.heuristic is not None:
                console.print(f"[bold]{r.pair.name}[/] {r.heuristic.schedule}: "
                              f"{r.heuristic.reason} ({r.heuristic.simulated} candidates "
                              "simulated)")
    if json_out is not None:
        write_json(json_out, to_dict(result), console)
    timelines = {f"sequential {ph.name}": ph.timeline for ph in result.sequential}
    timelines |= {f"megatron {ph.name}": ph.timeline for ph in result.phases("megatron")}
    timelines |= {f"plait {ph.name}": ph.timeline for ph in result.chosen}
    if trace is not None:
        console.print(f"wrote {write_chrome_trace(trace, timelines)} (open in ui.perfetto.dev)")
    if plot is not None:
        title = (f"one layer of {spec.name} on {cluster_label(cluster, calibration)}: "
                 "sequential, megatron (baseline) and plait")
        console.print(f"wrote {plot_gantt(plot, timelines, title)}")
        from plait.report.schedule_map import write_schedule_map

        where = plot.with_name(plot.stem + "-map.png")
        console.print(f"wrote {write_schedule_map(result, where, pair)}")
