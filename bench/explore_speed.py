"""Benchmark: how long `plait explore` takes (the explorer call, no plotting).

    python bench/explore_speed.py   # prints a table, writes bench/results/explore_speed.json

Cases: the default (Llama-3-70B, TP=8+SP, seq 8192, MI300X) and Llama-3-405B over every schedule
(TP=8+SP, seq 8192, H100). Each case runs `--repeats` times after one warm-up; the median counts.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import results_io
from plait import __version__
from plait.planner.explore import explore
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model

CASES = {
    "default: llama3-70b tp8 sp seq8192 h100": ("llama3-70b", "h100", ParallelSpec()),
    "llama3-70b tp8 sp seq8192 mi300x": ("llama3-70b", "mi300x", ParallelSpec()),
    "llama3-405b tp8 sp seq8192 h100": ("llama3-405b", "h100", ParallelSpec()),
    "llama3-405b tp8 sp seq8192 mi300x": ("llama3-405b", "mi300x", ParallelSpec()),
}


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for name, (model, hw, par) in CASES.items():
        m, c = load_model(model), load_hardware(hw)
        e = explore(m, par, c)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            e = explore(m, par, c)
            times.append(time.perf_counter() - t0)
        sims = sum(len(r.runs) for r in e.pairs)  # distinct ones simulated, equal ones reused
        rows.append({"case": name, "median_s": statistics.median(times), "min_s": min(times),
                     "pairs": len(e.pairs), "schedules_simulated": sims})
        print(f"{name:45s} median {statistics.median(times):6.3f} s  min {min(times):6.3f} s  "
              f"({len(e.pairs)} pairs, {sims} schedules simulated)")
    results_io.write("explore_speed.json", {
        "plait_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "results": rows}, args.save)


if __name__ == "__main__":
    main()
