"""plait's GEMM model (tiles, waves, memory bound, launch) next to measured H100 GEMMs, and the
decomposition loss of splitting a GEMM into skinny pieces.

    python bench/gemm_check.py [--save] [-H h100|b200] [--dtype bf16|fp8]

The measurements are OpenXLA's matmul performance tables (data/published/, each with its
source): sm_90 for the Hopper presets (xla_sm90_bf16_matmul.json: 125 bf16 GEMMs, M, N, K each
256..4096), sm_100 for the Blackwell ones (xla_sm100_matmul.json: the same 125 shapes and 20
batched ones, bf16 and FP8). Two checks, with the tolerance written down before plait's output
was looked at:

1. each GEMM's time: plait / measured, median within 0.8-1.25x, overall and for each M;
2. the decomposition loss of an M = 4096 GEMM cut into s = 2, 4, 8, 16 row pieces (the pieces
   FiCCO and async TP run), for every N, K of the table: (s x time(M/s) / time(M)) - 1, with
   time(M/s) measured as a GEMM of its own. plait's median loss over the 25 (N, K) within
   0.5-2x of the measured median for every s; a model whose loss falls below that is
   optimistic about finer grain.

Also printed: plait's sustained matmul rate (the ceiling on any one GEMM) over the best rate
any GEMM of the table reached. Prints the tables and writes out/gemm_check_<preset>_<dtype>.json
(bench/results/ with --save).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import results_io
from plait.measure.gemm_check import check, load_published
from plait.spec.hardware import load_hardware

DATA = Path(__file__).resolve().parents[1] / "data" / "published"
TABLES = {"sm_90": DATA / "xla_sm90_bf16_matmul.json", "sm_100": DATA / "xla_sm100_matmul.json"}
ARCH = {"h100": "sm_90", "h100-500w": "sm_90", "h200": "sm_90", "b200": "sm_100",
        "gb200-nvl72": "sm_100"}
TIME_RATIO = (0.8, 1.25)  # plait / measured time of one GEMM, median
LOSS_RATIO = (0.5, 2.0)  # plait / measured decomposition loss, median over (N, K)


def within(x: float, band: tuple[float, float]) -> bool:
    return band[0] <= x <= band[1]


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("-H", "--hardware", default="h100", choices=sorted(ARCH))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    args = ap.parse_args()
    cluster = load_hardware(args.hardware)
    table = load_published(TABLES[ARCH[args.hardware]], args.dtype)
    result = check(cluster, table)
    time_rows = [{"m": m, "median": statistics.median(rs), "min": rs[0], "max": rs[-1]}
                 for m, rs in result.by_m.items()]
    loss_rows = [{"split": r.split, "piece_m": r.piece_m, "measured_median": r.measured,
                  "plait_median": r.plait, "ratio": r.ratio,
                  "within": within(r.ratio, LOSS_RATIO),
                  "per_nk": [{"n": n, "k": k, "measured": a, "plait": b}
                             for n, k, a, b in r.per_nk]} for r in result.losses]
    overall = result.overall
    nk = len(result.losses[0].per_nk)

    print(f"GEMM time, plait ({cluster.name}) / measured ({len(table.seconds)} {table.dtype} "
          "GEMMs; "
          f"tolerance: median within {TIME_RATIO[0]}-{TIME_RATIO[1]}x)")
    print("| M | median | min | max |\n|---|---|---|---|")
    for r in time_rows:
        print(f"| {r['m']} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} |")
    print(f"| all | {overall:.2f} | | | -> "
          f"{'within' if within(overall, TIME_RATIO) else 'miss'}\n")
    print(f"Decomposition loss of an M = {max(result.by_m)} GEMM cut into s row pieces, median "
          f"over {nk} (N, K) (tolerance: plait within {LOSS_RATIO[0]}-{LOSS_RATIO[1]}x of "
          "measured)")
    print("| s | piece M | measured | plait | ratio | verdict |\n|---|---|---|---|---|---|")
    for r in loss_rows:
        print(f"| {r['split']} | {r['piece_m']} | {r['measured_median']:.0%} | "
              f"{r['plait_median']:.0%} | {r['ratio']:.2f} | "
              f"{'within' if r['within'] else 'miss'} |")
    print(f"\nsustained matmul rate, plait / the table's best "
          f"({table.best_flop_per_s / 1e12:,.0f} TFLOP/s): {result.ceiling:.3f}")
    results_io.write(f"gemm_check_{args.hardware}_{table.dtype}.json", {
        "source": table.source, "hardware": cluster.name, "dtype": table.dtype,
        "tolerance": {"time_ratio": TIME_RATIO, "loss_ratio": LOSS_RATIO},
        "time_ratio_median": overall, "time_by_m": time_rows, "decomposition": loss_rows,
        "table_best_flop_per_s": table.best_flop_per_s, "sustained_over_best": result.ceiling},
        args.save)


if __name__ == "__main__":
    main()
