"""Presenting an `Exploration`: rich tables for people, a JSON document for programs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait import __version__
from plait.planner.explore import Exploration, PairReport
from plait.report.tables import Column, fitted_table
from plait.schedule.schedule import CommPattern
from plait.sim.pair import PairRun
from plait.workload.operators import Gemm


def _us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _shape(r: PairReport) -> str:
    g = r.pair.gemm
    experts = f"x{g.count}" if g.count > 1 else ""
    return f"{g.m}x{g.n}x{g.k}{experts}"


def _time(run: PairRun | None) -> str:
    return "—" if run is None else _us(run.time_s)


PAIR_COLUMNS = (  # priority 0 always shown; the highest left out first on a narrow terminal
    Column("pair", 0), Column("GEMM MxNxK", 3), Column("coll", 1),
    Column("seq", 0, True), Column("ideal", 4, True), Column("PyTorch", 5, True),
    Column("TE", 5, True), Column("best p2p", 6, True), Column("best fine", 6, True),
    Column("chosen", 0), Column("time", 0, True), Column("speedup", 0, True),
    Column("decomp", 7, True), Column("contend", 7, True), Column("exposed", 2, True),
    Column("heuristic", 3),
)


def pair_table(e: Exploration, width: int = 200) -> Table:
    c = e.cluster
    title = (f"{e.model.name} · tp={e.parallel.tp} sp={e.parallel.sp} cp={e.parallel.cp} "
             f"ep={e.parallel.ep}"
             + (f" capacity x{e.parallel.capacity_factor:g}" if e.parallel.capacity_factor > 1
                else "")
             + ("" if e.parallel.regather else " · gathered inputs kept")
             + f" · seq {e.parallel.seq_len} x mb {e.parallel.micro_batch} · "
             f"{e.parallel.dtype} · {c.name} ({c.topology.kind}"
             + (f", {c.nodes} nodes x {c.gpus_per_node}" if c.nodes > 1 else "")
             + ")   times in µs; speedup vs seq (plain collective, then GEMM)")
    rows = []
    for r in e.pairs:
        ch = r.chosen
        rows.append((r.pair.name, _shape(r), r.pair.collective.kind.name,
                     _time(r.sequential), _us(ch.ideal_s), _time(r.named("pytorch")),
                     _time(r.named("te")), _time(r.best(CommPattern.P2P)),
                     _time(r.best(CommPattern.FINE)),
                     str(ch.schedule) + ("*" if r.plain_in_layer else ""), _us(ch.time_s),
                     f"{r.speedup:.2f}x", f"{ch.decomposition_loss:+.0%}",
                     f"{ch.contention_loss:.0%}", _us(ch.exposed_comm_s), _heuristic(r)))
    t = fitted_table(title, PAIR_COLUMNS, rows, width)
    if any(r.plain_in_layer for r in e.pairs):
        note = ("*: run plainly in the layer, where the backward's own overlaps of a "
                "column-parallel linear (the reduce-scatter beside the weight gradient) beat "
                "its best schedule alone")
        t.caption = f"{t.caption}\n{note}" if t.caption else note
    return t


def _heuristic(r: PairReport) -> str:
    """'=' when the heuristics agree with the search, else their pick and its cost."""
    h, run = r.heuristic, r.heuristic_run
    if h is None or run is None:
        return "—"
    if run.schedule == r.chosen.schedule or run.time_s <= r.chosen.time_s * (1 + 1e-9):
        return "="
    return f"{h.schedule} +{run.time_s / r.chosen.time_s - 1:.0%}"


BASELINE_TEXT = {
    "sequential": "sequential (every collective, then its consumer; exposed)",
    "megatron": "megatron (Megatron-LM with SP, no --tp-comm-overlap: in backward the input "
                "re-gather beside dgrad, the dgrad reduce-scatter beside wgrad)",
}


def totals_table(e: Exploration) -> Table:
    base = e.baseline
    variants = [w for w in ("sequential", "megatron", "chosen")
                if w != "megatron" or e.megatron is not None]
    totals = {w: e.totals(w) for w in variants}
    seq, plan, ref = totals["sequential"], totals["chosen"], totals[base]
    v = e.parallel.virtual_stages
    schedule = "1F1B" if v == 1 else f"interleaved 1F1B v={v}"
    pipeline = ("" if e.parallel.pp == 1 else f", pp={e.parallel.pp} {schedule} "
                f"(+{seq.bubble_slots:g} idle micro-batch slots)")
    t = Table(title=f"totals: one layer (fwd+bwd) and one step ({seq.layers} layers x "
              f"{seq.micro_batches} micro-batch(es){pipeline}), times in ms; saved vs {base}",
              title_justify="left")
    for col in ("", *("plait" if w == "chosen" else w for w in variants), f"saved vs {base}"):
        t.add_column(col, justify="right" if col else "left")
    rows = [("layer forward", "forward_s"), ("layer backward", "backward_s"),
            ("layer exposed comm", "layer_exposed_s"), ("step", "step_s"),
            ("step exposed comm", "step_exposed_s")]
    if seq.bubble_slots:
        rows.append(("of the step: pipeline bubble", "bubble_s"))
    for name, attr in rows:
        a, b = getattr(ref, attr), getattr(plan, attr)
        t.add_row(name, *(_ms(getattr(totals[w], attr)) for w in variants),
                  f"{(a - b) / a:.0%}" if a > 0 else "—")
    t.caption = (f"baseline: {BASELINE_TEXT[base]}. Exposed communication: "
                 f"{ref.step_exposed_s / ref.step_s:.0%} of the {base} step, "
                 f"{plan.step_exposed_s / plan.step_s:.0%} with plait; step speedup "
                 f"{ref.step_s / plan.step_s:.2f}x vs {base}"
                 + (f" ({seq.step_s / plan.step_s:.2f}x vs sequential)" if base != "sequential"
                    else ""))
    return t


def schedules_table(r: PairReport, top: int, width: int = 200) -> Table:
    cols = (Column("rank", 2, True), Column("schedule", 0), Column("time", 0, True),
            Column("vs seq", 0, True), Column("decomp", 1, True), Column("contend", 1, True),
            Column("exposed", 1, True))
    seq = r.sequential.time_s
    rows = [(str(i), str(run.schedule), _us(run.time_s), f"{seq / run.time_s:.2f}x",
             f"{run.decomposition_loss:+.0%}", f"{run.contention_loss:.0%}",
             _us(run.exposed_comm_s)) for i, run in enumerate(r.runs[:top], 1)]
    return fitted_table(f"{r.pair.name}: {len(r.runs)} schedules simulated, "
                        f"{len(r.infeasible)} infeasible (µs)", cols, rows, width)


def render(e: Exploration, console: Console, pair: str | None = None, top: int = 15) -> None:
    console.print(pair_table(e, console.width))
    console.print(totals_table(e))
    if pair is not None:
        console.print(schedules_table(next(r for r in e.pairs if r.pair.name == pair), top,
                                      console.width))


def _run_dict(run: PairRun) -> dict[str, Any]:
    return {"schedule": str(run.schedule), "time_s": run.time_s,
            "decomposition_loss": run.decomposition_loss,
            "contention_loss": run.contention_loss, "exposed_comm_s": run.exposed_comm_s}


def gemm_dict(g: Gemm) -> dict[str, int]:
    """A pair's GEMM as the JSON documents name it (`plait.nn.load_plan` reads n and k)."""
    return {"m": g.m, "n": g.n, "k": g.k, "count": g.count}


def to_dict(e: Exploration) -> dict[str, Any]:
    """The JSON document of `plait explore --json`; its "plan" maps pair -> schedule."""
    def totals(which: str) -> dict[str, Any]:
        t = e.totals(which)
        return {"layer_forward_s": t.forward_s, "layer_backward_s": t.backward_s,
                "layer_exposed_comm_s": t.layer_exposed_s, "step_s": t.step_s,
                "step_exposed_comm_s": t.step_exposed_s, "pipeline_bubble_s": t.bubble_s,
                "phases": {ph.name: {"time_s": ph.time_s, "compute_s": ph.compute_s,
                                     "comm_s": ph.comm_s, "exposed_comm_s": ph.exposed_comm_s}
                           for ph in e.phases(which)}}

    pairs = []
    for r in e.pairs:
        g = r.pair.gemm
        named = {n: None if (run := r.named(n)) is None else _run_dict(run)
                 for n in ("pytorch", "te")}
        pairs.append({
            "name": r.pair.name, "collective": r.pair.collective.kind.value,
            "direction": r.pair.direction, "axis": r.pair.axis.value,
            "gemm": gemm_dict(g),
            "comm_bytes": r.pair.collective.bytes, "ranks": r.pair.ranks,
            "sequential_s": r.sequential.time_s, "ideal_s": r.chosen.ideal_s,
            "chosen": _run_dict(r.chosen), "plain_in_layer": r.plain_in_layer or None,
            "speedup": r.speedup, "named": named,
            "heuristic": None if r.heuristic is None else {
                "schedule": str(r.heuristic.schedule), "reason": r.heuristic.reason,
                "simulated_s": None if r.heuristic_run is None else r.heuristic_run.time_s,
                "candidates_simulated": r.heuristic.simulated},
            "schedules": [_run_dict(x) for x in r.runs], "infeasible": r.infeasible,
        })
    return {
        "plait_version": __version__,
        "model": e.model.model_dump(), "parallel": e.parallel.model_dump(),
        "hardware": e.cluster.name,
        "plan": e.plan, "pairs": pairs,
        "baseline": e.baseline, "baseline_means": BASELINE_TEXT[e.baseline],
        "totals": {"sequential": totals("sequential"), "plait": totals("chosen"),
                   **({"megatron": totals("megatron")} if e.megatron is not None else {})},
        "step_speedup": {"vs": e.baseline,
                         "value": e.totals(e.baseline).step_s / e.totals("chosen").step_s},
    }


def render_reasons(e: Exploration, console: Console) -> None:
    """The heuristics' one-line reason per pair (`--why`)."""
    for r in e.pairs:
        if r.heuristic is not None:
            console.print(f"[bold]{r.pair.name}[/] {r.heuristic.schedule}: {r.heuristic.reason} "
                          f"({r.heuristic.simulated} candidates simulated)")


def write_pictures(e: Exploration, console: Console, trace: Path | None, plot: Path | None,
                   cluster_label: str, pair: str | None = None) -> None:
    """One layer, sequential, megatron and plait: a Chrome trace and a PNG Gantt, with the
    schedule map beside the PNG."""
    timelines = {f"sequential {ph.name}": ph.timeline for ph in e.sequential}
    timelines |= {f"megatron {ph.name}": ph.timeline for ph in e.phases("megatron")}
    timelines |= {f"plait {ph.name}": ph.timeline for ph in e.chosen}
    if trace is not None:
        from plait.report.sim_trace import write_chrome_trace

        console.print(f"wrote {write_chrome_trace(trace, timelines)} (open in ui.perfetto.dev)")
    if plot is not None:
        from plait.report.gantt import plot_gantt
        from plait.report.schedule_map import write_schedule_map

        title = (f"one layer of {e.model.name} on {cluster_label}: sequential, megatron "
                 "(baseline) and plait")
        console.print(f"wrote {plot_gantt(plot, timelines, title)}")
        where = plot.with_name(plot.stem + "-map.png")
        console.print(f"wrote {write_schedule_map(e, where, pair)}")
