"""Benchmark: the co-execution plan search for one layer (costs from the simulator), including
the search over which weight-gradient GEMMs to move to the end of the backward.

    python bench/coexec_plan_speed.py [--save]   # writes out/ (--save: bench/results/)
"""

from __future__ import annotations

import statistics
import time

import results_io
from plait.planner.coexec.costs import CoexecCosts
from plait.schedule.coexec import plan_dp, plan_with_moves
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.transformer import build_layer

CASES = (("llama3-70b", "h100"), ("llama3-70b", "mi300x"), ("llama3-405b", "h100"))


def main() -> None:
    args = results_io.parser(__doc__).parse_args()
    rows = []
    for model, hw in CASES:
        layer, cluster = build_layer(load_model(model), ParallelSpec()), load_hardware(hw)
        times, costs_t = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            costs = CoexecCosts(layer, cluster)  # fresh: block costs simulated again
            # 16 weight-gradient placements, a DP each
            plan = plan_with_moves(costs.fwd, costs.bwd, costs.collective, costs.solo,
                                   costs.pair, costs.movable)
            times.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            plan_dp(costs.fwd, costs.bwd, costs.collective, costs.solo, costs.pair)
            costs_t.append(time.perf_counter() - t1)
        rows.append({"case": f"{model} tp8 seq8192 {hw}", "search_with_costs_s":
                     statistics.median(times), "dp_only_s": statistics.median(costs_t),
                     "blocks": len(plan.blocks)})
        print(f"{rows[-1]['case']:32s} plan search {rows[-1]['search_with_costs_s']:.3f} s "
              f"(DP alone on cached costs {rows[-1]['dp_only_s'] * 1e3:.1f} ms), "
              f"{len(plan.blocks)} blocks")
    results_io.write("coexec_plan_speed.json", {"results": rows}, args.save)


if __name__ == "__main__":
    main()
