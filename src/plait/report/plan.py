"""`plait plan`'s answer for people (a ranked table) and for programs (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from plait.planner.plan.calibrate import ClockFit
from plait.planner.plan.compare import PARTS, RANKING_ERROR, Comparison
from plait.planner.plan.memory import GiB
from plait.planner.plan.search import PlanResult
from plait.planner.plan.space import stage_layers
from plait.planner.plan.step import FLOP_CONVENTIONS, Job, Prediction
from plait.planner.plan.torchtitan import torchtitan_settings
from plait.report.explore import gemm_dict
from plait.report.tables import Column, fitted_table


def mfu_convention(job: Job) -> str:
    """What the MFU column divides, for the job's stack (`Job.flop_convention`)."""
    return (f"MFU: model FLOPs per token as {FLOP_CONVENTIONS[job.flop_convention]}, over "
            "step time x GPUs x the GEMM dtype's dense peak (FP8's under --dtype fp8); "
            "--json has it under every convention")


def mfus(job: Job, p: Prediction) -> dict[str, float]:
    """`p`'s MFU under each of `FLOP_CONVENTIONS`."""
    own = job.flops_per_token()
    return {c: p.mfu * job.flops_per_token(c) / own for c in FLOP_CONVENTIONS}


def layout_dict(p: Prediction) -> dict[str, Any]:
    lay = p.layout
    return {"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp,
            "micro_batch": lay.micro_batch, "micro_batches": lay.micro_batches, "ac": lay.ac,
            "ac_layers": lay.ac_layers,
            "zero": lay.zero, "schedule": lay.schedule, "overlap": lay.overlap,
            "step_s": p.step_s, "plain_step_s": p.plain_step_s, "mfu": p.mfu,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "memory_gib": p.memory.total / GiB, "fits": p.fits,
            "overlap_gain": p.overlap_gain, "exposed_comm_s": p.exposed_comm_s,
            "parts_s": p.parts, "memory": p.memory.as_dict()}


def to_dict(r: PlanResult, seconds: float | None = None) -> dict[str, Any]:
    job = r.job
    chosen = r.chosen
    tied = ties(r)
    out: dict[str, Any] = {
        "model": job.model.model_dump(), "hardware": job.cluster.name, "gpus": job.gpus,
        "seq_len": job.seq_len, "global_batch": job.global_batch, "dtype": job.dtype,
        "kernels": job.kernels, "attention": job.attention,
        "memory_gib": job.memory_bytes / GiB, "mfu_convention": mfu_convention(job),
        "flop_conventions": FLOP_CONVENTIONS,
        "search": {"layouts": r.considered, "fit": r.fitting, "predicted": r.predicted,
                   "pruned_by_bound": r.pruned}
        | ({"cannot_run": [{"layout": lay, "why": why} for lay, why in r.cannot_run]}
           if r.cannot_run else {}) | ({"seconds": seconds} if seconds else {}),
        "layouts": [layout_dict(p) | {"mfu_by_convention": mfus(job, p),
                                      "tie_with_first": i in tied}
                    for i, p in enumerate(r.ranked)],
        "chosen": None,
    }
    if chosen is not None:
        out["chosen"] = layout_dict(chosen) | {
            "plan": chosen.plan,
            "torchtitan": torchtitan_settings(chosen.layout, job.global_batch,
                                              stage_layers(job.model, chosen.layout))}
        # the chosen layout's schedules as `plait explore --json` writes them: the file runs
        # (`plait.nn.load_plan`, `llama_plan(plan=...)`, the examples' --plan)
        e = job.exploration(chosen.layout)
        out |= {"plan": chosen.plan, "parallel": job.parallel(chosen.layout).model_dump(),
                "pairs": [{"name": r.pair.name, "ranks": r.pair.ranks,
                           "gemm": gemm_dict(r.pair.gemm)} for r in e.pairs]}
    if r.too_big:
        out["smallest"] = layout_dict(r.too_big[0])
    return out


def render(r: PlanResult, console: Console, seconds: float | None = None) -> None:
    job = r.job
    title = (f"{job.model.name} on {job.gpus} x {job.cluster.gpu.name} ({job.cluster.name}), "
             f"seq {job.seq_len}, global batch {job.global_batch}, {job.dtype}, "
             f"{job.kernels} kernels, {job.attention} attention, "
             f"{job.memory_bytes / GiB:.0f} GiB a GPU")
    if not r.ranked:
        small = r.too_big[0] if r.too_big else None
        console.print(f"[bold red]no layout fits[/] {title}" + (
            f": the smallest, {small.layout.label()} {small.layout.ac_label} AC, needs "
            f"{small.memory.total / GiB:.1f} GiB" if small else "") + cannot_run_note(r))
        return
    cols = (Column("#", 0, True), Column("layout", 0), Column("batches", 0),
            Column("overlap", 0), Column("step s", 2, True), Column("tok/s/GPU", 0, True),
            Column("MFU", 1, True), Column("GiB", 1, True), Column("exposed s", 3, True),
            Column("gain", 1, True))
    rows = []
    tied = ties(r)
    for i, p in enumerate(r.ranked, 1):
        lay = p.layout
        pipe = {"none": "", "1F1B": " 1F1B", "interleaved": f" int.v{lay.vp}",
                "DualPipeV": " DPV"}[lay.schedule]
        rows.append([f"{i}≈" if i > 1 and i - 1 in tied else str(i), lay.label() + pipe,
                     f"{lay.micro_batch}x{lay.micro_batches} {lay.ac_label} Z{lay.zero}",
                     lay.overlap, f"{p.step_s:.3f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                     f"{p.mfu:.1%}", f"{p.memory.total / GiB:.1f}", f"{p.exposed_comm_s:.3f}",
                     f"{p.overlap_gain:+.1%}"])
    console.print("batches: micro-batch x micro-batches, activation checkpointing (non, sel, "
                  "ful; ful5: on 5 layers of a rank), ZeRO stage (1: distributed optimizer, "
                  "3: FSDP); DPV: DualPipeV; gain: the step without overlap over the step "
                  "with it, less one")
    console.print(fitted_table(title, cols, rows, console.width))
    if len(tied) > 1:
        roomy = max(tied, key=lambda i: job.memory_bytes - r.ranked[i].memory.total)
        free = (job.memory_bytes - r.ranked[roomy].memory.total) / GiB
        console.print(f"≈: within the model's {RANKING_ERROR:.0%} of #1 (its median error "
                      f"against published runs), a tie; of the tied, #{roomy + 1} keeps the "
                      f"most memory free ({free:.1f} GiB)")
    console.print(mfu_convention(job))
    how = (f"{r.considered} layouts, {r.fitting} fit, {r.predicted} predicted, "
           f"{r.pruned} pruned by their compute bound" + cannot_run_note(r))
    console.print(how + (f" ({seconds:.1f} s)" if seconds is not None else ""))
    chosen = r.chosen
    assert chosen is not None
    s = torchtitan_settings(chosen.layout, job.global_batch,
                            stage_layers(job.model, chosen.layout))
    console.print("torchtitan: " + ", ".join(
        f"{k}={v}" for section in ("parallelism", "training", "activation_checkpoint")
        for k, v in s[section].items()))
    for line in s["plait"]:
        console.print(f"plait: {line}")
    if not s["realizable"]:
        console.print("[bold yellow]the chosen layout's overlap has no torchtitan realization "
                      "yet[/]: see the line above")


def fit_dict(fit: ClockFit) -> dict[str, Any]:
    """The measured step against its prediction, and the fitted clock."""
    return {"layout": layout_dict(fit.before),
            "measured_tokens_per_s_per_gpu": fit.measured_tokens_per_s_per_gpu,
            "predicted_tokens_per_s_per_gpu": fit.before.tokens_per_s_per_gpu,
            "ratio": fit.ratio, "clock_fraction": {"preset": fit.preset_clock_fraction,
                                                   "fitted": fit.clock_fraction},
            "fitted_tokens_per_s_per_gpu": fit.after.tokens_per_s_per_gpu}


def render_fit(fit: ClockFit, console: Console) -> None:
    lay = fit.before.layout
    console.print(
        f"measured {fit.measured_tokens_per_s_per_gpu:,.0f} tok/s/GPU at {lay.label()} "
        f"({lay.overlap}); predicted {fit.before.tokens_per_s_per_gpu:,.0f} "
        f"({fit.ratio:.2f}x the measured)")
    console.print(
        f"fitted: clock_fraction {fit.clock_fraction:.3f} (was "
        f"{fit.preset_clock_fraction:.3f}), predicting {fit.after.tokens_per_s_per_gpu:,.0f} "
        "tok/s/GPU; it also carries what the model lacks (gaps between kernels, host "
        "overhead)")


def cannot_run_note(r: PlanResult) -> str:
    """What the search left out because it cannot run, with the first reason."""
    if not r.cannot_run:
        return ""
    lay, why = r.cannot_run[0]
    return f", {len(r.cannot_run)} cannot run (e.g. {lay}: {why})"


def compare_dict(c: Comparison) -> dict[str, Any]:
    """Both layouts with their parts (seconds) and memory, the difference and the verdict."""
    def side(p: Prediction) -> dict[str, Any]:
        return layout_dict(p) | {"breakdown_s": c.parts(p), "headroom_gib": c.headroom_gib(p)}

    return {"chosen": side(c.chosen), "given": side(c.given), "difference": c.difference,
            "tie": c.tie, "tie_within": RANKING_ERROR,
            "preferred": "chosen" if c.preferred is c.chosen else "given"}


def _name(p: Prediction) -> str:
    lay = p.layout
    pipe = {"none": "", "1F1B": " 1F1B", "interleaved": f" int.v{lay.vp}",
            "DualPipeV": " DPV"}[lay.schedule]
    return (f"{lay.label()}{pipe} {lay.micro_batch}x{lay.micro_batches} {lay.ac_label} "
            f"Z{lay.zero} {lay.overlap}")


def render_compare(c: Comparison, console: Console) -> None:
    """The two layouts side by side, part by part, and which to prefer."""
    a, b = c.parts(c.chosen), c.parts(c.given)
    rows = [["step s", f"{c.chosen.step_s:.3f}", f"{c.given.step_s:.3f}",
             f"{c.given.step_s - c.chosen.step_s:+.3f}"],
            ["tok/s/GPU", f"{c.chosen.tokens_per_s_per_gpu:,.0f}",
             f"{c.given.tokens_per_s_per_gpu:,.0f}",
             f"{c.given.tokens_per_s_per_gpu - c.chosen.tokens_per_s_per_gpu:+,.0f}"]]
    rows += [[f"  {k} s", f"{a[k]:.3f}", f"{b[k]:.3f}", f"{b[k] - a[k]:+.3f}"] for k in PARTS]
    rows += [["memory GiB", f"{c.chosen.memory.total / GiB:.1f}",
              f"{c.given.memory.total / GiB:.1f}",
              f"{(c.given.memory.total - c.chosen.memory.total) / GiB:+.1f}"],
             ["headroom GiB", f"{c.headroom_gib(c.chosen):.1f}",
              f"{c.headroom_gib(c.given):.1f}",
              f"{c.headroom_gib(c.given) - c.headroom_gib(c.chosen):+.1f}"]]
    cols = (Column("", 0), Column("plait's first", 0, True), Column("yours", 0, True),
            Column("yours - first", 1, True))
    console.print(f"plait's first: {_name(c.chosen)}")
    console.print(f"yours:         {_name(c.given)}")
    console.print(fitted_table("plait's first choice beside yours (seconds a step)", cols, rows,
                               console.width))
    prefer = "plait's first" if c.preferred is c.chosen else "yours"
    if c.tie:
        console.print(f"a tie: the steps differ by {c.difference:+.1%}, within the model's "
                      f"{RANKING_ERROR:.0%} (its median error against published runs); "
                      f"prefer {prefer}, which keeps more memory")
    else:
        console.print(f"yours is {c.difference:+.1%} against plait's first, beyond the "
                      f"model's {RANKING_ERROR:.0%}: prefer {prefer}")
    if not c.given.fits:
        console.print("[bold yellow]yours does not fit[/] one GPU's memory "
                      f"({c.given.memory.total / GiB:.1f} of {c.job.memory_bytes / GiB:.0f} "
                      "GiB)")


def ties(r: PlanResult) -> list[int]:
    """The ranked layouts (by index) whose step is within the model's error of the first's
    (`RANKING_ERROR`): the first among them."""
    if not r.ranked:
        return []
    first = r.ranked[0].step_s
    return [i for i, p in enumerate(r.ranked) if p.step_s <= first * (1 + RANKING_ERROR)]
