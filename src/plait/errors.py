"""The two error classes of plait.

`SpecError` is bad input: it names the offending field and says how to fix it.
`InfeasibleError` is a valid request that cannot be carried out (a schedule that does not fit a
shape); planners count and skip it instead of crashing.
"""

from __future__ import annotations


class SpecError(ValueError):
    """Bad input. `field` names the offending field; `fix` says what to do instead."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class InfeasibleError(ValueError):
    """A well-formed request that cannot be carried out, with the reason."""
