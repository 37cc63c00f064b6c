"""The design space: a schedule is a plain value (`Schedule`, text form `fine/dma/c4/g1/M`)
that the simulator predicts and the runtime executes."""

from plait.schedule.schedule import Schedule

__all__ = ["Schedule"]
