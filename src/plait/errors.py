"""The error classes of plait.

`SpecError` is bad input: it names the offending field and says how to fix it;
`UnsupportedTorch`, one of them, is a torch plait does not run on (raised at import).
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


class UnsupportedTorch(SpecError, ImportError):
    """The installed torch is older than plait supports: raised when plait's runtime is
    imported, so an import error too; the command line says it in one line."""


class InfeasibleError(ValueError):
    """A well-formed request that cannot be carried out, with the reason."""
