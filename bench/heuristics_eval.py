"""How often the heuristics pick what exhaustive simulation picks, on scenarios they were not
derived from.

    python bench/heuristics_eval.py [--n 1000] [--seed 4]

Scenarios: random dependent pairs (hardware preset, ranks 2/4/8, all-gather or reduce-scatter,
M 512..131072, N and K among LLM sizes, bf16). The rules and the estimator were written while
looking at scenarios drawn with seeds 0 and 1 (the derivation sets); the figures quoted are for
seeds 4 and 3, which nobody looked at while writing them (seed 4 is fresh for the current
version; seeds 3 and 2 scored earlier versions). Writes
bench/results/heuristics_eval_seed<SEED>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from plait.planner.explore import explore_pair
from plait.planner.heuristics import pick
from plait.schedule.lower import lower, signature
from plait.spec.hardware import load_hardware
from plait.workload.ops import Axis, Collective, CollectiveKind, Gemm, OverlapPair

HARDWARE = ("mi300x", "h100", "h200", "a100", "a40")
NS = (1024, 2048, 4096, 8192, 16384, 28672, 53248)
KS = (1024, 2048, 4096, 8192, 16384)


def scenario(rng: random.Random, experts: bool = False) -> tuple[str, OverlapPair]:
    """A random pair; `experts`: expert-parallel all-to-all dispatch or combine instead."""
    hw, P = rng.choice(HARDWARE), rng.choice((2, 4, 8))
    m, n, k = 2 ** rng.randint(9, 17), rng.choice(NS), rng.choice(KS)
    if experts:
        d = rng.random() < 0.5
        coll = Collective("a2a", CollectiveKind.A2A, m * (k if d else n) * 2.0, P)
        return hw, OverlapPair("a2a", coll, Gemm("g", m, n, k), "in" if d else "out", Axis.M)
    if rng.random() < 0.5:
        pair = OverlapPair("ag", Collective("ag", CollectiveKind.AG, m * k * 2.0, P),
                           Gemm("g", m, n // P, k), "in", Axis.M)
    else:
        pair = OverlapPair("rs", Collective("rs", CollectiveKind.RS, m * n * 2.0, P),
                           Gemm("g", m, n, k // P), "out", Axis.M)
    return hw, pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--experts", action="store_true",
                    help="expert-parallel all-to-all pairs instead of all-gather/reduce-scatter")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    clusters = {h: load_hardware(h) for h in HARDWARE}
    exact = within1 = within5 = same = 0
    slow, pick_us, search_us, misses = [], [], [], []
    for _ in range(args.n):
        hw, pair = scenario(rng, args.experts)
        t0 = time.perf_counter()
        report = explore_pair(pair, clusters[hw])
        search_us.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        h = pick(pair, clusters[hw])
        pick_us.append((time.perf_counter() - t0) * 1e6)
        run = report.run(h.schedule)
        assert run is not None, h.schedule
        ratio = run.time_s / report.chosen.time_s
        slow.append(ratio)
        exact += ratio <= 1 + 1e-6
        ops = [signature(lower(x, pair.ranks, pair.direction, pair.reduces))
               for x in (h.schedule, report.chosen.schedule)]
        same += ops[0] == ops[1]  # the explorer's very choice (or one that lowers the same)
        within1 += ratio <= 1.01
        within5 += ratio <= 1.05
        if ratio > 1.05:
            misses.append({"hardware": hw, "pair": pair.direction, "ranks": pair.ranks,
                           "mnk": [pair.gemm.m, pair.gemm.n, pair.gemm.k],
                           "heuristic": str(h.schedule), "best": str(report.chosen.schedule),
                           "slower": ratio})
    res = {"seed": args.seed, "scenarios": args.n, "optimal": exact / args.n,
           "same_choice": same / args.n,
           "within_1pct": within1 / args.n, "within_5pct": within5 / args.n,
           "mean_slowdown": statistics.mean(slow),
           "worst_slowdown": max(slow), "pick_us_median": statistics.median(pick_us),
           "exhaustive_us_median": statistics.median(search_us),
           "command": f"python bench/heuristics_eval.py --n {args.n} --seed {args.seed}"
                      + (" --experts" if args.experts else ""),
           "misses": misses}
    print(f"seed {args.seed}, {args.n} scenarios: optimal {res['optimal']:.1%} (the explorer's "
          f"own choice {res['same_choice']:.1%}), within 1% "
          f"{res['within_1pct']:.1%}, within 5% "
          f"{res['within_5pct']:.1%}, mean slowdown {res['mean_slowdown']:.3f}x, worst "
          f"{res['worst_slowdown']:.2f}x; a pick takes {res['pick_us_median']:.0f} us, exhaustive "
          f"simulation of the pair {res['exhaustive_us_median']:.0f} us (medians)")
    out = Path(__file__).parent / "results" / (
        f"heuristics_eval{'_experts' if args.experts else ''}_seed{args.seed}.json")
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
