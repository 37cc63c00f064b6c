"""plait's GEMM model (tiles, waves, memory bound, launch) next to measured H100 GEMMs, and the
decomposition loss of splitting a GEMM into skinny pieces.

    python bench/gemm_check.py [--save] [-H h100]

The measurements are OpenXLA's matmul performance table for sm_90 (data/published/
xla_sm90_bf16_matmul.json: 125 bf16 GEMMs, M, N, K each 256..4096, with its source). Two checks,
with the tolerance written down before plait's output was looked at:

1. each GEMM's time: plait / measured, median within 0.8-1.25x, overall and for each M;
2. the decomposition loss of an M = 4096 GEMM cut into s = 2, 4, 8, 16 row pieces (the pieces
   FiCCO and async TP run), for every N, K of the table: (s x time(M/s) / time(M)) - 1, with
   time(M/s) measured as a GEMM of its own. plait's median loss over the 25 (N, K) within
   0.5-2x of the measured median for every s; a model whose loss falls below that is
   optimistic about finer grain.

Prints both tables and writes out/gemm_check.json (bench/results/ with --save).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import results_io
from plait.cost.gemm import gemm_time
from plait.spec.hardware import load_hardware
from plait.workload.ops import Gemm

DATA = Path(__file__).resolve().parents[1] / "data" / "published" / "xla_sm90_bf16_matmul.json"
TIME_RATIO = (0.8, 1.25)  # plait / measured time of one GEMM, median
LOSS_RATIO = (0.5, 2.0)  # plait / measured decomposition loss, median over (N, K)
SPLITS = (2, 4, 8, 16)
WHOLE_M = 4096


def measured_seconds() -> tuple[str, dict[tuple[int, int, int], float]]:
    doc = json.loads(DATA.read_text())
    return doc["source"], {(m, n, k): 2.0 * m * n * k / f for m, n, k, f in doc["points"]}


def within(x: float, band: tuple[float, float]) -> bool:
    return band[0] <= x <= band[1]


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("-H", "--hardware", default="h100")
    args = ap.parse_args()
    cluster = load_hardware(args.hardware)
    source, measured = measured_seconds()

    def model(m: int, n: int, k: int) -> float:
        return gemm_time(Gemm("g", m, n, k), cluster)

    ratios = {key: model(*key) / t for key, t in measured.items()}
    by_m = {m: sorted(r for (mm, _, _), r in ratios.items() if mm == m)
            for m in sorted({key[0] for key in measured})}
    time_rows = [{"m": m, "median": statistics.median(rs), "min": rs[0], "max": rs[-1]}
                 for m, rs in by_m.items()]
    overall = statistics.median(ratios.values())

    nk = sorted({(n, k) for _, n, k in measured})
    loss_rows = []
    for s in SPLITS:
        piece = WHOLE_M // s
        published = [s * measured[piece, n, k] / measured[WHOLE_M, n, k] - 1 for n, k in nk]
        predicted = [s * model(piece, n, k) / model(WHOLE_M, n, k) - 1 for n, k in nk]
        pub, pred = statistics.median(published), statistics.median(predicted)
        loss_rows.append({"split": s, "piece_m": piece, "measured_median": pub,
                          "plait_median": pred, "ratio": pred / pub,
                          "within": within(pred / pub, LOSS_RATIO),
                          "per_nk": [{"n": n, "k": k, "measured": a, "plait": b}
                                     for (n, k), a, b in zip(nk, published, predicted,
                                                             strict=True)]})

    print(f"GEMM time, plait ({cluster.name}) / measured ({len(measured)} bf16 GEMMs; "
          f"tolerance: median within {TIME_RATIO[0]}-{TIME_RATIO[1]}x)")
    print("| M | median | min | max |\n|---|---|---|---|")
    for r in time_rows:
        print(f"| {r['m']} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} |")
    print(f"| all | {overall:.2f} | | | -> "
          f"{'within' if within(overall, TIME_RATIO) else 'miss'}\n")
    print(f"Decomposition loss of an M = {WHOLE_M} GEMM cut into s row pieces, median over "
          f"{len(nk)} (N, K) (tolerance: plait within {LOSS_RATIO[0]}-{LOSS_RATIO[1]}x of "
          "measured)")
    print("| s | piece M | measured | plait | ratio | verdict |\n|---|---|---|---|---|---|")
    for r in loss_rows:
        print(f"| {r['split']} | {r['piece_m']} | {r['measured_median']:.0%} | "
              f"{r['plait_median']:.0%} | {r['ratio']:.2f} | "
              f"{'within' if r['within'] else 'miss'} |")
    results_io.write("gemm_check.json", {
        "source": source, "hardware": cluster.name,
        "tolerance": {"time_ratio": TIME_RATIO, "loss_ratio": LOSS_RATIO},
        "time_ratio_median": overall, "time_by_m": time_rows, "decomposition": loss_rows},
        args.save)


if __name__ == "__main__":
    main()
