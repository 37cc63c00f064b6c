"""Host issue: the CPU thread that issues a decomposed schedule's ops, one eager call at a time.

An executor written in Python (plait's runtime, PyTorch's async TP) issues every step of a
decomposed schedule itself: it looks up a peer's buffer, switches streams, calls the GEMM, the
copy or the collective, signals or waits. Each of these calls costs the host
`params.host_call_s` (the dispatcher and a launch; `plait.spec.sources`). A device task cannot
run before it is issued, so when a schedule's pieces are small the host, not the GPU, sets the
pace: PyTorch's decomposed reduce-scatter takes about the same time at every M below a few
hundred rows (pytorch/pytorch#179770), and its heuristics switch paths by M for that reason.

The model: the host is one more resource that every op of a schedule holds while it runs, for
the host seconds of its calls (`host_use`). An op whose device work is shorter than its issue
takes its issue time; ops that run together share the host, so a pipeline of small steps goes
at the host's pace however many streams it spreads over. The host issues ahead when the device
is busy (asynchronous launches); the model does not bank that lead, which only matters where
host and device times are close. The calls before the first op (workspace look-ups, the
opening barriers) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from plait.cost.resources import Cost

HOST = "host"  # the resource name


@dataclass(frozen=True, slots=True)
class Executor:
    """The host calls one executor makes per op of a lowered schedule (`plait.schedule.lower`),
    counted in its source."""

    name: str
    compute: int  # per GEMM piece (views of its blocks, the GEMM)
    collective: int  # per collective-kernel transfer (the call, its wait)
    copy_in: int  # per copy-engine transfer, all-gather side (a pull)
    copy_out: int  # per copy-engine transfer, reduce-scatter side (publish, pull)
    reduce: int  # per reduction of received partials
    source: str


PLAIT = Executor(
    "plait", compute=2, collective=3, copy_in=6, copy_out=9, reduce=2,
    source="counted in plait.runtime.execute and plait.runtime.cuda_peer: a piece = a view of "
    "its blocks and the GEMM; a collective step = the call, a contiguous input and the wait; "
    "a pull = entering and leaving the copy stream, the wait for the owner's signal, the view "
    "of its buffer, the copy and an event; a reduce-scatter copy also publishes (the view, "
    "the copy into the buffer, a signal)")

PYTORCH_ASYNC_TP = Executor(
    "pytorch async TP", compute=1, collective=1, copy_in=4, copy_out=6, reduce=1,
    source="counted in torch/distributed/_symmetric_memory/__init__.py "
    "(_pipelined_multi_all_gather_and_consume, _pipelined_produce_and_all2all): an all-gather "
    "step = get_buffer, entering and leaving the step's stream, copy_, then the consumer's "
    "GEMM; a reduce-scatter step = the producer's GEMM, then get_buffer, entering and leaving "
    "the stream, a barrier, copy_ and a barrier")


EXECUTORS = {"plait": PLAIT, "pytorch": PYTORCH_ASYNC_TP}  # by the name a tool has in NAMED
CALLS = tuple(f.name for f in fields(Executor) if f.name not in ("name", "source"))  # counts


def host_use(cost: Cost, host_s: float, extra_s: float = 0.0) -> Cost:
    """`cost` (a task's kernel; the task also spends `extra_s` seconds on copies around it)
    issued by `host_s` seconds of host calls: the task takes at least its issue time, and holds
    the host for that share of its duration (its other claims thinned as it stretches). The
    kernel's part of the task is returned; the copies keep their `extra_s`."""
    if host_s <= 0.0:
        return cost
    total = cost.duration + extra_s
    if host_s <= total:
        return Cost(cost.duration, {**cost.uses, HOST: host_s / total}, cost.reserves)
    scale = total / host_s
    uses = {r: v * scale for r, v in cost.uses.items()}
    return Cost(host_s - extra_s, {**uses, HOST: 1.0}, cost.reserves)
