"""The simulator's prediction of a saved `plait bench --emulate-link` measurement, recomputed by
today's model: each schedule measured against predicted, the predicted best against the
measured best.

    python bench/emulate_replay.py FILE.json [--hardware h200] [--calibration C] [--save]

A file written before the copy probe existed holds one fixed cost (`link_latency_s`: a small
call's time beyond its copy), the call's and its one copy's together; then each copy is priced
at the hardware's copy-engine command cost (`--hardware`, its `dma.command_overhead_s`) and the
call's own cost is the rest. Writes out/emulate_replay.json (--save: bench/results/).
"""

from __future__ import annotations

import json
from pathlib import Path

import results_io
from plait.cli.common import load_cluster
from plait.measure.emulate import predict
from plait.schedule.schedule import Schedule


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("file", type=Path)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--calibration", type=Path, default=None)
    args = ap.parse_args()
    r = json.loads(args.file.read_text())
    base = load_cluster(args.hardware, args.calibration)
    m, n, k = r["shape"]
    if "copy_overhead_s" in r:
        copy_s, call_s = r["copy_overhead_s"], r["call_overhead_s"]
    else:
        copy_s = base.gpu.dma.command_overhead_s
        call_s = max(r["link_latency_s"] - copy_s, 0.0)
    schedules = tuple(Schedule.parse(s) for s in r["measured_s"])
    dtype = "bf16" if "cpu" not in r["device"] else "fp32"
    predicted = predict(m, n, k, r["ranks"], dtype, base, r["link_bytes_per_s"], copy_s,
                        call_s, schedules)
    rows = [{"schedule": s, "measured_s": v, "predicted_s": predicted[s],
             "ratio": predicted[s] / v} for s, v in sorted(r["measured_s"].items(),
                                                            key=lambda kv: kv[1])]
    best_measured = rows[0]["schedule"]
    best_predicted = min(predicted, key=lambda s: predicted[s])
    print(f"{r['device']}: AG->GEMM {m}x{n}x{k}, {r['ranks']} ranks; copy {copy_s * 1e6:.1f} us,"
          f" call {call_s * 1e6:.0f} us ({args.calibration or args.hardware})")
    for row in rows:
        print(f"  {row['schedule']:20s} measured {row['measured_s'] * 1e3:7.3f} ms  predicted "
              f"{row['predicted_s'] * 1e3:7.3f} ms  {row['ratio']:.2f}")
    worst = max(abs(row["ratio"] - 1) for row in rows)
    print(f"pred/meas {min(r_['ratio'] for r_ in rows):.2f}-{max(r_['ratio'] for r_ in rows):.2f}"
          f" (worst {worst:.0%}); best measured {best_measured}, best predicted "
          f"{best_predicted} (measured {r['measured_s'][best_predicted] * 1e3:.3f} ms, "
          f"{r['measured_s'][best_predicted] / rows[0]['measured_s'] - 1:.1%} off the best)")
    results_io.write("emulate_replay.json", {
        "source": str(args.file), "hardware": args.hardware,
        "calibration": None if args.calibration is None else str(args.calibration),
        "copy_overhead_s": copy_s, "call_overhead_s": call_s, "rows": rows,
        "best_measured": best_measured, "best_predicted": best_predicted}, args.save)


if __name__ == "__main__":
    main()
