"""`Schedule`: one point of the FiCCO design space for a dependent (collective, GEMM) pair.

A schedule is a plain value with a one-line text form that round-trips through `parse`:

    seq/sm              whole collective on the library's kernels, then the whole GEMM
    seq/dma             whole collective as copy-engine commands (one per peer), then the GEMM
    p2p/dma/M           shard level: one shard from (or to) one peer per step, a GEMM piece per
                        shard (PyTorch async TP, TransformerEngine ring exchange)
    fine/dma/c8/g1/M    finer grain: each shard cut in c=8 sub-chunks; step j exchanges sub-chunk
                        j with all peers at once; one GEMM piece per g=1 steps
    fine/sm/c4/peer/M   finer grain, one GEMM piece per (step, peer) sub-chunk (P^2 pieces at c=P)

The split axis (M: tokens are the GEMM rows; K: tokens are the reduction, as in weight
gradients) must match the pair's gathered dimension. The GEMM always handles the locally
available data first (all-gather) or last (reduce-scatter), so it overlaps the first or last step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, TypeVar

from plait.errors import SpecError
from plait.workload.operators import Axis


class CommPattern(StrEnum):
    SEQ = "seq"
    P2P = "p2p"
    FINE = "fine"


class Engine(StrEnum):
    SM = "sm"  # collective kernels on compute units (NCCL/RCCL, gloo on CPU)
    DMA = "dma"  # copy engines reading/writing peer memory


PER_PEER = 0  # `group` value: one GEMM piece per (step, peer) sub-chunk
# A schedule is chosen over a simpler one only when predicted at least this much faster: more
# steps and pieces cost launches and synchronization that a model resolves no better than this.
SIMPLER_WITHIN = 0.02
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Schedule:
    comm: CommPattern = CommPattern.SEQ
    engine: Engine = Engine.SM
    chunks: int = 1  # FINE: sub-chunks per shard = communication steps
    group: int = 1  # FINE: steps per GEMM piece; PER_PEER: a piece per (step, peer)
    axis: Axis = Axis.M

    def __post_init__(self) -> None:
        if self.comm is CommPattern.FINE:
            if self.chunks < 1:
                raise SpecError("schedule.chunks", f"chunks={self.chunks} must be >= 1",
                                "use c1 or more sub-chunks per shard")
            if self.group != PER_PEER and (self.group < 1 or self.chunks % self.group):
                raise SpecError("schedule.group", f"group={self.group} does not divide "
                                f"chunks={self.chunks}", "use a divisor of chunks, or 'peer'")
        elif (self.chunks, self.group) != (1, 1):
            raise SpecError("schedule.chunks", f"{self.comm} takes no chunks/group",
                            "drop them, or use the 'fine' pattern")

    @property
    def steps(self) -> int:
        """Sub-chunks per shard: the blocks of one shard, and the communication steps of FINE."""
        return self.chunks if self.comm is CommPattern.FINE else 1

    def __str__(self) -> str:
        if self.comm is CommPattern.SEQ:
            return f"seq/{self.engine}"
        if self.comm is CommPattern.P2P:
            return f"p2p/{self.engine}/{self.axis}"
        g = "peer" if self.group == PER_PEER else f"g{self.group}"
        return f"fine/{self.engine}/c{self.chunks}/{g}/{self.axis}"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """The schedule a text names (its `str`); a `SpecError` naming the forms otherwise.
        Each distinct text is parsed once: the custom ops, whose schema carries text, call this
        on every call."""
        return _parse(text)

    @classmethod
    def _from_text(cls, text: str) -> Schedule:
        parts = text.strip().split("/")
        try:
            comm, engine = CommPattern(parts[0]), Engine(parts[1])
            if comm is CommPattern.SEQ and len(parts) == 2:
                return cls(comm, engine)
            if comm is CommPattern.P2P and len(parts) == 3:
                return cls(comm, engine, axis=Axis(parts[2]))
            if comm is CommPattern.FINE and len(parts) == 5 and parts[2].startswith("c"):
                if parts[3] != "peer" and not parts[3].startswith("g"):
                    raise ValueError(parts[3])
                group = PER_PEER if parts[3] == "peer" else int(parts[3].removeprefix("g"))
                if group == PER_PEER and parts[3] != "peer":  # g0 is not a grouping
                    raise ValueError(parts[3])
                return cls(comm, engine, int(parts[2][1:]), group, Axis(parts[4]))
        except (ValueError, IndexError):
            pass
        raise SpecError("schedule", f"cannot parse {text!r}",
                        "write seq/ENGINE, p2p/ENGINE/AXIS or fine/ENGINE/cN/gG|peer/AXIS with "
                        "ENGINE sm|dma and AXIS M|K, e.g. fine/dma/c8/g1/M")


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Schedule:
    return Schedule._from_text(text)


ScheduleLike = Schedule | str


def as_schedule(s: ScheduleLike) -> Schedule:
    """A schedule given as a value or as its text: the value (parsed at this edge)."""
    return s if isinstance(s, Schedule) else Schedule.parse(s)


# Where a call may run any schedule, "auto" asks the job to measure the simulator's candidates
# and choose (`plait.tuning`); the choice is a schedule, or "auto" until the call runs.
Auto = Literal["auto"]
AUTO: Auto = "auto"
Choice = Schedule | Auto


def as_choice(s: ScheduleLike) -> Choice:
    """A schedule (as `as_schedule`), or "auto" as it is."""
    return AUTO if isinstance(s, str) and s.strip().lower() == AUTO else as_schedule(s)


SEQUENTIAL = Schedule()

MAX_CHUNKS = 16  # finer-grain sub-chunks per shard explored (c = 1, 2, 4, ..., 16)

# The families `schedule="auto"` proposes its candidates from (`plait.planner.propose`: the
# best of each), and how many it measures beside the baseline by default (`plait.tuning`).
FAMILIES = ((CommPattern.P2P, Engine.DMA), (CommPattern.FINE, Engine.DMA),
            (CommPattern.P2P, Engine.SM), (CommPattern.FINE, Engine.SM),
            (CommPattern.SEQ, Engine.DMA))
DEFAULT_CANDIDATES = 3


def candidate_schedules(axis: Axis, max_chunks: int = MAX_CHUNKS) -> Iterator[Schedule]:
    """Every point of the design space for a pair split along `axis` (feasible or not): the
    candidates of the explorer and the heuristics, in the explorer's order."""
    for engine in Engine:
        yield Schedule(CommPattern.SEQ, engine)
        yield Schedule(CommPattern.P2P, engine, axis=axis)
        c = 1
        while c <= max_chunks:
            g = 1
            while g <= c:
                yield Schedule(CommPattern.FINE, engine, c, g, axis)
                g *= 2
            yield Schedule(CommPattern.FINE, engine, c, PER_PEER, axis)
            c *= 2


def complexity(s: Schedule) -> tuple[int, int, int]:
    """Simpler first: sequential, then shard level, then finer grain by sub-chunks (steps) and
    GEMM pieces."""
    if s.comm is CommPattern.SEQ:
        return (0, 1, 1)
    if s.comm is CommPattern.P2P:
        return (1, 1, 1)
    return (2, s.chunks, s.chunks * 1000 if s.group == PER_PEER else s.chunks // s.group)


def simplest_within(items: Sequence[T], time: Callable[[T], float],
                    schedule: Callable[[T], Schedule], margin: float = SIMPLER_WITHIN) -> T:
    """Of `items` (schedules with predicted times), the simplest predicted within `margin` of
    the fastest; the faster of equally simple ones, the first of equals."""
    fastest = min(time(x) for x in items)
    near = [x for x in items if time(x) <= fastest * (1 + margin)]
    return min(near, key=lambda x: (complexity(schedule(x)), time(x)))
