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
cores, they would only slow each other). With `order` (each call a strand letter "F" or "B")
they share the groups instead and take turns, one op at a time.

With `plan=True` the strands run a co-execution plan (`plait.schedule.coexec`, DHelix's
dynamic programming) instead of freely. The first `OVERLAP_F_B` of each pair of stages runs
forward then backward and times each strand's units: its plait calls (with the compute before each)
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

One module per concern: `overlap` (the registered function and its verbs), `measured` (the
trial of the two orders, the plan from timed units), `stages` (stages as PyTorch's pipelining
takes them).
"""

from plait.pipelining.measured import IN_ORDER, OVERLAPPED, StagePlan, Verdict
from plait.pipelining.overlap import Overlap, OverlapRecord, overlap_f_b
from plait.pipelining.stages import TensorParallelStage, stream_per_stage

__all__ = ["IN_ORDER", "OVERLAPPED", "Overlap", "OverlapRecord", "StagePlan",
           "TensorParallelStage", "Verdict", "overlap_f_b", "stream_per_stage"]
