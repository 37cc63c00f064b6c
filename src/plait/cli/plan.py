"""`plait plan`: which layout to run at all, and what overlap buys there."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from plait.cli.common import (
    console_for,
    load_cluster,
    to_stdout,
    user_errors,
    writable,
    write_json,
)
from plait.errors import SpecError

if TYPE_CHECKING:
    from plait.planner.plan.calibrate import ClockFit


def plan_command(
    model: Annotated[str, typer.Option("--model", "-m", help="Preset name, HF config.json or "
                                       "plait model YAML/JSON")] = "llama3-8b",
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Preset name or cluster "
                                          "YAML/JSON (one node; --gpus sets the count)")] = "h100",
    gpus: Annotated[int, typer.Option(help="GPUs of the job")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence")] = 8192,
    global_batch: Annotated[int, typer.Option(help="Sequences per step")] = 16,
    memory_gib: Annotated[float | None, typer.Option(help="Memory of one GPU, GiB (default: "
                                                     "the preset's)")] = None,
    headroom_gib: Annotated[float, typer.Option(help="Memory each GPU keeps free beyond "
                                                "what the model counts (which includes 3 GiB "
                                                "for CUDA's context, NCCL and the "
                                                "allocator's slack), GiB")] = 0.0,
    layout: Annotated[str | None, typer.Option(help="Pin layout fields, e.g. "
                                               "tp=8,pp=2,ac=full,ac_layers=5 (a single "
                                               "layout when all are given); "
                                               "overlap=asynctp names PyTorch's async "
                                               "TP")] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16, fp8 or fp32 GEMMs (default: "
                                                "the calibration's, else bf16)")] = None,
    kernels: Annotated[str | None, typer.Option(help="fused (torch.compile, TransformerEngine, "
                                                "Megatron-LM) or eager (PyTorch op by op) "
                                                "memory-bound kernels (default: the "
                                                "calibration's, else fused)")] = None,
    attention: Annotated[str | None, typer.Option(
        help="cudnn (TransformerEngine's fused attention; with fused kernels, the Megatron-LM "
             "/ NeMo stack: sequence-parallel inputs gathered again in the backward, FP8 "
             "inputs cached) or fa2 (PyTorch SDPA's FlashAttention-2, torchtitan's stack) "
             "(default: the calibration's, else cudnn)")] = None,
    top: Annotated[int, typer.Option(help="Layouts to list")] = 10,
    calibration: Annotated[Path | None, typer.Option(help="Calibration file to apply")] = None,
    measured: Annotated[float | None, typer.Option(help="Tokens/s/GPU measured for the one "
                                                   "--layout given (overlap= included): fit "
                                                   "the part's clock to it")] = None,
    save_calibration: Annotated[Path | None, typer.Option(help="With --measured: write the "
                                                          "fitted calibration here (YAML), "
                                                          "for --calibration")] = None,
    compare: Annotated[str | None, typer.Option(help="A layout of your own, as --layout "
                                                "writes one (e.g. tp=8,pp=4,vp=5): "
                                                "predicted beside plait's first choice, "
                                                "part by part")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the ranking and the "
                                                  "chosen plan as JSON ('-': stdout)")] = None,
) -> None:
    """Choose the layout (TP, CP, PP and its schedule, EP, DP sharding, micro-batches,
    activation checkpointing) and its overlap together, within one GPU's memory."""
    from rich.progress import Progress

    from plait.planner.plan.search import parse_layout, plan
    from plait.planner.plan.step import Job
    from plait.report.plan import (
        compare_dict,
        fit_dict,
        render,
        render_compare,
        render_fit,
        to_dict,
    )
    from plait.spec.model import load_model

    console = console_for(json_out)
    with user_errors():
        for name, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch),
                            ("top", top)):
            if value < 1:
                raise SpecError(name.replace("_", "-"), f"{value} is not positive",
                                f"pass --{name.replace('_', '-')} 1 or more")
        if memory_gib is not None and not 0 < memory_gib < math.inf:
            raise SpecError("memory-gib", f"{memory_gib} GiB is not a memory size",
                            "pass a positive finite number of GiB, e.g. --memory-gib 80")
        if not 0 <= headroom_gib < math.inf:
            raise SpecError("headroom-gib", f"{headroom_gib} GiB is not a memory size",
                            "pass 0 or more GiB to keep free on each GPU")
        if measured is not None and not 0 < measured < math.inf:
            raise SpecError("measured", f"{measured} tokens/s/GPU is not a positive finite "
                            "rate", "pass the run's tokens per second per GPU")
        writable(json=json_out, **{"save-calibration": save_calibration})
        fitted = _fitted_stack(calibration)
        dtype = dtype or fitted.get("dtype", "bf16")
        kernels = kernels or fitted.get("kernels", "fused")
        attention = attention or fitted.get("attention", "cudnn")
        differs = {k: v for k, v in (("dtype", dtype), ("kernels", kernels),
                                     ("attention", attention)) if fitted.get(k, v) != v}
        if differs:
            console.print(f"[yellow]note:[/] the calibration was fitted under {fitted}; "
                          f"this ranking runs {differs}")
        if dtype not in ("bf16", "fp16", "fp8", "fp32"):
            raise SpecError("dtype", f"unknown dtype {dtype!r}", "use bf16, fp16, fp8 or fp32")
        if kernels not in ("fused", "eager"):
            raise SpecError("kernels", f"unknown kernels {kernels!r}", "use fused or eager")
        spec = load_model(model)
        cluster = load_cluster(hardware, calibration, None)
        cluster.gpu.flops(dtype)
        mem = memory_gib * 2**30 if memory_gib is not None else cluster.gpu.memory_bytes
        if mem <= 0:
            raise SpecError("memory-gib", f"{cluster.gpu.name} has no memory size",
                            "pass --memory-gib")
        if headroom_gib * 2**30 >= mem:
            raise SpecError("headroom-gib", f"{headroom_gib} GiB leaves nothing of the "
                            f"{mem / 2**30:.0f} GiB a GPU", "keep less free")
        mem -= headroom_gib * 2**30
        fixed = parse_layout(layout) if layout else None
        given_fields = _compare_fields(compare) if compare is not None else None
        job = Job(spec, cluster, gpus, seq_len, global_batch, mem,
                  dtype, kernels, attention)  # type: ignore[arg-type]
        given = None
        if given_fields is not None:  # named before the search, not after it
            from plait.planner.plan.search import one_layout

            given = one_layout(job, given_fields, "compare")
        fit = None
        if save_calibration is not None and measured is None:
            raise SpecError("save-calibration", "there is nothing to save without a fit",
                            "pass --measured with the run's tokens/s/GPU")
        if measured is not None:
            from plait.planner.plan.calibrate import fit_clock
            from plait.planner.plan.search import measured_layout

            lay, overlap = measured_layout(job, fixed or {})
            fit, job = fit_clock(job, lay, overlap, measured)
            if save_calibration is not None:
                _save(save_calibration, fit, calibration, model, hardware,
                      {"dtype": dtype, "kernels": kernels, "attention": attention})
        start = time.process_time()
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("planning: layouts predicted", total=None)
            result = plan(job, keep=top, fixed=fixed, progress=lambda done, total: bar.update(
                task, completed=done, total=total))
        seconds = time.process_time() - start
        comparison = None
        if given is not None and given_fields is not None and result.chosen is not None:
            from plait.planner.plan.compare import Comparison
            from plait.planner.plan.search import predict_given

            comparison = Comparison(job, result.chosen,
                                    predict_given(job, given, given_fields.get("overlap")))
    doc = to_dict(result, seconds) | ({"measured": fit_dict(fit)} if fit else {}) | (
        {"compare": compare_dict(comparison)} if comparison is not None else {})
    if to_stdout(json_out):
        write_json(json_out, doc)  # type: ignore[arg-type]
        if not result.ranked:  # nothing fits: the same status as without --json -
            raise typer.Exit(1)
        return
    if fit is not None:
        render_fit(fit, console)
        if save_calibration is not None:
            console.print(f"calibration written to {save_calibration}: plait plan "
                          f"--calibration {save_calibration} ranks layouts at the fitted clock")
    render(result, console, seconds)
    if comparison is not None:
        render_compare(comparison, console)
    if json_out is not None:
        write_json(json_out, doc, console)
    if not result.ranked:
        raise typer.Exit(1)


def _compare_fields(text: str) -> dict[str, object]:
    """`--compare`'s layout, read as `--layout` is, its errors named `compare`."""
    from plait.planner.plan.search import parse_layout

    try:
        return parse_layout(text)
    except SpecError as exc:
        raise SpecError(exc.field.replace("layout", "compare", 1), exc.problem,
                        exc.fix) from None


def _fitted_stack(calibration: Path | None) -> dict[str, str]:
    """The stack a `--save-calibration` file was fitted under (its `meta.stack`), or {}."""
    if calibration is None:
        return {}
    from plait.spec.io import read_mapping

    meta = read_mapping(calibration, "calibration").get("meta")
    stack = meta.get("stack") if isinstance(meta, dict) else None
    return {str(k): str(v) for k, v in stack.items()} if isinstance(stack, dict) else {}


def _save(path: Path, fit: ClockFit, calibration: Path | None, model: str,
          hardware: str, stack: dict[str, str]) -> None:
    """The fitted clock as a calibration file, on top of the calibration the fit ran on, with
    the stack it was fitted under (which `--calibration` then applies)."""
    import datetime

    from plait.report.plan import fit_dict
    from plait.spec.calibration import CALIBRATION_VERSION, save_calibration
    from plait.spec.hardware import load_hardware
    from plait.spec.io import read_mapping

    doc: dict[str, Any] = ({k: v for k, v in read_mapping(calibration, "calibration").items()}
                           if calibration is not None else {})
    doc["plait_calibration"] = CALIBRATION_VERSION
    base = load_hardware(hardware)
    doc["meta"] = dict(doc.get("meta") or {}) | {
        "hardware_base": base.name,
        "date": datetime.date.today().isoformat(),
        "command": "plait " + " ".join(sys.argv[1:]),
        "fitted": "params.clock_fraction, to one measured step of " + model,
        "stack": stack}
    doc["params"] = dict(doc.get("params") or {}) | {"clock_fraction": fit.clock_fraction}
    doc["measurements"] = dict(doc.get("measurements") or {}) | {"step": fit_dict(fit)}
    save_calibration(doc, path, base)
