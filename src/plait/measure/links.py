"""The one latency + bandwidth fit of measured transfer times (`plait profile`, and
`bench/cpu_links.py` through it)."""

from __future__ import annotations

from typing import Any

import numpy as np


def fit_latency_bandwidth(times: dict[int, float], world: int) -> dict[str, Any]:
    """Least-squares t = latency + received_bytes / bandwidth over the measured sizes (KiB
    per rank -> seconds of an all-gather among `world` ranks)."""
    kbs = sorted(times)
    received = np.array([kb * 1024 * (world - 1) for kb in kbs], dtype=float)
    t = np.array([times[kb] for kb in kbs])
    slope, intercept = np.polyfit(received, t, 1) if len(kbs) > 1 else (0.0, 0.0)
    if slope <= 0:  # noise swamped the size dependence: bound the bandwidth by the largest point
        slope, intercept = t[-1] / received[-1], 0.0
    return {"latency_s": max(float(intercept), 0.0), "bytes_per_s": float(1.0 / slope),
            "points": {int(kb): times[kb] for kb in kbs}}
