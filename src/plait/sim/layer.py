"""Simulate one layer's forward and backward operator sequences, as a framework issues them.

The sequence is cut into blocks run one after another: a dependent pair under its schedule (its
own simulated timeline), ring attention (below), a Megatron group (below), every other
operator alone. Three baselines share this:
- `sequential`: every pair on its plain schedule, every collective exposed (but ring attention,
  which overlaps by construction);
- `megatron`: what Megatron-LM with sequence parallelism runs without `--tp-comm-overlap`:
  `sequential`, except that in the backward of a column-parallel linear the re-gather of its
  input runs beside the data-gradient GEMM and the data gradient's reduce-scatter (all-reduce
  without SP) beside the weight-gradient GEMM (a collective's `beside`, set by the workload);
- plait: every pair on its chosen schedule; a Megatron group whose pairs all run plainly
  overlaps as in `megatron` (`plain_overlaps`: plait's runtime computes the weight gradient in
  the data gradient's reduce-scatter wait).

**Ring attention** (context parallelism), in every baseline: the key/value exchange that feeds
an attention op runs in CP ring steps, each passing one block to the next rank while attention
works on the block it holds (as Megatron-LM/TransformerEngine do), a step starting when the
previous one is done; each step's attention is a kernel of its own over that block's keys. A
ring that spans nodes steps at its NIC hop's speed (`cost.comm.ring_hop`). In backward the
key/value gradients travel with the keys and values and come home in the last step
(`RingAttention`).

**A Megatron group** is the smallest run of operators that holds every `beside` collective
with its producer, its consumer and the operator it runs beside. Inside it the collectives are
issued just before the operator they run beside and complete asynchronously: a GEMM waits only
for the collective it reads; the group ends when all of it is done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from plait.intervals import length
from plait.schedule.schedule import Schedule
from plait.sim.engine import Span, Task, Timeline, simulate
from plait.sim.optask import op_task, ring_step_task
from plait.sim.pair import COMM_STREAM, COMPUTE_STREAM, PairRun, simulate_pair
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Attention, Collective, Layer, Op, OverlapPair

Baseline = Literal["sequential", "megatron", "plait"]
COMM_CATEGORIES = ("sm_comm", "dma")


@dataclass(frozen=True, slots=True)
class PhaseTimeline:
    name: str  # "forward" or "backward"
    timeline: Timeline

    @property
    def time_s(self) -> float:
        return self.timeline.makespan

    @property
    def exposed_comm_s(self) -> float:
        return self.timeline.exposed()

    @property
    def compute_s(self) -> float:
        """Seconds in which some compute runs."""
        return length(self.timeline.busy(("compute",)))

    @property
    def comm_s(self) -> float:
        """Seconds in which some communication runs."""
        return length(self.timeline.busy(COMM_CATEGORIES))


def simulate_phase(name: str, ops: tuple[Op, ...], layer: Layer, cluster: ClusterSpec,
                   schedules: Mapping[str, Schedule],
                   runs: Mapping[tuple[str, str], PairRun] | None = None,
                   megatron: bool = False, plain_overlaps: bool = False) -> PhaseTimeline:
    """`ops` block after block; pairs run under `schedules[pair.name]` (default sequential);
    `megatron`: Megatron groups overlap as Megatron-LM runs them; `plain_overlaps`: only the
    groups whose pairs all run plainly (`seq/sm`) do, as plait's runtime runs them (its
    backward computes the weight gradient while the data gradient's reduce-scatter is in
    flight, `ops.dense._ag_backward`).

    `runs` may hold already simulated (pair name, schedule text) results to reuse."""
    spans: list[Span] = []
    streams: list[str] = [COMPUTE_STREAM, COMM_STREAM]
    now = 0.0
    seen: set[str] = set()

    def append(segment: Timeline, took: float) -> None:
        nonlocal now
        spans.extend(segment.shifted(now).spans)
        streams.extend(s for s in segment.streams if s not in streams)
        now += took

    groups = _megatron_groups(ops) if megatron or plain_overlaps else {}
    if plain_overlaps and not megatron:
        groups = {a: b for a, b in groups.items()
                  if all(schedules.get(p.name, Schedule()) == Schedule()
                         for op in ops[a:b] if (p := layer.pair_of(op.name)) is not None)}
    i = 0
    while i < len(ops):
        op = ops[i]
        group = groups.get(i)
        if group is not None:
            block = simulate(_group_tasks(ops[i:group], cluster))
            append(block, block.makespan)
            i = group
            continue
        ring = ring_attention(ops, i)
        if ring is not None:
            block = simulate(ring.tasks(cluster))
            append(block, block.makespan)
            i += 2
            continue
        i += 1
        pair = layer.pair_of(op.name)
        if pair is not None:
            if pair.name in seen:
                continue
            seen.add(pair.name)
            run = _pair_run(pair, schedules.get(pair.name, Schedule()), cluster, runs)
            append(run.timeline.shifted(0.0, prefix=f"{pair.name}:"), run.time_s)
            continue
        stream = COMM_STREAM if isinstance(op, Collective) else COMPUTE_STREAM
        task = op_task(op, cluster, op.name, stream)
        append(Timeline((Span(task, 0.0, task.duration),), (stream,)), task.duration)
    return PhaseTimeline(name, Timeline(tuple(spans), tuple(streams)))


def megatron_group_pairs(ops: Sequence[Op], layer: Layer
                         ) -> list[tuple[tuple[Op, ...], tuple[str, ...]]]:
    """Each Megatron group of `ops` (the backward of a column-parallel linear) as its
    operators and the pairs among them (its data gradient's and its re-gather's)."""
    return [(tuple(ops[a:b]), tuple(dict.fromkeys(
                p.name for op in ops[a:b] if (p := layer.pair_of(op.name)) is not None)))
            for a, b in _megatron_groups(ops).items()]


def _megatron_groups(ops: Sequence[Op]) -> dict[int, int]:
    """Start -> end (exclusive) of every Megatron group in `ops`: the runs that hold each
    `beside` collective with the operators it names (producer, consumer, the one it runs
    beside), overlapping runs merged."""
    where = {op.name: k for k, op in enumerate(ops)}
    runs = sorted(
        (min(k, *idx), max(k, *idx)) for k, op in enumerate(ops)
        if isinstance(op, Collective) and op.beside
        for idx in [[where[n] for n in (op.beside, op.feeds, op.fed_by) if n in where]])
    groups: dict[int, int] = {}
    lo, hi = -1, -2
    for a, b in runs:
        if a > hi:
            if hi >= lo >= 0:
                groups[lo] = hi + 1
            lo, hi = a, b
        else:
            hi = max(hi, b)
    if hi >= lo >= 0:
        groups[lo] = hi + 1
    return groups


def _group_tasks(ops: Sequence[Op], cluster: ClusterSpec) -> list[Task]:
    """A Megatron group as tasks: `beside` collectives issued just before the operator they
    run beside, on the communication stream; a consumer waits for what it reads."""
    order: list[Op] = [op for op in ops if not (isinstance(op, Collective) and op.beside)]
    for c in (op for op in ops if isinstance(op, Collective) and op.beside):
        order.insert(next(k for k, op in enumerate(order) if op.name == c.beside), c)
    tasks: list[Task] = []
    last: str | None = None  # the previous operator that is not an asynchronous collective
    pending: list[str] = []  # asynchronous collectives issued, not yet waited for
    for op in order:
        stream = COMM_STREAM if isinstance(op, Collective) else COMPUTE_STREAM
        deps = [last] if last else []
        if isinstance(op, Collective) and op.beside:
            deps += pending  # one communication stream: in issue order
            if op.fed_by:
                deps.append(op.fed_by)
            pending.append(op.name)
        else:
            deps += [c.name for c in ops if isinstance(c, Collective) and c.beside
                     and c.feeds == op.name]
            last = op.name
        tasks.append(replace(op_task(op, cluster, op.name, stream),
                             deps=tuple(dict.fromkeys(d for d in deps if d != op.name))))
    return tasks


@dataclass(frozen=True, slots=True)
class RingStep:
    """Step `index` of ring attention: the attention kernel on the block of keys this rank
    holds, over that block's keys, beside the transfer that passes `nbytes` to the next rank;
    the next step starts when both are done."""

    ring: Collective
    attn: Attention
    index: int
    nbytes: float  # what this step's transfer passes on (0: none)

    @property
    def name(self) -> str:
        return f"{self.ring.name}+{self.attn.name}.{self.index}"

    def tasks(self, cluster: ClusterSpec, prefix: str = "", compute: str = COMPUTE_STREAM,
              comm: str = COMM_STREAM, after: tuple[str, ...] = ()) -> list[Task]:
        """The attention block on `compute`, the transfer on `comm`; task names start with
        `prefix`, and both wait for `after`."""
        block = replace(self.attn, kv_tokens=self.attn.kv_tokens // self.ring.group)
        out = [replace(op_task(block, cluster, self.attn.name, compute),
                       name=f"{prefix}{self.attn.name}.{self.index}", deps=after)]
        if self.nbytes > 0:
            out.append(ring_step_task(self.ring, cluster, f"{prefix}{self.ring.name}.{self.index}",
                                      comm, after, self.nbytes))
        return out


@dataclass(frozen=True, slots=True)
class RingAttention:
    """Ring attention over `ring.group` CP ranks as TransformerEngine's loop (and DHeLlam's
    per-step blocks) run it: `ring.group` steps (`RingStep`), each an attention kernel on the
    block held beside the transfer of the block the next step reads.

    Forward: steps 0 .. CP - 2 each pass one block of keys and values; the last passes none.
    Backward: the key/value gradients summed so far travel with the keys and values, so step 0
    passes the keys and values only, the middle steps both, and the last step the gradients
    only, home to their owner (TransformerEngine `AttnFuncWithCPAndKVP2P.backward`; DHeLlam
    `fa_cp_block_bwd`). `ring.bytes` is the sum over the steps."""

    ring: Collective
    attn: Attention

    def steps(self) -> tuple[RingStep, ...]:
        g = self.ring.group
        if self.attn.backward:
            block = self.ring.bytes / (2 * (g - 1))
            sizes = [block if j in (0, g - 1) else 2 * block for j in range(g)]
        else:
            sizes = [self.ring.bytes / (g - 1)] * (g - 1) + [0.0]
        return tuple(RingStep(self.ring, self.attn, j, b) for j, b in enumerate(sizes))

    def tasks(self, cluster: ClusterSpec, prefix: str = "", compute: str = COMPUTE_STREAM,
              comm: str = COMM_STREAM, after: tuple[str, ...] = ()) -> list[Task]:
        """The steps one after another (`RingStep.tasks`); the first waits for `after`."""
        out: list[Task] = []
        for step in self.steps():
            tasks = step.tasks(cluster, prefix, compute, comm, after)
            out += tasks
            after = tuple(t.name for t in tasks)
        return out


def units(ops: Sequence[Op]) -> tuple[Op | RingStep, ...]:
    """`ops` with each ring attention (a CP ring exchange and the attention it feeds) as its
    steps, the units co-execution pairs with the other strand (DHeLlam runs each step as a
    block of its own)."""
    out: list[Op | RingStep] = []
    i = 0
    while i < len(ops):
        ring = ring_attention(ops, i)
        if ring is None:
            out.append(ops[i])
            i += 1
        else:
            out += ring.steps()
            i += 2
    return tuple(out)


def ring_attention(ops: Sequence[Op], i: int) -> RingAttention | None:
    """The ring attention that starts at `ops[i]`: a CP ring exchange directly followed by
    the attention it feeds; None where there is none."""
    op, attn = ops[i], ops[i + 1] if i + 1 < len(ops) else None
    if (isinstance(op, Collective) and isinstance(attn, Attention) and op.group > 1
            and op.feeds == attn.name):
        return RingAttention(op, attn)
    return None


def _pair_run(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
              runs: Mapping[tuple[str, str], PairRun] | None) -> PairRun:
    if runs is not None and (pair.name, str(s)) in runs:
        return runs[(pair.name, str(s))]
    return simulate_pair(pair, s, cluster)


def simulate_layer(layer: Layer, cluster: ClusterSpec, schedules: Mapping[str, Schedule],
                   runs: Mapping[tuple[str, str], PairRun] | None = None,
                   megatron: bool = False, plain_overlaps: bool = False
                   ) -> tuple[PhaseTimeline, PhaseTimeline]:
    fwd, bwd = (simulate_phase(name, ops, layer, cluster, schedules, runs, megatron,
                               plain_overlaps)
                for name, ops in (("forward", layer.forward), ("backward", layer.backward)))
    return fwd, bwd
