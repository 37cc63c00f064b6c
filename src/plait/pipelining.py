"""plait's overlap as the `OVERLAP_F_B` of PyTorch's pipeline schedules (DualPipeV).

    from torch.distributed.pipelining import ScheduleDualPipeV
    from plait.pipelining import overlap_f_b

    schedule = ScheduleDualPipeV([stage_down, stage_up], n_microbatches=8, loss_fn=loss_fn)
    overlap = overlap_f_b(schedule)      # registers itself; overlap.records says what ran
    schedule.step(x, target=y)

Without it PyTorch runs each `OVERLAP_F_B` action's forward and then its backward. With it
the forward of one micro-batch (this thread) and the backward of the other (a second thread)
run at once: each strand's compute beside the other's communication. The strands never share
a communicator: each group the stages' plait layers use (`plait.nn`) gets a twin of the same
ranks for the backward strand (`plait.runtime.strands`), so both communicate at once and
every rank issues each communicator's collectives in one order. One strand computes at a
time and hands over while it waits on communication (on a CPU, where the strands share the
cores, they would only slow each other). With `order` (each call a
strand letter "F" or "B") they share the groups instead and take turns, one op at a time.

With `plan=True` the strands run a co-execution plan (`plait.schedule.coexec`, DHelix's dynamic
programming) instead of freely. The first `OVERLAP_F_B` of each pair of stages runs forward
then backward and times each strand's units: its plait calls (with the compute before each)
and its weight-gradient GEMMs, split into compute and waiting on communication. The group's
ranks take the slowest of their timings (so every rank plans alike), and the planner aligns
the two strands into blocks, moving weight gradients later where that helps (nothing in the
stage consumes them). Every later action of that pair runs the plan's blocks: a strand starts
a block's units once the other is done with the blocks before, and the moved weight
gradients are deferred (`plait.runtime.strands.weight_grad`) and accumulate into their
parameters' `.grad` in their planned block. A block's cost, on one issuing thread: its two
strands' compute one after the other, or the longer strand with its waits, whichever is more.
The bookkeeping around the two halves (waiting for the received activations and gradients,
the loss, handing a chunk's output to the rank's other stage) is PyTorch's own, as its
runtime does for the two halves one after the other.

Stages must communicate only through plait's ops: a stage with another collective inside
would race the other strand's on its group. A stage whose module holds no plait layer, or
whose parameters communicate outside plait (`plait.nn.outside_plait`: PyTorch's own TP
styles, FSDP), runs PyTorch's order (forward, then backward) and the record says why: never a
silent overlap that could deadlock. Collectives a stage's code issues by itself (a DTensor
redistribute in its forward, say) cannot be seen: keep them out of stages.
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
from plait.runtime import strands
from plait.runtime.timing import timed
from plait.schedule.coexec import CoexecPlan
from plait.tracing import strand_range
from plait.tuning.decide import Candidate, decide


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


@dataclass(frozen=True)
class StagePlan:
    """The co-execution plan of one (forward stage, backward stage) pair and the timed units
    it was made from (the slowest rank's)."""

    plan: CoexecPlan
    fwd: tuple[strands.TimedUnit, ...]
    bwd: tuple[strands.TimedUnit, ...]
    deferred: frozenset[str]  # the weight gradients the plan moves

    @property
    def sequential_s(self) -> float:
        """Forward then backward, as timed."""
        return sum(u.compute_s + u.wait_s for u in (*self.fwd, *self.bwd))

    def block_of(self) -> dict[str, dict[str, int]]:
        return {"F": {n: i for i, b in enumerate(self.plan.blocks) for n in b.fwd},
                "B": {n: i for i, b in enumerate(self.plan.blocks) for n in b.bwd}}


@dataclass(frozen=True)
class Verdict:
    """What one pair of stages runs after its measured actions: the overlap, or PyTorch's
    order (forward then backward), and why."""

    overlap: bool
    overlapped_s: float  # median action time, the slowest rank of the stages' groups
    sequential_s: float  # the same in PyTorch's order
    reason: str


@dataclass
class _ActionTrial:
    """A pair of stages' first actions: PyTorch's order and the overlap alternately, the
    first of each untimed (set-up), then timed."""

    measure: int  # timed actions of each kind
    count: int = 0
    sequential: list[float] = field(default_factory=list)
    overlapped: list[float] = field(default_factory=list)

    @property
    def sequential_next(self) -> bool:
        return self.count % 2 == 0

    @property
    def timed_next(self) -> bool:
        return self.count >= 2

    @property
    def total(self) -> int:
        return 2 + 2 * self.measure


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
                streams: bool = False, measure: int = 2) -> Overlap:
    """Register plait's `OVERLAP_F_B` with `schedule` (a `_PipelineScheduleRuntime`, such as
    `ScheduleDualPipeV`); returns the registered `Overlap`, whose `records` list each action
    (and `plans`, with `plan=True`, each pair of stages' plan; `verdicts`, each pair's
    choice). `streams`: each CUDA stage computes on a stream of its own
    (`stream_per_stage`), so the strands' kernels can run at once on the device.

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
    if streams:
        overlap.streams = stream_per_stage(schedule)
    if order is None:  # each strand its own communicators: no turns needed
        overlap.twins = _pair_groups(schedule)
    schedule.register_custom_function(OVERLAP_F_B, overlap)
    return overlap


class TensorParallelStage(torch.nn.Module):
    """A pipeline stage of tensor-parallel modules, as `PipelineStage` takes it: plain
    tensors in and out. Modules parallelized the torchtitan way (`plait.parallel.llama_plan`,
    `llama_block_plan`) pass their activations on as `DTensor`s sharded along the sequence,
    which a stage cannot send; this wrapper takes each floating-point tensor argument as this
    rank's sequence shard (`Shard(seq_dim)` on `mesh`) and hands back each `DTensor` output
    as this rank's shard, in storage of its own (the schedule detaches stage outputs in
    place). Other arguments (token ids) pass as they are.

    `seq_dim`: where the sequence lies in the activations; by default the Llama layout's
    (`plait.parallel.layout_seq_dim`: 0 for torchtitan's 2026 decoders, fed flattened tokens),
    else 1. A floating-point input whose last dimension (the hidden one) it would shard is
    refused in one line naming the `seq_dim` to pass."""

    def __init__(self, module: torch.nn.Module, mesh: Any, seq_dim: int | None = None) -> None:
        super().__init__()
        if seq_dim is None:
            from plait.parallel import layout_seq_dim, llama_names_of

            try:
                seq_dim = layout_seq_dim(llama_names_of(module))
            except SpecError:  # not a Llama: (batch, sequence, hidden)
                seq_dim = 1
        self.module, self.mesh, self.seq_dim = module, mesh, seq_dim

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_map

        return tree_map(self._local, self.module(*tree_map(self._sharded, args),
                                                 **tree_map(self._sharded, kwargs)))

    def _sharded(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and \
                x.is_floating_point():
            if self.seq_dim % x.dim() == x.dim() - 1:
                raise SpecError("seq_dim", f"{self.seq_dim} is the hidden dimension of the "
                                f"stage's input {tuple(x.shape)}", "pass seq_dim=0 for "
                                "flattened tokens (tokens, hidden), or where your activations "
                                "hold the sequence")
            return DTensor.from_local(x, self.mesh, [Shard(self.seq_dim)], run_check=False)
        return x

    def _local(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return x.to_local().clone() if isinstance(x, DTensor) else x


def stream_per_stage(schedule: Any) -> dict[int, Any]:
    """Run each CUDA stage's forward and backward on a stream of its own; returns them by
    stage (none for CPU stages). Autograd runs each backward op on the stream its forward op
    ran on, so a stream set in the backward thread would do nothing: instead every forward of
    a stage (in every action, overlapped or not) runs on the stage's stream, and its backward
    follows it there. The stream first waits for the caller's (the received inputs, the
    schedule's work so far), the caller waits for it after (the sends, the loss), both by
    events, and the tensors handed back are recorded on the caller's stream, so the caching
    allocator does not reuse them early. Never run on a GPU yet."""

    streams: dict[int, Any] = {}
    for stage in schedule._stages:
        if torch.device(stage.device).type != "cuda":
            continue
        stream = streams[stage.stage_index] = torch.cuda.Stream(device=stage.device)
        stage.forward_one_chunk = _on_stream(stage.forward_one_chunk, stream,
                                             lambda mb, out: out)
        stage.backward_one_chunk = _on_stream(stage.backward_one_chunk, stream,
                                              lambda mb, out, st=stage: st.bwd_cache.get(mb))
    return streams


def _on_stream(run: Any, stream: Any, handed: Any) -> Any:
    """`run(mb, ...)` on `stream`, ordered after the caller's stream and before it by
    events; the tensors `handed(mb, out)` gives back are recorded on the caller's stream."""
    from torch.utils._pytree import tree_leaves

    def on_stream(mb: int, *args: Any, **kwargs: Any) -> Any:
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out = run(mb, *args, **kwargs)
        caller.wait_stream(stream)
        for t in tree_leaves(handed(mb, out)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)
        return out

    return on_stream


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
    elif mode is _Mode.TIME_UNITS:
        _time_units(overlap, act)
    elif mode is _Mode.MEASURE_IN_ORDER:
        _measure_in_order(overlap, act)
    else:
        _overlap(overlap, act)


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
    trial = _trial(overlap, act.key)
    if trial is not None and trial.sequential_next:
        return _Mode.MEASURE_IN_ORDER, ""
    return _Mode.OVERLAP, ""


def _trial(overlap: Overlap, key: tuple[int, int]) -> _ActionTrial | None:
    """The pair of stages' trial, begun at its first action; None once decided (or with
    `measure=0`)."""
    if key in overlap.verdicts or overlap.measure == 0:
        return None
    return overlap.trials.setdefault(key, _ActionTrial(overlap.measure))


def _time_units(overlap: Overlap, act: _Action) -> None:
    """PyTorch's order with each strand's units timed; the pair of stages' plan made from
    them (the overlap runs it from the next action on)."""
    with strands.units("F") as fu:
        act.forward()
    with strands.units("B") as bu:
        act.backward()
    overlap.plans[act.key] = _plan(fu.ran, bu.ran, [act.f_stage, act.b_stage])
    overlap.records.append(act.record(False, "timed its units for the plan of stages "
                                      f"{act.fs} and {act.bs}: run forward then backward"))
    trial = _trial(overlap, act.key)
    if trial is not None:  # PyTorch's order, set up: the trial's first action
        trial.count += 1


def _measure_in_order(overlap: Overlap, act: _Action) -> None:
    """PyTorch's order, timed, as the trial's candidate against the overlap."""
    trial = overlap.trials[act.key]
    _, seconds = timed(act.in_order, act.device)
    if trial.timed_next:
        trial.sequential.append(seconds + _penalty(overlap, IN_ORDER))
    trial.count += 1
    overlap.records.append(act.record(
        False, f"measuring stages {act.fs} and {act.bs}: PyTorch's order against the "
        f"overlap, action {trial.count} of {trial.total}"))
    _maybe_decide(overlap, act.key, trial, [act.f_stage, act.b_stage])


def _overlap(overlap: Overlap, act: _Action) -> None:
    """The forward on this thread and the backward on a second one, on the strands engine
    (freely, in the given order, or in the plan's blocks); timed while under trial."""
    stage_plan = overlap.plans.get(act.key)
    blocks = None if stage_plan is None else strands.Blocks(stage_plan.block_of())
    deferred = frozenset() if stage_plan is None else stage_plan.deferred
    failure: list[BaseException] = []
    threads = torch.get_num_threads()  # a new thread would start with the default (every core)
    queued: list[int] = []

    def backward_strand() -> None:
        try:
            torch.set_num_threads(threads)
            with strands.strand("B"), strands.units("B", blocks, deferred) as u:
                act.backward()
                queued.append(len(u.queue))
        except BaseException as exc:  # re-raised on the calling thread
            failure.append(exc)

    def both() -> strands.Turnstile:
        with strands.turnstile(overlap.order, overlap.twins, blocks) as gate:
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
    trial = overlap.trials.get(act.key)
    why = ""
    if trial is not None:
        if trial.timed_next:
            trial.overlapped.append(seconds + _penalty(overlap, OVERLAPPED))
        trial.count += 1
        why = (f"measuring stages {act.fs} and {act.bs}: the overlap against PyTorch's "
               f"order, action {trial.count} of {trial.total}")
    overlap.records.append(act.record(
        True, why, calls=tuple(gate.ran + gate.own), planned=blocks is not None,
        deferred=sum(queued), stray=tuple(blocks.stray) if blocks is not None else ()))
    if trial is not None:
        _maybe_decide(overlap, act.key, trial, [act.f_stage, act.b_stage])


def _penalty(overlap: Overlap, candidate: str) -> float:
    return 0.0 if overlap.penalty is None else overlap.penalty(candidate)


IN_ORDER, OVERLAPPED = "PyTorch's order", "the overlap"  # the two candidates of an action


def _maybe_decide(overlap: Overlap, key: tuple[int, int], trial: _ActionTrial,
                  stages: list[Any]) -> None:
    """After the trial's last action: the faster way for this pair of stages, from the
    slowest rank's times, alike on every rank of the stages' groups, by `schedule="auto"`'s
    rule (`plait.tuning.decide`: the overlap must win by more than the spread)."""
    if trial.count < trial.total:
        return
    n = trial.measure
    times = _slowest(stages, [*trial.sequential, *trial.overlapped])
    order, ovl = Candidate(IN_ORDER, None, tuple(times[:n])), \
        Candidate(OVERLAPPED, None, tuple(times[n:]))
    d = decide(f"stages {key[0]} and {key[1]}", [order, ovl], baseline=IN_ORDER)
    win = d.choice == OVERLAPPED
    reason = f"{d.key} (an action each, median of {n}): {d.reason}" + (
        "" if win else ": run forward then backward")
    overlap.verdicts[key] = Verdict(win, ovl.measured_s or 0.0, order.measured_s or 0.0,
                                    reason)
    del overlap.trials[key]


def _slowest(stages: list[Any], values: list[float]) -> list[float]:
    """`values` as their largest over every rank the stages' plait groups connect (as many
    rounds as groups, so a rank two groups away counts too)."""
    import torch.distributed as dist

    from plait.ops import group_key, runtime_of

    table = torch.tensor(values, dtype=torch.float64)
    keys = sorted({group_key(g) for st in stages for g in plait_groups(st.submod)})
    for _ in keys:
        for key in keys:
            rt = runtime_of(key)
            moved = table.to(rt.device)
            dist.all_reduce(moved, dist.ReduceOp.MAX, group=rt.group)
            table = moved.cpu()
    return [float(v) for v in table]


def _plan(fwd: list[strands.TimedUnit], bwd: list[strands.TimedUnit], stages: list[Any]
          ) -> StagePlan:
    """The plan of two stages' strands from their timed units, the same on every rank: each
    unit's times are the slowest of the ranks that share the stages' groups, and a weight
    gradient is moved only if every rank can defer it."""
    from plait.schedule.coexec import plan_with_moves

    units = [*fwd, *bwd]
    flat = _slowest(stages, [x for u in units for x in (u.compute_s, u.wait_s,
                                                         0.0 if u.deferrable else 1.0)])
    agreed = [strands.TimedUnit(u.name, u.group, c, w, not nd)  # nd: any rank cannot defer
              for u, (c, w, nd) in zip(units, zip(flat[::3], flat[1::3], flat[2::3],
                                                  strict=True), strict=True)]
    f_units, b_units = tuple(agreed[:len(fwd)]), tuple(agreed[len(fwd):])
    by_name = {("F", u.name): u for u in f_units} | {("B", u.name): u for u in b_units}
    group = {u.name: u.group for u in agreed}

    def total(strand: str, names: tuple[str, ...]) -> float:
        return sum(by_name[strand, n].compute_s + by_name[strand, n].wait_s for n in names)

    def compute(strand: str, names: tuple[str, ...]) -> float:
        return sum(by_name[strand, n].compute_s for n in names)

    def pair(f: tuple[str, ...], b: tuple[str, ...]) -> float:
        return max(compute("F", f) + compute("B", b), total("F", f), total("B", b))

    movable = [u.name for u in b_units if u.group is None and u.deferrable]
    plan = plan_with_moves([u.name for u in f_units], [u.name for u in b_units], group.get,
                           total, pair, movable)
    return StagePlan(plan, f_units, b_units, frozenset(plan.moved))
