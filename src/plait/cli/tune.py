"""`plait tune`: every pair of a model's layer tuned on the real group; the cache filled and
a plan written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from plait.cli.common import (
    console_for,
    run_with_progress,
    to_stdout,
    user_errors,
    writable,
    write_json,
)
from plait.cli.options import MODEL, PARALLEL, takes

if TYPE_CHECKING:
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import ModelSpec

Ranks = Annotated[int | None, typer.Option(help="CPU ranks to start (default: the layer's "
                                           "group, --tp or --ep; ignored under torchrun)")]
Hardware = Annotated[str | None, typer.Option("--hardware", "-H", help="Hardware the "
                                              "candidates are proposed for (preset or cluster "
                                              "YAML/JSON; default: this device's)")]
Calibration = Annotated[Path | None, typer.Option(help="Calibration file for it")]
Candidates = Annotated[int, typer.Option(help="Overlapped candidates measured beside seq/sm")]
Warmup = Annotated[int, typer.Option(help="Untimed calls of each candidate")]
Calls = Annotated[int, typer.Option(help="Timed calls of each candidate")]
Cache = Annotated[str | None, typer.Option(help="Tuning cache file, or 'off' (default: "
                                           "$PLAIT_TUNING_CACHE, else ~/.cache/plait/"
                                           "tuning.json)")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write the plan (what plan= "
                                              "takes) with every candidate's times")]
Timeout = Annotated[float, typer.Option(help="Seconds before the run is abandoned")]


@takes(model=MODEL.defaults(model="llama3-8b"), parallel=PARALLEL)
def tune_command(
    *, model: ModelSpec, parallel: ParallelSpec, ranks: Ranks = None, hardware: Hardware = None,
    calibration: Calibration = None, candidates: Candidates = 3, warmup: Warmup = 1,
    calls: Calls = 3, cache: Cache = None, json_out: JsonOut = None, timeout: Timeout = 900,
) -> None:
    """Tune every pair of a layer on the real group (schedule="auto"): the simulator's
    candidates measured, seq/sm kept where overlap does not pay; fills the tuning cache."""
    from plait.measure.tune import (
        cache_option,
        tune_rank,
        tune_result,
        tune_spec,
        tune_under_torchrun,
    )
    from plait.report.tune import tune_table

    console = console_for(json_out)
    under_torchrun = "WORLD_SIZE" in os.environ
    with user_errors():
        writable(json=json_out)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else \
            ranks or max(parallel.tp, parallel.ep)
        spec = tune_spec(model, parallel, world, hardware=hardware,
                         calibration=None if calibration is None else str(calibration),
                         candidates=candidates, warmup=warmup, calls=calls,
                         cache=cache_option(cache))
    if under_torchrun:
        measured = tune_under_torchrun(spec)
        if measured is None:
            return
    else:
        pairs = len(spec.pairs())
        most = pairs * (candidates + 1) * (warmup + calls)  # the baseline and the candidates
        measured = run_with_progress(console, f"tuning {pairs} pairs on {world} ranks (at "
                                     f"most {most} measured calls)", pairs, world, tune_rank,
                                     spec, timeout=timeout)
    result = tune_result(spec, measured)
    if json_out is not None and to_stdout(json_out):
        write_json(json_out, result.to_dict())
        return
    console.print(tune_table(result, console.width))
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    if json_out is not None:
        write_json(json_out, result.to_dict(), console)
