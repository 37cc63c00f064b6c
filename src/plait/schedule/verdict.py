"""How a measured call compares with its prediction and with the plain path: the one
vocabulary of `plait analyze`'s grading (calls in a trace) and of `schedule="auto"`'s
decisions (candidates timed in the job).

A verdict, first match wins:
- `slower than plain`: slower by more than the tolerance than the plain collective + GEMM
  (`seq/sm`) measured beside it (a predicted plain time is shown, never judged by);
- `measured only`: nothing to compare with (no prediction);
- `as predicted`: within the tolerance of the prediction;
- `exposed more than predicted`: its exposed transfer beyond the prediction's by more than the
  tolerance of the predicted time (where the exposed part was measured);
- otherwise how far from the prediction it ran (`1.55x predicted`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.schedule.schedule import SEQUENTIAL

TOLERANCE = 0.25  # a call within 25% of its prediction is as predicted
PLAIN = str(SEQUENTIAL)  # "seq/sm": the plain path, every comparison's baseline, as text


def microseconds(x: float) -> str:
    return f"{x:,.0f} µs"


@dataclass(frozen=True, slots=True)
class Measured:
    """One schedule's measured time (and exposed transfer, if known) against its prediction
    and the plain path, in one unit (`show` writes an amount of it)."""

    schedule: str
    time: float
    predicted: float | None = None
    plain: float | None = None  # the plain collective + GEMM
    plain_measured: bool = False  # measured beside it (else predicted, or unknown)
    exposed: float | None = None
    predicted_exposed: float | None = None
    show: Callable[[float], str] = microseconds
    where: str = "in this trace"


def verdict(m: Measured, tol: float = TOLERANCE) -> tuple[str, str]:
    """(verdict, its figures in words) for `m` (see the module docstring)."""
    t, show = m.time, m.show
    if (m.plain is not None and m.plain_measured and m.schedule != PLAIN
            and t > m.plain * (1 + tol)):
        return ("slower than plain", f"{show(t)} a call against {show(m.plain)} for the "
                f"plain collective + GEMM measured {m.where}: overlap does not pay here")
    if m.predicted is None:
        return "measured only", "no prediction (no hardware given, or no model of this call)"
    p = m.predicted
    if abs(t / p - 1) <= tol:
        return "as predicted", f"{t / p:.2f}x the predicted {show(p)}"
    if (m.exposed is not None and m.predicted_exposed is not None
            and m.exposed > m.predicted_exposed + tol * p):
        return ("exposed more than predicted", f"{show(m.exposed)} exposed a call against "
                f"{show(m.predicted_exposed)} predicted")
    return f"{t / p:.2f}x predicted", f"{show(t)} a call against {show(p)}"
