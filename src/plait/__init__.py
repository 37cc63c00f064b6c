"""plait: hide communication behind computation in distributed PyTorch.

The loop: plan -> simulate -> run -> measure -> calibrate. A schedule is a plain value
(`plait.schedule.Schedule`); the simulator predicts it and the runtime executes the same value.
"""

from plait.errors import InfeasibleError, SpecError

__version__ = "0.1.0"
__all__ = ["InfeasibleError", "SpecError", "__version__"]
