"""`schedule="auto"`: the simulator proposes, the user's own job measures and decides.

    plait.ops.all_gather_matmul(x, [w], group, schedule="auto")
    print(plait.tuning.report())          # every decision, its candidates and why

`configure(...)` sets the number of candidates and of timed calls, the hardware the
simulator proposes for and the tuning cache; see `plait.tuning.tuner`.
"""

from plait.schedule.schedule import AUTO
from plait.tuning.decide import Candidate, Decision, TuningReport, decide, error_summary
from plait.tuning.signature import Signature
from plait.tuning.tuner import Settings, configure, tuner


def report() -> TuningReport:
    """This process's decisions so far (plain to print; `to_dict()` for JSON)."""
    t = tuner()
    return TuningReport(tuple(t.log), t.measurement_calls, tuple(t.warnings))


__all__ = ["AUTO", "Candidate", "Decision", "Settings", "Signature", "TuningReport",
           "configure", "decide", "error_summary", "report", "tuner"]
