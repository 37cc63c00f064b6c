"""plait's `OVERLAP_F_B`: `overlap_f_b` registers an `Overlap` with a PyTorch schedule; each action
reads like DualPipe's `step()`: its inputs received (`_Action`), a mode chosen once (`_mode`),
then that mode's verb (`_time_units`, `_measure_in_order`, `_overlap`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch.profiler import record_function

from plait.errors import SpecError
from plait.nn import outside_plait, plait_groups
from plait.pipelining.measured import (
    IN_ORDER,
    OVERLAPPED,
    StagePlan,
    Verdict,
    _ActionTrial,
    _maybe_decide,
    _plan,
)
from plait.pipelining.stages import callers_stream, stream_per_stage
from plait.runtime import strands
from plait.runtime.timing import device_sync, timed
from plait.tracing import strand_range


@dataclass(frozen=True)
class OverlapRecord:
    forward: tuple[int, int]  # (stage, micro-batch)
    backward: tuple[int, int]
    overlapped: bool  # False: run forward then backward (the reason says why)
    calls: tuple[tuple[str, str], ...] = ()  # (strand, op) of the plait calls made
    reason: str = ""
    planned: bool = False  # ran the blocks of its stages' plan (`Overlap.plans`)
    deferred: int = 0  # weight gradients run later than autograd would
    stray: tuple[tuple[str, str], ...] = ()  # (strand, unit) the plan did not name


@dataclass
class Overlap:
    """The registered function and what it ran, action by action."""

    order: Sequence[str] | None = None
    plan: bool = False
    measure: int = 2  # timed actions of each kind per pair of stages before choosing (0: none)
    verdicts: dict[tuple[int, int], Verdict] = field(default_factory=dict)
    trials: dict[tuple[int, int], _ActionTrial] = field(default_factory=dict)
    plans: dict[tuple[int, int], StagePlan] = field(default_factory=dict)
    records: list[OverlapRecord] = field(default_factory=list)
    twins: dict[str, str] = field(default_factory=dict)  # group -> the backward strand's
    streams: dict[int, Any] = field(default_factory=dict)  # stage -> its CUDA stream
    unsafe: dict[int, str] = field(default_factory=dict)  # stage -> why it is not overlapped
    penalty: Callable[[str], float] | None = None  # seconds added to each timed action of a
    # candidate (IN_ORDER or OVERLAPPED), as slower hardware would add them: how tests steer
    # the choice, injected here rather than slowing the runtime

    def __call__(self, action: Any, ctx: Any) -> None:
        _run(self, action, ctx)


_NEEDED = ("_stages", "fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_n_microbatches",
           "_maybe_compute_loss", "_maybe_get_loss", "register_custom_function")


def overlap_f_b(schedule: Any, order: Sequence[str] | None = None, plan: bool = False,
                streams: bool | None = None, measure: int = 2) -> Overlap:
    """Register plait's `OVERLAP_F_B` with `schedule` (a `_PipelineScheduleRuntime`, such as
    `ScheduleDualPipeV`); returns the registered `Overlap`, whose `records` list each action
    (and `plans`, with `plan=True`, each pair of stages' plan; `verdicts`, each pair's
    choice). `streams`: each CUDA stage computes on a stream of its own
    (`stream_per_stage`), so the strands' kernels can run at once on the device; None (the
    default): wherever a stage is on CUDA.

    Without `order` each strand communicates on a communicator of its own (a twin of each
    group), in its own order. On CUDA that holds only while the strands compute on streams of
    their own: on one stream the collectives of two communicators, issued in host orders
    that differ between ranks, queue behind each other (a wait cycle across ranks). An
    action whose two halves would share a stream (`streams=False`, or both halves on one
    stage) runs its strands in ordered turns instead, and its record says so.

    `measure`: each pair of stages first runs its actions in PyTorch's order and overlapped
    alternately (the first of each untimed), `measure` timed actions of each, and keeps the
    overlap only if it is faster by more than the spread of the timings (the slowest rank of
    the stages' groups per action; every rank of them chooses alike); otherwise it runs
    PyTorch's order and the verdict says by how much overlap lost. 0: always overlap."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    missing = [a for a in _NEEDED if not hasattr(schedule, a)]
    if missing:
        raise SpecError("schedule", f"{type(schedule).__name__} lacks {', '.join(missing)} "
                        "(not a PyTorch runtime schedule, or another PyTorch version)",
                        "pass a torch.distributed.pipelining schedule that emits OVERLAP_F_B, "
                        "e.g. ScheduleDualPipeV")
    if order is not None and any(x not in ("F", "B") for x in order):
        raise SpecError("order", "letters other than F and B", "give one 'F' or 'B' per call")
    if order is not None and plan:
        raise SpecError("plan", "a plan and an order of calls both given",
                        "pass one: the plan orders the calls itself")
    if isinstance(measure, bool) or not isinstance(measure, int) or measure < 0:
        raise SpecError("measure", f"{measure!r}", "use 0 (always overlap) or more timed "
                        "actions of each kind")
    unsafe: dict[int, str] = {}
    for stage in schedule._stages:
        if (why := outside_plait(stage.submod)) is not None:
            unsafe[stage.stage_index] = f"communicates outside plait ({why})"
        elif not plait_groups(stage.submod):
            unsafe[stage.stage_index] = "has no plait layer"
    overlap = Overlap(order, plan, measure, unsafe=unsafe)
    if streams or streams is None:
        overlap.streams = stream_per_stage(schedule)
    if order is None:  # each strand its own communicators: no turns needed
        overlap.twins = _pair_groups(schedule)
    schedule.register_custom_function(OVERLAP_F_B, overlap)
    return overlap


def _pair_groups(schedule: Any) -> dict[str, str]:
    """A twin (the same ranks, a communicator of its own) for each group the stages' plait
    layers use, for the backward strand; created on every rank of each group, in the stages'
    order (every rank holds the same layers)."""
    import torch.distributed as dist

    from plait.ops import group_key, runtime_of

    twins: dict[str, str] = {}
    for stage in schedule._stages:
        for group in plait_groups(stage.submod):
            key = group_key(group)
            if key not in twins:
                pg = runtime_of(key).group
                twin = dist.new_group(dist.get_process_group_ranks(pg),
                                      backend=dist.get_backend(pg),
                                      use_local_synchronization=True)
                twins[key] = group_key(twin)
    return twins


class _Action:
    """One `OVERLAP_F_B` action: its forward half (stage `fs`, micro-batch `fm`) and its
    backward half (`bs`, `bm`), each as PyTorch's runtime runs it."""

    def __init__(self, action: Any, ctx: Any) -> None:
        self.ctx, self.sched = ctx, ctx.schedule_ref
        self.stages = {s.stage_index: s for s in self.sched._stages}
        fwd, bwd = action.sub_actions
        self.fs, self.fm = fwd.stage_index, fwd.microbatch_index
        self.bs, self.bm = bwd.stage_index, bwd.microbatch_index
        self.f_stage, self.b_stage = self.stages[self.fs], self.stages[self.bs]
        self.key = (self.fs, self.bs)
        self.device = torch.device(self.f_stage.device)

    def receive(self) -> None:
        """The received activations and gradients, waited for on this thread, as the runtime
        does before each half."""
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        if not self.f_stage.is_first and self.fs - 1 not in self.stages:
            _wait_batch_p2p(self.sched.fwd_recv_ops.pop((self.fs, self.fm)))
        if not self.b_stage.is_last and self.bs + 1 not in self.stages:
            _wait_batch_p2p(self.sched.bwd_recv_ops.pop((self.bs, self.bm)))

    def forward(self) -> None:
        fs, fm, ctx = self.fs, self.fm, self.ctx
        with record_function(strand_range("F", fs, fm)):  # each strand's span in a trace
            out = self.f_stage.forward_one_chunk(fm, ctx.arg_mbs[fm], ctx.kwarg_mbs[fm])
            self.sched._maybe_compute_loss(self.f_stage, out, ctx.target_mbs, fm)
            if fs + 1 in self.stages:  # the rank's other stage takes it without a send
                self.stages[fs + 1].set_local_fwd_input(out, fm)

    def backward(self) -> None:
        bs, bm, sched = self.bs, self.bm, self.sched
        with record_function(strand_range("B", bs, bm)):
            loss = sched._maybe_get_loss(self.b_stage, bm)
            sched.backward_counter[bs] += 1
            last = sched.backward_counter[bs] == sched._n_microbatches
            self.b_stage.backward_one_chunk(bm, loss=loss, full_backward=True,
                                            last_backward=last)
            if bs - 1 in self.stages:
                self.stages[bs - 1].set_local_bwd_input(self.b_stage.get_local_bwd_output(bm),
                                                        bm)

    def in_order(self) -> None:
        """PyTorch's order: the forward, then the backward."""
        self.forward()
        self.backward()

    def record(self, overlapped: bool, reason: str, **more: Any) -> OverlapRecord:
        return OverlapRecord((self.fs, self.fm), (self.bs, self.bm), overlapped,
                             reason=reason, **more)


class _Mode(Enum):
    """What an action runs, chosen once per action (`_mode`)."""

    IN_ORDER = "PyTorch's order, decided (or the stages cannot overlap)"
    TIME_UNITS = "PyTorch's order, each strand's units timed for the plan"
    MEASURE_IN_ORDER = "PyTorch's order, timed against the overlap"
    OVERLAP = "the overlap"


def _run(overlap: Overlap, action: Any, ctx: Any) -> None:
    """One `OVERLAP_F_B`: its inputs received, a mode chosen, the mode's verb run."""
    act = _Action(action, ctx)
    act.receive()
    mode, why = _mode(overlap, act)
    if mode is _Mode.IN_ORDER:
        act.in_order()
        overlap.records.append(act.record(False, why))
        return
    trial = _trial(overlap, act.key)
    if mode is _Mode.TIME_UNITS:
        _time_units(overlap, act, trial)
    elif mode is _Mode.MEASURE_IN_ORDER:
        assert trial is not None
        _measure_in_order(overlap, act, trial)
    else:
        _overlap(overlap, act, trial)


def _mode(overlap: Overlap, act: _Action) -> tuple[_Mode, str]:
    """The mode of this action, and why where it runs PyTorch's order for good."""
    unsafe = [f"stage {s} {overlap.unsafe[s]}" for s in dict.fromkeys(act.key)
              if s in overlap.unsafe]
    if unsafe:
        return _Mode.IN_ORDER, f"{'; '.join(unsafe)}: run forward then backward"
    verdict = overlap.verdicts.get(act.key)
    if verdict is not None and not verdict.overlap:
        return _Mode.IN_ORDER, verdict.reason
    if overlap.plan and act.key not in overlap.plans:
        return _Mode.TIME_UNITS, ""
    trial = overlap.trials.get(act.key)
    if verdict is None and overlap.measure > 0 and (trial is None or trial.sequential_next):
        return _Mode.MEASURE_IN_ORDER, ""
    return _Mode.OVERLAP, ""


def _trial(overlap: Overlap, key: tuple[int, int]) -> _ActionTrial | None:
    """The pair of stages' trial, begun at its first action; None once decided (or with
    `measure=0`)."""
    if key in overlap.verdicts or overlap.measure == 0:
        return None
    return overlap.trials.setdefault(key, _ActionTrial(overlap.measure))


def _time_units(overlap: Overlap, act: _Action, trial: _ActionTrial | None) -> None:
    """PyTorch's order with each strand's units timed (on a GPU by the device's work, not
    its launches); the pair of stages' plan made from them (the overlap runs it from the
    next action on)."""
    sync = device_sync(act.device)
    with strands.units("F", sync=sync) as fu:
        act.forward()
    with strands.units("B", sync=sync) as bu:
        act.backward()
    overlap.plans[act.key] = _plan(fu.ran, bu.ran, [act.f_stage, act.b_stage])
    overlap.records.append(act.record(False, "timed its units for the plan of stages "
                                      f"{act.fs} and {act.bs}: run forward then backward"))
    if trial is not None:  # PyTorch's order, set up: the trial's first action
        trial.count += 1


def _measure_in_order(overlap: Overlap, act: _Action, trial: _ActionTrial) -> None:
    """PyTorch's order, timed, as the trial's candidate against the overlap."""
    _, seconds = timed(act.in_order, act.device)
    if trial.timed_next:
        trial.sequential.append(seconds + _penalty(overlap, IN_ORDER))
    trial.count += 1
    overlap.records.append(act.record(
        False, f"measuring stages {act.fs} and {act.bs}: PyTorch's order against the "
        f"overlap, action {trial.count} of {trial.total}"))
    _maybe_decide(overlap, act.key, trial, [act.f_stage, act.b_stage])


def _twins(overlap: Overlap, act: _Action) -> tuple[dict[str, str], str]:
    """The twins this action's strands communicate on, and a note where they take ordered
    turns instead: on CUDA, twins only while the two halves compute on streams of their own
    (see `overlap_f_b`)."""
    if not overlap.twins or act.device.type != "cuda":
        return overlap.twins, ""
    f, b = overlap.streams.get(act.fs), overlap.streams.get(act.bs)
    if f is not None and b is not None and f is not b:
        return overlap.twins, ""
    return {}, ("strands in ordered turns: both halves compute on one CUDA stream, where "
                "communicators of their own could wait on each other across ranks")


def _overlap(overlap: Overlap, act: _Action, trial: _ActionTrial | None) -> None:
    """The forward on this thread and the backward on a second one, on the strands engine
    (freely, in the given order, or in the plan's blocks); timed while under trial. The
    backward strand's thread runs on this thread's CUDA device and current stream (a new
    thread would start on device 0's default stream)."""
    stage_plan = overlap.plans.get(act.key)
    blocks = None if stage_plan is None else strands.Blocks(stage_plan.block_of())
    deferred = frozenset() if stage_plan is None else stage_plan.deferred
    failure: list[BaseException] = []
    threads = torch.get_num_threads()  # a new thread would start with the default (every core)
    queued: list[int] = []
    on_callers_stream = callers_stream(act.device)
    twins, note = _twins(overlap, act)

    def backward_strand() -> None:
        try:
            torch.set_num_threads(threads)
            with on_callers_stream(), strands.strand("B"), \
                    strands.units("B", blocks, deferred) as u:
                act.backward()
                queued.append(len(u.queue))
        except BaseException as exc:  # re-raised on the calling thread
            failure.append(exc)

    def both() -> strands.Turnstile:
        with strands.turnstile(overlap.order, twins, blocks) as gate:
            worker = threading.Thread(target=backward_strand, name="plait-backward-strand")
            worker.start()
            try:
                with strands.strand("F"), strands.units("F", blocks):
                    act.forward()
            finally:
                worker.join()
        return gate

    gate, seconds = timed(both, act.device)
    if failure:
        raise failure[0]
    why = note
    if trial is not None:
        if trial.timed_next:
            trial.overlapped.append(seconds + _penalty(overlap, OVERLAPPED))
        trial.count += 1
        why = "; ".join(filter(None, (
            f"measuring stages {act.fs} and {act.bs}: the overlap against PyTorch's "
            f"order, action {trial.count} of {trial.total}", note)))
    overlap.records.append(act.record(
        True, why, calls=tuple(gate.ran + gate.own), planned=blocks is not None,
        deferred=sum(queued), stray=tuple(blocks.stray) if blocks is not None else ()))
    if trial is not None:
        _maybe_decide(overlap, act.key, trial, [act.f_stage, act.b_stage])


def _penalty(overlap: Overlap, candidate: str) -> float:
    return 0.0 if overlap.penalty is None else overlap.penalty(candidate)
