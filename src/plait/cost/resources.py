"""What any unit of work costs: its standalone time and the resources it holds while it runs
(the value every cost function returns and the simulator consumes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Cost:
    """What a task costs: its standalone duration and the resources it occupies while running.

    `uses`: resource -> fraction of its capacity used at full speed, shared with other users.
    `reserves`: resource -> fraction taken first (compute units held by a collective kernel).
    """

    duration: float
    uses: dict[str, float] = field(default_factory=dict)
    reserves: dict[str, float] = field(default_factory=dict)
