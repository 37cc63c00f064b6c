"""plait's GEMM model beside a table of measured GEMM times: each GEMM's time, and the
decomposition loss of cutting a GEMM into row pieces (what FiCCO and async TP run).

One comparison for `bench/gemm_check.py` (which prints and records it) and the tests that
hold the H100 preset to OpenXLA's measured sm_90 table and the B200 preset to its sm_100 table
(`data/published/`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from plait.cost.gemm import gemm_time, sustained_flops
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Gemm

SPLITS = (2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Published:
    """Measured seconds of the unbatched GEMMs of one dtype by (M, N, K), the highest rate any
    GEMM of the table reached (batched ones too: the table's maximum achievable matmul rate),
    and where they come from."""

    source: str
    dtype: str
    seconds: dict[tuple[int, int, int], float]
    best_flop_per_s: float


def load_published(path: Path, dtype: str = "bf16") -> Published:
    """A table of `{"source": ..., "columns": ["b", "m", "n", "k", <dtype>...], "points":
    [[b, M, N, K, FLOP/s...], ...]}`."""
    doc = json.loads(path.read_text())
    col = doc["columns"].index(dtype)
    return Published(doc["source"], dtype,
                     {(m, n, k): 2.0 * m * n * k / p[col]
                      for p in doc["points"] for b, m, n, k in [p[:4]] if b == 1},
                     max(p[col] for p in doc["points"]))


@dataclass(frozen=True, slots=True)
class LossRow:
    """An M = `whole_m` GEMM cut into `split` row pieces, each timed as a GEMM of its own:
    (split x time(M / split) / time(M)) - 1, the median over every (N, K) of the table."""

    split: int
    piece_m: int
    measured: float
    plait: float
    per_nk: tuple[tuple[int, int, float, float], ...]  # (N, K, measured, plait)

    @property
    def ratio(self) -> float:
        return self.plait / self.measured


@dataclass(frozen=True, slots=True)
class GemmCheck:
    """plait / measured time of every GEMM, by M (sorted ratios) and overall (median), the
    decomposition loss rows, and plait's sustained matmul rate (its ceiling on any GEMM) over
    the table's best."""

    by_m: dict[int, list[float]]
    overall: float
    losses: tuple[LossRow, ...]
    ceiling: float


def check(cluster: ClusterSpec, table: Published, whole_m: int | None = None) -> GemmCheck:
    """Compare `cluster`'s GEMM model with `table`; the loss rows split the table's largest M
    (or `whole_m`)."""
    measured = table.seconds

    def model(m: int, n: int, k: int) -> float:
        return gemm_time(Gemm("g", m, n, k, table.dtype), cluster)

    ratios = {key: model(*key) / t for key, t in measured.items()}
    by_m = {m: sorted(r for (mm, _, _), r in ratios.items() if mm == m)
            for m in sorted({key[0] for key in measured})}
    whole = whole_m or max(by_m)
    nk = sorted({(n, k) for _, n, k in measured})
    losses = []
    for s in SPLITS:
        piece = whole // s
        rows = tuple((n, k, s * measured[piece, n, k] / measured[whole, n, k] - 1,
                      s * model(piece, n, k) / model(whole, n, k) - 1) for n, k in nk)
        losses.append(LossRow(s, piece, statistics.median(r[2] for r in rows),
                              statistics.median(r[3] for r in rows), rows))
    return GemmCheck(by_m, statistics.median(ratios.values()), tuple(losses),
                     sustained_flops(cluster, table.dtype) / table.best_flop_per_s)
