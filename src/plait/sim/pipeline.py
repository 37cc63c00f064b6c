"""Pipeline schedules as per-rank action lists, and the step they take.

A schedule is, for each pipeline rank, the ordered list of compute actions it runs on its
stages (model chunks): `F` a micro-batch's forward through a stage, `B` its whole backward,
`I` and `W` the backward split into the input gradient and the weight gradient (zero-bubble
schedules), and `FB` a forward of one micro-batch overlapped with the backward of another (the
`OVERLAP_F_B` of PyTorch's DualPipeV, DHelix's co-execution). Three generators, written from
the published schedules: `one_f_one_b` (PipeDream-flush), `interleaved_1f1b` (Megatron-LM's,
v chunks a rank) and `dualpipe_v` (DeepSeek's DualPipe folded into a V: rank r holds stages r
and 2P-1-r). `simulate` runs the lists against each action's duration and the stage-to-stage
transfer time: every rank in its order, an action once its inputs are there. It gives the
step's makespan, each rank's busy time and bubble, the peak of activations held, and the
spans for a trace. Plain Python: the planning commands import no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from plait.errors import SpecError
from plait.sim.engine import Span, Task, Timeline


def idle_slots_s(fwd_s: float, bwd_s: float, layers: int, bubble_slots: float) -> float:
    """The idle time of `bubble_slots` micro-batch slots, each one plain forward and backward
    of a stage's `layers`."""
    return bubble_slots * layers * (fwd_s + bwd_s)


def stage_step_s(fwd_s: float, bwd_s: float, layers: int, micro_batches: int,
                 bubble_slots: float = 0.0, pair_s: float | None = None) -> float:
    """One stage's step by the per-stage model: every micro-batch through its `layers`,
    forward and backward, plus `bubble_slots` idle micro-batch slots of the pipeline
    (`ParallelSpec.bubble_slots`), each as long as one plain forward and backward. With
    `pair_s` (one co-executed layer pair: a forward beside another micro-batch's backward),
    the micro-batches after the first run as pairs: warm-up forward, k - 1 co-executed pairs,
    drain backward. `simulate` gives the same step for 1F1B without transfers (a test)."""
    idle = idle_slots_s(fwd_s, bwd_s, layers, bubble_slots)
    if pair_s is None or micro_batches < 2:
        return micro_batches * layers * (fwd_s + bwd_s) + idle
    return layers * (fwd_s + bwd_s + (micro_batches - 1) * pair_s) + idle


KINDS = ("F", "B", "I", "W", "FB")
CATEGORIES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "weight gradient",
              "FB": "forward + backward"}


@dataclass(frozen=True)
class Action:
    """`kind` on `stage` for micro-batch `mb`; an `FB` carries its forward and backward."""

    kind: str
    stage: int = -1
    mb: int = -1
    fwd: Action | None = None
    bwd: Action | None = None

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"{self.fwd}+{self.bwd}"
        return f"{self.kind}{self.stage}.{self.mb}"

    def parts(self) -> tuple[Action, ...]:
        return (self,) if self.kind != "FB" else (self.fwd, self.bwd)  # type: ignore[return-value]


@dataclass(frozen=True)
class PipelineSchedule:
    """`name`, the number of stages, the micro-batches, and each rank's actions."""

    name: str
    stages: int
    micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]
    _order: list[_Order] = field(default_factory=list, compare=False, repr=False)

    def steps(self) -> list[list[_Step]]:
        """Each rank's actions with what each waits for and completes."""
        return _steps(self)

    def order(self) -> _Order:
        """The actions in an order every simulation can price them in, worked out once."""
        if not self._order:
            self._order.append(_order_of(self))
        return self._order[0]


@dataclass(frozen=True)
class _Order:
    """A schedule's actions in dependency order (each after its rank's previous action and
    its inputs), as (rank, action, the previous action's index or -1, the inputs' (index,
    crosses to another rank)), with their cost keys priced once per simulation (`costed`)
    and the micro-batches each rank holds at its peak (which durations do not change)."""

    actions: tuple[tuple[int, Action, int, tuple[tuple[int, bool], ...], int], ...]
    costed: tuple[Action, ...]  # one action of each cost key, by the key's number
    peak: tuple[int, ...]


def _order_of(schedule: PipelineSchedule) -> _Order:
    """Each rank's actions taken as far as their inputs are done, round after round (the
    order PyTorch's runtime would find); a list that cannot make progress (an action
    waiting on one that never comes) is an error."""
    plans = schedule.steps()
    done: dict[tuple[str, int, int], int] = {}  # key -> the index of the action completing it
    keys: dict[CostKey, int] = {}
    costed: list[Action] = []
    pos = [0] * len(plans)
    last = [-1] * len(plans)
    held = [0] * len(plans)
    peak = [0] * len(plans)
    out: list[tuple[int, Action, int, tuple[tuple[int, bool], ...], int]] = []
    remaining = sum(len(p) for p in plans)
    while remaining:
        progressed = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                a, needs, completes, holds, key = plan[pos[r]]
                if any(k not in done for k, _ in needs):
                    break
                if key not in keys:
                    keys[key] = len(costed)
                    costed.append(a)
                out.append((r, a, last[r], tuple((done[k], c) for k, c in needs), keys[key]))
                last[r] = len(out) - 1
                for k in completes:
                    done[k] = last[r]
                for h in holds:
                    held[r] += h
                    peak[r] = max(peak[r], held[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r}: {acts[pos[r]]}" for r, acts in
                              enumerate(schedule.ranks) if pos[r] < len(acts))
            raise SpecError("schedule", f"{schedule.name} cannot make progress ({stuck})",
                            "give every action's inputs an earlier place in some rank's list")
    return _Order(tuple(out), tuple(costed), tuple(peak))


# What an action's duration depends on (`Costs.of`): its kind and stage, or its halves'
CostKey = tuple[object, ...]


def cost_key(a: Action) -> CostKey:
    if a.fwd is None or a.bwd is None:
        return (a.kind, a.stage)
    return (a.kind, a.fwd.kind, a.fwd.stage, a.bwd.kind, a.bwd.stage)


# an action, its inputs (done key, whether it crosses to another rank), the keys it completes,
# the change to the micro-batches held after each of its parts, and its cost key
_Step = tuple[Action, tuple[tuple[tuple[str, int, int], bool], ...],
              tuple[tuple[str, int, int], ...], tuple[int, ...], CostKey]


def _steps(schedule: PipelineSchedule) -> list[list[_Step]]:
    last = schedule.stages - 1
    rank_of = {p.stage: r for r, acts in enumerate(schedule.ranks) for a in acts
               for p in a.parts()}

    def inputs(p: Action, rank: int) -> tuple[tuple[tuple[str, int, int], bool], ...]:
        if p.kind == "F":
            return () if p.stage == 0 else ((("F", p.stage - 1, p.mb),
                                             rank_of[p.stage - 1] != rank),)
        if p.kind == "W":
            return ((("B", p.stage, p.mb), False),)
        own = (("F", p.stage, p.mb), False)
        return (own,) if p.stage == last else (own, (("B", p.stage + 1, p.mb),
                                                     rank_of[p.stage + 1] != rank))

    return [[(a, tuple(i for p in a.parts() for i in inputs(p, r)),
              tuple(("B" if p.kind == "I" else p.kind, p.stage, p.mb) for p in a.parts()),
              tuple(1 if p.kind == "F" else -1 if p.kind in ("B", "I") else 0
                    for p in a.parts()), cost_key(a))
             for a in acts] for r, acts in enumerate(schedule.ranks)]


def _need(cond: bool, field: str, problem: str, fix: str) -> None:
    if not cond:
        raise SpecError(field, problem, fix)


def one_f_one_b(pp: int, micro_batches: int) -> PipelineSchedule:
    """1F1B: rank r warms up with pp-1-r forwards, then alternates one forward and one
    backward, then drains its backwards."""
    _need(pp >= 1 and micro_batches >= 1, "pp", f"pp={pp}, {micro_batches} micro-batches",
          "use at least one stage and one micro-batch")
    ranks = []
    for r in range(pp):
        warm = min(pp - 1 - r, micro_batches)
        acts = [Action("F", r, m) for m in range(warm)]
        for m in range(micro_batches - warm):
            acts += [Action("F", r, warm + m), Action("B", r, m)]
        acts += [Action("B", r, m) for m in range(micro_batches - warm, micro_batches)]
        ranks.append(tuple(acts))
    return PipelineSchedule("1F1B", pp, micro_batches, tuple(ranks))


def interleaved_1f1b(pp: int, virtual: int, micro_batches: int) -> PipelineSchedule:
    """Interleaved 1F1B: rank r holds stages r, r+pp, ...; micro-batches run in rounds of pp
    through each of its chunks in turn (backward through the chunks in reverse), with
    2(pp-1-r) + (v-1)pp warm-up forwards. Needs micro-batches a multiple of pp."""
    _need(virtual >= 1, "virtual_stages", f"{virtual}", "use 1 or more chunks a rank")
    if virtual == 1:
        return one_f_one_b(pp, micro_batches)
    _need(micro_batches % pp == 0, "num_micro_batches",
          f"{micro_batches} micro-batches over {pp} stages", f"use a multiple of {pp} for "
          "interleaved 1F1B (micro-batches run in rounds of one per stage)")
    total = micro_batches * virtual

    def unit(k: int, backward: bool) -> tuple[int, int]:  # (chunk, micro-batch) of step k
        chunk = (k // pp) % virtual
        return (virtual - 1 - chunk if backward else chunk), (k // (pp * virtual)) * pp + k % pp

    ranks = []
    for r in range(pp):
        warm = min(2 * (pp - 1 - r) + (virtual - 1) * pp, total)
        fwd = [Action("F", unit(k, False)[0] * pp + r, unit(k, False)[1]) for k in range(total)]
        bwd = [Action("B", unit(k, True)[0] * pp + r, unit(k, True)[1]) for k in range(total)]
        acts = fwd[:warm]
        for k in range(total - warm):
            acts += [fwd[warm + k], bwd[k]]
        acts += bwd[total - warm:]
        ranks.append(tuple(acts))
    return PipelineSchedule(f"interleaved 1F1B (v={virtual})", pp * virtual, micro_batches,
                            tuple(ranks))


class _Units:
    """One rank's next micro-batch per stage, forward and backward, and its input gradients
    whose weight gradient is still due (oldest first)."""

    def __init__(self) -> None:
        self.nf: dict[int, int] = {}
        self.nb: dict[int, int] = {}
        self.weights: list[Action] = []

    def f(self, s: int) -> Action:
        self.nf[s] = self.nf.get(s, 0) + 1
        return Action("F", s, self.nf[s] - 1)

    def b(self, s: int, split: bool = False) -> Action:
        self.nb[s] = self.nb.get(s, 0) + 1
        a = Action("I" if split else "B", s, self.nb[s] - 1)
        if split:
            self.weights.append(Action("W", s, a.mb))
        return a

    def w(self) -> list[Action]:
        return [self.weights.pop(0)] if self.weights else []

    def fb(self, fs: int, bs: int) -> Action:
        return Action("FB", fwd=self.f(fs), bwd=self.b(bs))


def dualpipe_v(pp: int, micro_batches: int) -> PipelineSchedule:
    """DualPipeV: rank r holds stage r (going down) and stage 2pp-1-r (coming back up), so the
    first and last stages share rank 0 and a rank's two chunks are mirrored layers. Phases:
    forwards of the first chunk; both chunks' forwards; zero-bubble input gradients of the
    second chunk; the steady state, each step a forward overlapped with a backward (`FB`)
    alternating the chunks; then the drain, the last half of it zero-bubble (input and
    weight gradients apart). Needs at least 2pp micro-batches."""
    _need(micro_batches >= 2 * pp, "num_micro_batches", f"{micro_batches} micro-batches for "
          f"DualPipeV over {pp} ranks", f"use at least {2 * pp} (two per stage)")
    ranks = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        u = _Units()
        acts = [u.f(s0) for _ in range(2 * (pp - r - 1))]
        for _ in range(r + 1):
            acts += [u.f(s0), u.f(s1)]
        for _ in range(pp - r - 1):
            acts += [u.b(s1, split=True), *u.w(), u.f(s1)]
        for i in range(micro_batches - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:  # the turn of the V: no partner yet, run both alone
                acts += [u.f(s0), u.b(s1)]
            else:
                acts.append(u.fb(s0, s1))
            acts.append(u.fb(s1, s0))
        for _ in range(pp - r - 1):
            acts += [u.b(s1), u.fb(s1, s0)]
        split = False  # the second half of the drain splits input and weight gradients
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            acts.append(u.b(s1, split))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            acts.append(u.b(s0, split))
        for _ in range(pp - r - 1):
            acts += [*u.w(), u.b(s0, split)]
        while u.weights:
            acts += u.w()
        ranks.append(tuple(acts))
    return PipelineSchedule("DualPipeV", 2 * pp, micro_batches, tuple(ranks))


@dataclass(frozen=True)
class Costs:
    """Durations (seconds) of one stage's actions and of a stage-to-stage transfer. `fb`, the
    overlapped forward + backward of two stages, is by default the two one after the other
    (what PyTorch runs without a registered OVERLAP_F_B)."""

    forward: Callable[[int], float]
    backward: Callable[[int], float]  # the whole backward (input + weight gradients)
    weight: Callable[[int], float]  # the weight-gradient part of it
    transfer_s: float = 0.0
    fb: Callable[[int, int], float] | None = None

    def of(self, a: Action) -> float:
        if a.kind == "F":
            return self.forward(a.stage)
        if a.kind == "B":
            return self.backward(a.stage)
        if a.kind == "I":
            return self.backward(a.stage) - self.weight(a.stage)
        if a.kind == "W":
            return self.weight(a.stage)
        assert a.fwd is not None and a.bwd is not None
        if self.fb is not None:
            return self.fb(a.fwd.stage, a.bwd.stage)
        return self.of(a.fwd) + self.of(a.bwd)


@dataclass(frozen=True)
class PipelineSpan:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class PipelineRun:
    schedule: PipelineSchedule
    # each action as it ran: (rank, action, start, end); `spans` names them
    ran: tuple[tuple[int, Action, float, float], ...]
    peak_activations: tuple[int, ...]  # per rank: most stage-micro-batches held at once

    @cached_property
    def step_s(self) -> float:
        """When the last action ends."""
        return max((end for *_, end in self.ran), default=0.0)

    @cached_property
    def spans(self) -> tuple[PipelineSpan, ...]:
        return tuple(PipelineSpan(*r) for r in self.ran)

    def busy_s(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.rank == rank)

    @property
    def bubble_s(self) -> float:
        """The idle time of the busiest rank: the step less its work."""
        return self.step_s - max(self.busy_s(r) for r in range(len(self.schedule.ranks)))

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0

    def timeline(self) -> Timeline:
        """The step as a timeline for traces and pictures: one stream per rank, each action a
        span named after it (`F3.1`: forward of stage 3, micro-batch 1; `F3.1+B0.0` one
        overlapped with the other)."""
        spans = tuple(Span(Task(f"r{s.rank}:{n}:{s.action}", f"rank {s.rank}", s.end - s.start,
                                CATEGORIES[s.action.kind], label=str(s.action)), s.start, s.end)
                      for n, s in enumerate(self.spans))
        return Timeline(spans, tuple(f"rank {r}" for r in range(len(self.schedule.ranks))))


def simulate(schedule: PipelineSchedule, costs: Costs) -> PipelineRun:
    """Each rank runs its actions in order, each once the rank is free and its inputs are
    there: a forward after the previous stage's forward of that micro-batch (plus a transfer
    when that stage lives on another rank), a backward (or input gradient) after its own
    forward and the next stage's backward, a weight gradient after its input gradient. A list
    that cannot make progress (an action waiting on one that never comes) is an error. One
    pass over the actions in dependency order (`PipelineSchedule.order`), each priced once
    per cost key."""
    order = schedule.order()
    transfer = costs.transfer_s
    took = [costs.of(a) for a in order.costed]
    ends: list[float] = []
    ran: list[tuple[int, Action, float, float]] = []
    for r, a, prev, inputs, key in order.actions:
        start = ends[prev] if prev >= 0 else 0.0
        for j, crosses in inputs:
            t = ends[j] + transfer if crosses else ends[j]
            if t > start:
                start = t
        end = start + took[key]
        ends.append(end)
        ran.append((r, a, start, end))
    return PipelineRun(schedule, tuple(ran), order.peak)

