"""The decision rule of `schedule="auto"`, on the measured times alone (no torch).

Each candidate's calls are timed on every rank; a call's time is its slowest rank's, and a
candidate's time the median over its calls, its spread the median absolute deviation. The
fastest candidate wins only when it beats the plain baseline by more than the spread of
either measurement; otherwise the baseline runs and the decision says why. A decision is a
plain value: what was measured, what was chosen, why, and where it came from.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.schedule.verdict import PLAIN, Measured, verdict

# Where a decision came from.
MEASURED = "measured"  # its candidates were timed in this job
CACHED = "cache"  # read from the tuning cache (every rank held the same decision)
ONE_RANK = "one rank"  # a group of one rank: nothing to overlap
NOT_TUNED = "not tuned"  # ran the baseline without measuring (under co-execution)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One schedule tried for a signature: the simulator's time and the measured calls."""

    schedule: str
    predicted_s: float | None = None
    times_s: tuple[float, ...] = ()  # each timed call, its slowest rank

    @property
    def measured_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def spread_s(self) -> float:
        """The median absolute deviation of the calls from their median (0 for one call)."""
        med = self.measured_s
        return 0.0 if med is None else statistics.median(abs(t - med) for t in self.times_s)

    @property
    def error(self) -> float | None:
        """The prediction's relative error against the measurement (+: predicted slower)."""
        m = self.measured_s
        if m is None or self.predicted_s is None or m <= 0:
            return None
        return self.predicted_s / m - 1

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "predicted_s": self.predicted_s,
                "measured_s": self.measured_s, "spread_s": self.spread_s,
                "times_s": list(self.times_s)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        pred = d.get("predicted_s")
        return cls(str(d["schedule"]), None if pred is None else float(pred),
                   tuple(float(t) for t in d.get("times_s") or ()))


@dataclass(frozen=True, slots=True)
class Decision:
    """Which schedule a signature runs, and why."""

    key: str  # the signature (`plait.tuning.signature.Signature.key`)
    choice: str
    reason: str
    source: str = MEASURED
    candidates: tuple[Candidate, ...] = field(default=())
    baseline: str = PLAIN

    @property
    def predicted_best(self) -> str | None:
        known = [c for c in self.candidates if c.predicted_s is not None]
        return min(known, key=lambda c: c.predicted_s or 0.0).schedule if known else None

    @property
    def measured_best(self) -> str | None:
        known = [c for c in self.candidates if c.measured_s is not None]
        return min(known, key=lambda c: c.measured_s or 0.0).schedule if known else None

    def candidate(self, schedule: str) -> Candidate | None:
        return next((c for c in self.candidates if c.schedule == schedule), None)

    @property
    def speedup(self) -> float | None:
        """The baseline's measured time over the choice's."""
        base, chosen = self.candidate(self.baseline), self.candidate(self.choice)
        if base is None or chosen is None or not base.measured_s or not chosen.measured_s:
            return None
        return base.measured_s / chosen.measured_s

    def verdicts(self) -> dict[str, tuple[str, str]]:
        """Each measured candidate graded as `plait analyze` grades a call
        (`plait.schedule.verdict`): against its prediction and the baseline measured beside it."""
        base = self.candidate(self.baseline)
        plain = None if base is None else base.measured_s
        return {c.schedule: verdict(Measured(c.schedule, m, c.predicted_s, plain,
                                             plain is not None, show=_ms, where="in this job"))
                for c in self.candidates if (m := c.measured_s) is not None}

    def to_dict(self) -> dict[str, Any]:
        graded = self.verdicts()
        return {"key": self.key, "choice": self.choice, "reason": self.reason,
                "source": self.source, "baseline": self.baseline,
                "candidates": [c.to_dict() | ({"verdict": graded[c.schedule][0]}
                                              if c.schedule in graded else {})
                               for c in self.candidates]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Decision:
        return cls(str(d["key"]), str(d["choice"]), str(d["reason"]),
                   str(d.get("source", MEASURED)),
                   tuple(Candidate.from_dict(c) for c in d.get("candidates") or ()),
                   str(d.get("baseline", PLAIN)))


def decide(key: str, candidates: Sequence[Candidate], baseline: str = PLAIN) -> Decision:
    """The measured candidates' winner: the fastest by median, if it beats `baseline` by more
    than the larger spread of the two; else `baseline`, saying by how little overlap lost."""
    timed = [c for c in candidates if c.times_s]
    base = next((c for c in timed if c.schedule == baseline), None)
    if base is None or base.measured_s is None:
        raise ValueError(f"decide {key}: the baseline {baseline} was not measured")
    others = [c for c in timed if c.schedule != baseline]
    if not others:
        return Decision(key, baseline, "no overlapped candidate fits this shape", MEASURED,
                        tuple(candidates), baseline)
    best = min(others, key=lambda c: (c.measured_s or 0.0, c.schedule))
    b, x = base.measured_s, best.measured_s or 0.0
    margin = max(best.spread_s, base.spread_s)
    about = f"best {_ms(x)} ({best.schedule}) against {_ms(b)} for {baseline}, " \
            f"spread {_ms(margin)}"
    if x < b - margin:
        return Decision(key, best.schedule, f"won by {100 * (1 - x / b):.0f}%: {about}",
                        MEASURED, tuple(candidates), baseline)
    return Decision(key, baseline, f"overlap does not pay here: {about}", MEASURED,
                    tuple(candidates), baseline)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def error_summary(decisions: Sequence[Decision]) -> dict[str, float | int | None]:
    """The simulator graded on the measurements: the median and 90th percentile of its
    absolute relative error over every measured candidate, and how often its predicted best
    was the measured best."""
    errors = sorted(abs(e) for d in decisions for c in d.candidates
                    if (e := c.error) is not None)
    graded = [d for d in decisions if d.predicted_best is not None
              and d.measured_best is not None]  # measured now or earlier (the cache)
    hits = sum(d.predicted_best == d.measured_best for d in graded)
    return {"candidates": len(errors),
            "median_error": statistics.median(errors) if errors else None,
            "p90_error": _quantile(errors, 0.9) if errors else None,
            "signatures": len(graded), "predicted_best_was_best": hits}


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


@dataclass(frozen=True, slots=True)
class TuningReport:
    """Every decision of `schedule="auto"` in this process, by group, and what it cost."""

    decisions: tuple[tuple[str, Decision], ...]  # (group, decision), in the order made
    measurement_calls: int = 0
    warnings: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"plait tuning: {len(self.decisions)} decisions, {self.measurement_calls} "
                 "measurement calls"]
        for group, d in self.decisions:
            lines.append(f"{group}  {d.key}: {d.choice} ({d.source}; {d.reason})")
            graded = d.verdicts()
            for c in d.candidates:
                pred = "-" if c.predicted_s is None else _ms(c.predicted_s)
                meas = "-" if c.measured_s is None else \
                    f"{_ms(c.measured_s)} +- {_ms(c.spread_s)}"
                mark = " <-" if c.schedule == d.choice else ""
                graded_as = f"  {graded[c.schedule][0]}" if c.schedule in graded else ""
                lines.append(f"    {c.schedule:22s} predicted {pred:>10s}  measured {meas}"
                             f"{graded_as}{mark}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """Write `to_dict()` as JSON to `path` (its folder made); returns the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=1))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"decisions": [{"group": g, **d.to_dict()} for g, d in self.decisions],
                "measurement_calls": self.measurement_calls,
                "prediction": error_summary([d for _, d in self.decisions]),
                "warnings": list(self.warnings)}
