"""Interpolation in measured (size, value) tables, the form calibration data takes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def interp_log(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation in log(size); clamped to the end points."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x <= x1:
            w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]  # unreachable
