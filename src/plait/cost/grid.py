"""Interpolation in measured tables, the form calibration data takes."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


class GridTable:
    """Values measured on a regular (possibly sparse-free) 3-d grid of sizes, interpolated
    trilinearly in log(size) and log(value); beyond the largest size the value scales linearly
    with the size, below the smallest it stays at the edge (small work is overhead-bound)."""

    def __init__(self, points: Sequence[tuple[int, int, int, float]]) -> None:
        self.axes: list[list[int]] = [sorted({int(p[d]) for p in points}) for d in range(3)]
        self.values: dict[tuple[int, int, int], float] = {
            (p[0], p[1], p[2]): p[3] for p in points}
        missing = [(a, b, c) for a in self.axes[0] for b in self.axes[1] for c in self.axes[2]
                   if (a, b, c) not in self.values]
        if missing:
            raise ValueError(f"grid incomplete: {len(missing)} points missing, e.g. {missing[0]}")

    def __call__(self, x: int, y: int, z: int) -> float:
        q = (x, y, z)
        brackets: list[tuple[tuple[int, float], ...]] = []
        scale = 1.0
        for d, axis in enumerate(self.axes):
            v = q[d]
            if v >= axis[-1]:
                scale *= v / axis[-1]
                brackets.append(((axis[-1], 1.0),))
            elif v <= axis[0]:
                brackets.append(((axis[0], 1.0),))
            else:
                i = bisect.bisect_right(axis, v)
                lo, hi = axis[i - 1], axis[i]
                w = (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))
                brackets.append(((lo, 1.0 - w), (hi, w)))
        log_value = 0.0
        for a, wa in brackets[0]:
            for b, wb in brackets[1]:
                for c, wc in brackets[2]:
                    log_value += wa * wb * wc * math.log(self.values[(a, b, c)])
        return math.exp(log_value) * scale
