"""Presenting `plait tune`: per pair the simulator's best against the measured best, and the
simulator graded on the user's own machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from plait.report.tables import Column, fitted_table
from plait.tuning.decide import CACHED

if TYPE_CHECKING:
    from plait.measure.tune import TuneResult


def tune_table(r: TuneResult, width: int) -> Table:
    """Pair, predicted best, measured best, whether they agree, the choice and its measured
    speedup over seq/sm, the prediction's error for it and its verdict in `plait analyze`'s
    words (`plait.schedule.verdict`); the grading in the caption."""
    s = r.spec
    title = (f"plait tune: {s.model.name}, tp={s.parallel.tp}"
             + (f" ep={s.parallel.ep}" if s.parallel.ep > 1 else "")
             + f", {s.parallel.dtype}, seq {s.parallel.seq_len} x {s.parallel.micro_batch}; "
             f"{s.world} ranks; candidates predicted on {r.hardware}, baseline seq/sm")
    cols = (Column("pair", 0), Column("predicted best", 0), Column("measured best", 0),
            Column("agree", 0), Column("chosen", 0), Column("vs seq/sm", 0, True),
            Column("chosen ms", 2, True), Column("pred err", 1, True), Column("verdict", 3),
            Column("why", 4))
    rows = []
    for p in r.pairs:
        d = p.decision
        chosen = d.candidate(d.choice)
        err = None if chosen is None else chosen.error
        graded = d.verdicts().get(d.choice)
        rows.append((p.name, d.predicted_best or "-", d.measured_best or "-",
                     "yes" if d.predicted_best == d.measured_best else "no", d.choice,
                     "-" if d.speedup is None else f"{d.speedup:.2f}x",
                     "-" if chosen is None or chosen.measured_s is None
                     else f"{chosen.measured_s * 1e3:.2f}",
                     "-" if err is None else f"{err:+.0%}", "-" if graded is None else graded[0],
                     f"{d.source}: {d.reason}"))
    t = fitted_table(title, cols, rows, width)
    t.caption = _grading(r) + (f"\n{t.caption}" if t.caption else "")
    return t


def _grading(r: TuneResult) -> str:
    g = r.prediction()
    if not g["candidates"]:
        return f"{r.measurement_calls} measurement calls (every pair from the cache)"
    cached = sum(p.decision.source == CACHED for p in r.pairs)
    return (f"the simulator on this machine: median |error| {g['median_error']:.0%}, p90 "
            f"{g['p90_error']:.0%} over {g['candidates']} candidates measured; its predicted "
            f"best was the measured best for {g['predicted_best_was_best']} of "
            f"{g['signatures']} pairs; {r.measurement_calls} measurement calls"
            + (f" ({cached} pairs decided from the tuning cache)" if cached else ""))
