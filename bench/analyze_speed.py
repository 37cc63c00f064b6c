"""How long `plait analyze` takes on a large GPU trace.

    python bench/analyze_speed.py [--kernels 180000]

Writes a synthetic Kineto trace (one GPU: GEMM kernels linked to their aten::mm operators, an
NCCL all-gather every 9 kernels, 380k events, ~77 MB) to a temporary file, then times
`analyze` on it (reading included) with the h100 preset. Writes
bench/results/analyze_speed.json.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import results_io
from plait.analyze.analysis import analyze
from plait.spec.hardware import load_hardware


def trace(kernels: int) -> dict:
    rng = random.Random(0)
    events, ops, t = [], [], 0.0
    for i in range(kernels):
        d = rng.uniform(5, 50)
        events.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "pid": 0, "tid": 7,
                       "ts": t, "dur": d, "args": {"device": 0, "stream": 7, "External id": i}})
        ops.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": t,
                    "dur": 1, "args": {"External id": i, "Input type": ["c10::BFloat16"],
                                       "Input Dims": [[4096, 1024], [1024, 512]]}})
        t += d + rng.uniform(0, 3)
        if i % 9 == 0:
            events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather",
                           "pid": 0, "tid": 20, "ts": t - 10, "dur": 30, "args": {
                               "device": 0, "stream": 20, "Collective name": "allgather",
                               "Group size": 8, "In msg nelems": 512 * 1024,
                               "Out msg nelems": 4096 * 1024, "dtype": "BFloat16"}})
    return {"deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}], "traceEvents": events + ops}


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--kernels", type=int, default=180_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        path.write_text(json.dumps(trace(args.kernels)))
        size = path.stat().st_size
        t0 = time.perf_counter()
        result = analyze([path], load_hardware("h100"))
        took = time.perf_counter() - t0
    (t,) = result.traces
    events = sum(len(d.comms) + len(d.compute) for d in t.trace.devices)
    res = {"kernels": args.kernels, "trace_mb": size / 1e6, "gpu_events": events,
           "seconds": took, "pairs": len(t.advice)}
    print(f"{size / 1e6:.0f} MB trace, {events:,} GPU events: analyzed in {took:.1f} s")
    results_io.write("analyze_speed.json", res, args.save)


if __name__ == "__main__":
    main()
