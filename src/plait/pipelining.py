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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from plait.errors import SpecError
from plait.nn import outside_plait, plait_groups
from plait.runtime import strands


@dataclass(frozen=True)
class OverlapRecord:
    forward: tuple[int, int]  # (stage, micro-batch)
    backward: tuple[int, int]
    overlapped: bool  # False: run forward then backward (the reason says why)
    calls: tuple[tuple[str, str], ...] = ()  # (strand, op) of the plait calls made
    reason: str = ""


@dataclass
class Overlap:
    """The registered function and what it ran, action by action."""

    order: Sequence[str] | None = None
    records: list[OverlapRecord] = field(default_factory=list)
    twins: dict[str, str] = field(default_factory=dict)  # group -> the backward strand's
    unsafe: dict[int, str] = field(default_factory=dict)  # stage -> why it is not overlapped

    def __call__(self, action: Any, ctx: Any) -> None:
        _run(self, action, ctx)


_NEEDED = ("_stages", "fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_n_microbatches",
           "_maybe_compute_loss", "_maybe_get_loss", "register_custom_function")


def overlap_f_b(schedule: Any, order: Sequence[str] | None = None) -> Overlap:
    """Register plait's `OVERLAP_F_B` with `schedule` (a `_PipelineScheduleRuntime`, such as
    `ScheduleDualPipeV`); returns the registered `Overlap`, whose `records` list each action."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    missing = [a for a in _NEEDED if not hasattr(schedule, a)]
    if missing:
        raise SpecError("schedule", f"{type(schedule).__name__} lacks {', '.join(missing)} "
                        "(not a PyTorch runtime schedule, or another PyTorch version)",
                        "pass a torch.distributed.pipelining schedule that emits OVERLAP_F_B, "
                        "e.g. ScheduleDualPipeV")
    if order is not None and any(x not in ("F", "B") for x in order):
        raise SpecError("order", "letters other than F and B", "give one 'F' or 'B' per call")
    unsafe: dict[int, str] = {}
    for stage in schedule._stages:
        if (why := outside_plait(stage.submod)) is not None:
            unsafe[stage.stage_index] = f"communicates outside plait ({why})"
        elif not plait_groups(stage.submod):
            unsafe[stage.stage_index] = "has no plait layer"
    overlap = Overlap(order, unsafe=unsafe)
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


def _run(overlap: Overlap, action: Any, ctx: Any) -> None:
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    sched = ctx.schedule_ref
    stages = {s.stage_index: s for s in sched._stages}
    fwd_a, bwd_a = action.sub_actions
    fs, fm = fwd_a.stage_index, fwd_a.microbatch_index
    bs, bm = bwd_a.stage_index, bwd_a.microbatch_index
    f_stage, b_stage = stages[fs], stages[bs]
    # inputs first, on this thread: what the runtime waits for before each half
    if not f_stage.is_first and fs - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fs, fm)))
    if not b_stage.is_last and bs + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bs, bm)))

    def forward() -> None:
        with record_function(f"plait:F{fs}.{fm}"):  # each strand's span in a trace
            out = f_stage.forward_one_chunk(fm, ctx.arg_mbs[fm], ctx.kwarg_mbs[fm])
            sched._maybe_compute_loss(f_stage, out, ctx.target_mbs, fm)
            if fs + 1 in stages:  # the rank's other stage takes it without a send
                stages[fs + 1].set_local_fwd_input(out, fm)

    def backward() -> None:
        with record_function(f"plait:B{bs}.{bm}"):
            loss = sched._maybe_get_loss(b_stage, bm)
            sched.backward_counter[bs] += 1
            last = sched.backward_counter[bs] == sched._n_microbatches
            b_stage.backward_one_chunk(bm, loss=loss, full_backward=True, last_backward=last)
            if bs - 1 in stages:
                stages[bs - 1].set_local_bwd_input(b_stage.get_local_bwd_output(bm), bm)

    which = [f"stage {s} {overlap.unsafe[s]}" for s in dict.fromkeys((fs, bs))
             if s in overlap.unsafe]
    if which:
        forward()
        backward()
        overlap.records.append(OverlapRecord((fs, fm), (bs, bm), False, (),
                                             f"{'; '.join(which)}: run forward then backward"))
        return
    failure: list[BaseException] = []
    threads = torch.get_num_threads()  # a new thread would start with the default (every core)

    def backward_strand() -> None:
        try:
            torch.set_num_threads(threads)
            with strands.strand("B"):
                backward()
        except BaseException as exc:  # re-raised on the calling thread
            failure.append(exc)

    with strands.turnstile(overlap.order, overlap.twins) as gate:
        worker = threading.Thread(target=backward_strand, name="plait-backward-strand")
        worker.start()
        try:
            with strands.strand("F"):
                forward()
        finally:
            worker.join()
    if failure:
        raise failure[0]
    overlap.records.append(OverlapRecord((fs, fm), (bs, bm), True,
                                         tuple(gate.ran + gate.own)))
