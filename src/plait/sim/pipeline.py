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
    _steps: list[list[_Step]] = field(default_factory=list, compare=False, repr=False)

    def steps(self) -> list[list[_Step]]:
        """Each rank's actions with what each waits for and completes, worked out once."""
        if not self._steps:
            self._steps.extend(_steps(self))
        return self._steps


# an action, its inputs (done key, whether it crosses to another rank), the keys it completes,
# and the change to the micro-batches held after each of its parts
_Step = tuple[Action, tuple[tuple[tuple[str, int, int], bool], ...],
              tuple[tuple[str, int, int], ...], tuple[int, ...]]


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
                    for p in a.parts()))
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
    spans: tuple[PipelineSpan, ...]
    peak_activations: tuple[int, ...]  # per rank: most stage-micro-batches held at once

    @property
    def step_s(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

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
    that cannot make progress (an action waiting on one that never comes) is an error."""
    transfer = costs.transfer_s
    took: dict[tuple[object, ...], float] = {}  # an action's duration by what it costs on

    def duration(a: Action) -> float:
        key = ((a.kind, a.stage) if a.fwd is None or a.bwd is None else
               (a.kind, a.fwd.kind, a.fwd.stage, a.bwd.kind, a.bwd.stage))
        t = took.get(key)
        if t is None:
            t = took[key] = costs.of(a)
        return t

    plans = [[(a, needs, completes, duration(a), holds) for a, needs, completes, holds in rank]
             for rank in schedule.steps()]
    done: dict[tuple[str, int, int], float] = {}  # ("F"|"B"|"W", stage, mb) -> end time
    pos = [0] * len(schedule.ranks)
    free = [0.0] * len(schedule.ranks)
    held = [0] * len(schedule.ranks)
    peak = [0] * len(schedule.ranks)
    spans: list[PipelineSpan] = []
    remaining = sum(len(a) for a in schedule.ranks)
    while remaining:
        progressed = False
        for r, plan in enumerate(plans):
            i, start_r, n = pos[r], free[r], len(plan)
            while i < n:  # this rank's actions, as far as their inputs are done
                a, needs, completes, seconds, holds = plan[i]
                start = start_r
                for key, crosses in needs:
                    t = done.get(key)
                    if t is None:
                        break
                    if crosses:
                        t += transfer
                    if t > start:
                        start = t
                else:
                    end = start_r = start + seconds
                    for key in completes:
                        done[key] = end
                    for h in holds:
                        held[r] += h
                        if held[r] > peak[r]:
                            peak[r] = held[r]
                    spans.append(PipelineSpan(r, a, start, end))
                    i += 1
                    continue
                break
            if i > pos[r]:
                remaining -= i - pos[r]
                pos[r], free[r], progressed = i, start_r, True
        if not progressed:
            stuck = ", ".join(f"rank {r}: {acts[pos[r]]}" for r, acts in
                              enumerate(schedule.ranks) if pos[r] < len(acts))
            raise SpecError("schedule", f"{schedule.name} cannot make progress ({stuck})",
                            "give every action's inputs an earlier place in some rank's list")
    return PipelineRun(schedule, tuple(spans), tuple(peak))
