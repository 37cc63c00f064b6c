"""Benchmark: how the planner's cost grows with the group (issue 28).

    python bench/planner_scaling.py          # writes out/planner_scaling.json
    python bench/planner_scaling.py --save   # the committed bench/results/planner_scaling.json

Per tensor-parallel size (2 to 128): the CPU seconds of `plait explore` for Llama-3-405B
(sequence 131072, H100 presets over as many nodes as the group needs; sizes dividing its 128
heads) and of one signature's proposal for `schedule="auto"` (`planner.propose`: the baseline
and the best of each family) for an all-gather -> GEMM of 1024 rows per rank, N=8192,
K=16384, bf16 (also at 72 ranks, one NVL72 rack). Each in a fresh process, so no cache of an
earlier size helps; the first run counts (what a job pays once).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import results_io
from plait import __version__

TPS = (2, 4, 8, 16, 32, 64, 72, 128)
SEQ = 131072

_CASE = """
import json, sys, time
from plait.planner.explore import explore
from plait.planner.propose import propose
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.operators import OverlapPair
tp, what, seq = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
model, par = load_model("llama3-405b"), ParallelSpec(tp=tp, seq_len=seq)
cluster = load_hardware("h100").with_(nodes=max(1, -(-tp // 8)))
t0 = time.process_time()
if what == "explore":
    explore(model, par, cluster)
else:
    propose(OverlapPair.build("ag", 1024 * tp, 8192, 16384, tp), cluster)
print(json.dumps(time.process_time() - t0))
"""


def _cpu_s(tp: int, what: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CASE, str(tp), what, str(SEQ)], check=True,
                         capture_output=True, text=True, timeout=600)
    return float(json.loads(out.stdout))


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--tps", default=",".join(map(str, TPS)))
    args = ap.parse_args()
    rows = []
    for tp in map(int, args.tps.split(",")):
        row = {"tp": tp, "explore_cpu_s": _cpu_s(tp, "explore") if 128 % tp == 0 else None,
               "propose_cpu_s": _cpu_s(tp, "propose")}
        rows.append(row)
        ex = "-" if row["explore_cpu_s"] is None else f"{row['explore_cpu_s']:.2f}"
        print(f"tp {tp:4d}: explore {ex:>7s} s, one proposal {row['propose_cpu_s']:6.3f} s "
              "of CPU")
    results_io.write("planner_scaling.json", {
        "plait_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "model": "llama3-405b",
        "seq_len": SEQ, "hardware": "h100", "results": rows}, args.save)


if __name__ == "__main__":
    main()
