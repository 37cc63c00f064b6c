"""Random dependent pairs on the hardware presets: the held-out sets on which the heuristics
are scored against exhaustive search (`bench/heuristics_eval.py`, `tests/test_heuristics.py`).
A seed always draws the same scenarios."""

from __future__ import annotations

import random

from plait.workload.operators import OverlapPair

HARDWARE = ("mi300x", "h100", "h200", "a100", "a40")
NS = (1024, 2048, 4096, 8192, 16384, 28672, 53248)
KS = (1024, 2048, 4096, 8192, 16384)


def scenario(rng: random.Random, experts: bool = False) -> tuple[str, OverlapPair]:
    """(hardware preset, pair): ranks 2/4/8, M 512..131072, N and K among LLM sizes, bf16; an
    all-gather into a column-parallel GEMM or a row-parallel GEMM into a reduce-scatter, or
    with `experts` an expert-parallel all-to-all dispatch or combine."""
    hw, P = rng.choice(HARDWARE), rng.choice((2, 4, 8))
    m, n, k = 2 ** rng.randint(9, 17), rng.choice(NS), rng.choice(KS)
    if experts:
        return hw, OverlapPair.build("a2a" if rng.random() < 0.5 else "mm_a2a", m, n, k, P)
    if rng.random() < 0.5:
        return hw, OverlapPair.build("ag", m, n // P, k, P)
    return hw, OverlapPair.build("rs", m, n, k // P, P)
