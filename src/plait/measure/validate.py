"""Predicted versus measured: held-out shapes, every schedule run for real.

The shapes below are not on the calibration grid of `plait profile` (M 64..4096, N 32..512,
K 64..1024 in powers of 4), so the calibrated simulator has to interpolate: this is the held-out
set. For each shape every schedule of `SCHEDULES` is measured by `plait bench`'s rank body and
predicted by `simulate_pair` on the (calibrated) hardware profile.
"""

from __future__ import annotations

import statistics
from typing import Any

from plait.measure.bench import BenchSpec, bench_rank
from plait.planner.heuristics import pick as heuristic_pick
from plait.schedule.lower import lower, signature
from plait.schedule.schedule import Schedule, as_schedule, simplest_within
from plait.sim.pair import simulate_pair
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import PairKind

HELD_OUT: tuple[tuple[str, int, int, int], ...] = (
    ("ag", 1536, 96, 768), ("ag", 3072, 192, 768), ("ag", 2048, 384, 1536),
    ("ag", 6144, 96, 384), ("rs", 1536, 768, 96), ("rs", 3072, 768, 192),
    ("rs", 2048, 1536, 384), ("rs", 6144, 384, 96),
    ("a2a", 1536, 96, 768), ("mm_a2a", 3072, 768, 192),  # expert-parallel dispatch, combine
)
SCHEDULES: tuple[Schedule, ...] = tuple(
    Schedule.parse(s) for e in ("sm", "dma") for s in (
        f"seq/{e}", f"p2p/{e}/M", f"fine/{e}/c1/g1/M", f"fine/{e}/c2/g1/M",
        f"fine/{e}/c2/peer/M", f"fine/{e}/c4/g1/M", f"fine/{e}/c4/g2/M"))
WITHIN = 0.05  # a pick is right when its measured time is within 5% of the measured best
# (a pick that lowers to the same ops as the measured best counts as exact: on two ranks
# p2p/dma/M and fine/dma/c1/g1/M are one schedule, and their measured gap is only noise)


def validate_rank(rank: int, world: int, specs: list[BenchSpec], report: Any = None
                  ) -> list[dict[str, Any]]:
    out = []
    for spec in specs:
        out.append(bench_rank(rank, world, spec))
        if report is not None and rank == 0:
            report(spec)
    return out


def _signature(spec: BenchSpec, s: str) -> tuple[object, ...]:
    pair, schedule = spec.pair(), _named(spec)[s]
    return signature(lower(schedule, pair.ranks, pair.direction, pair.reduces))


def _named(spec: BenchSpec) -> dict[str, Schedule]:
    """The spec's schedules by the names its measurements carry."""
    return {str(s): s for s in spec.schedules}


def _self_agreement(spec: BenchSpec, meas: dict[str, Any]) -> bool:
    """The noise floor of a pick: is the best schedule of one half of the repeats (odd ones)
    within 5% of the best in the other half (even ones)?"""
    halves = [{s: statistics.median(meas["schedules"][s]["times_s"][h::2])
               for s in _named(spec)} for h in (0, 1)]
    first, second = min(halves[0], key=halves[0].__getitem__), halves[1]
    return (_signature(spec, first) == _signature(spec, min(second, key=second.__getitem__))
            or second[first] <= min(second.values()) * (1 + WITHIN))


def specs_for(ranks: int, repeats: int, warmup: int, quick: bool) -> list[BenchSpec]:
    shapes = HELD_OUT[::2] if quick else HELD_OUT
    schedules = tuple(as_schedule(s) for s in SCHEDULES)
    return [BenchSpec(PairKind(op), m, n, k, ranks, "fp32", warmup, repeats, schedules)
            for op, m, n, k in shapes]


def summarize_validation(specs: list[BenchSpec], measured: list[dict[str, Any]],
                         cluster: ClusterSpec) -> dict[str, Any]:
    rows, shapes = [], []
    for spec, meas in zip(specs, measured, strict=True):
        pair, named = spec.pair(), _named(spec)
        pred = {s: simulate_pair(pair, x, cluster).time_s for s, x in named.items()}
        got = {s: meas["schedules"][s]["median_s"] for s in named}
        for s in named:
            rows.append({"shape": f"{spec.op} {spec.m}x{spec.n}x{spec.k}", "schedule": s,
                         "measured_s": got[s], "predicted_s": pred[s],
                         "error": pred[s] / got[s] - 1})
        best_meas = min(got, key=got.__getitem__)
        pick = simplest_within(list(pred), pred.__getitem__, named.__getitem__)  # as explore does
        heur = str(heuristic_pick(pair, cluster, list(spec.schedules)).schedule)
        same_ops = _signature(spec, pick) == _signature(spec, best_meas)
        repeat_ok = _self_agreement(spec, meas) if spec.repeats > 1 else None
        shapes.append({"shape": f"{spec.op} {spec.m}x{spec.n}x{spec.k}",
                       "measured_best": best_meas, "measured_best_s": got[best_meas],
                       "predicted_best": pick, "predicted_best_measured_s": got[pick],
                       "exact": pick == best_meas or same_ops,
                       "within_5pct": same_ops or got[pick] <= got[best_meas] * (1 + WITHIN),
                       "heuristic": heur, "heuristic_measured_s": got[heur],
                       "heuristic_within_5pct": _signature(spec, heur) == _signature(
                           spec, best_meas) or got[heur] <= got[best_meas] * (1 + WITHIN),
                       "repeat_within_5pct": repeat_ok,
                       "median_abs_error": statistics.median(
                           abs(r["error"]) for r in rows[-len(spec.schedules):])})
    errs = sorted(abs(r["error"]) for r in rows)
    return {
        "hardware": cluster.name, "rows": rows, "shapes": shapes,
        "summary": {"runs": len(rows), "median_abs_error": statistics.median(errs),
                    "p90_abs_error": errs[min(len(errs) - 1, int(0.9 * len(errs)))],
                    "pick_exact": sum(s["exact"] for s in shapes) / len(shapes),
                    "pick_within_5pct": sum(s["within_5pct"] for s in shapes) / len(shapes),
                    "heuristic_within_5pct": sum(s["heuristic_within_5pct"] for s in shapes)
                    / len(shapes),
                    # how often the measurement agrees with itself: the ceiling of any pick
                    "repeat_within_5pct": None if shapes[0]["repeat_within_5pct"] is None
                    else sum(s["repeat_within_5pct"] for s in shapes) / len(shapes)},
    }


__all__ = ["HELD_OUT", "SCHEDULES", "specs_for", "summarize_validation", "validate_rank"]
