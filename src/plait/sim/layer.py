"""Simulate one layer's forward and backward operator sequences under per-pair schedules.

Operators run one after another, as a framework issues them: a dependent pair under its
schedule (its own simulated timeline), every other operator alone. Unpaired collectives (the
all-reduce without SP, the context-parallel ring) are exposed. The result is one timeline per
phase, the source of the layer totals and of the layer trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from plait.schedule.schedule import Schedule
from plait.sim.engine import Span, Timeline
from plait.sim.optask import op_task
from plait.sim.pair import COMM_STREAM, COMPUTE_STREAM, PairRun, simulate_pair
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import Collective, Layer, Op, OverlapPair


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


def simulate_phase(name: str, ops: tuple[Op, ...], layer: Layer, cluster: ClusterSpec,
                   schedules: Mapping[str, Schedule],
                   runs: Mapping[tuple[str, str], PairRun] | None = None) -> PhaseTimeline:
    """`ops` back to back; pairs run under `schedules[pair.name]` (default sequential).

    `runs` may hold already simulated (pair name, schedule text) results to reuse."""
    spans: list[Span] = []
    streams: list[str] = [COMPUTE_STREAM, COMM_STREAM]
    now = 0.0
    seen: set[str] = set()
    for op in ops:
        pair = layer.pair_of(op.name)
        if pair is not None:
            if pair.name in seen:
                continue
            seen.add(pair.name)
            run = _pair_run(pair, schedules.get(pair.name, Schedule()), cluster, runs)
            segment = run.timeline.shifted(now, prefix=f"{pair.name}:")
            spans += segment.spans
            streams += [s for s in segment.streams if s not in streams]
            now += run.time_s
            continue
        stream = COMM_STREAM if isinstance(op, Collective) else COMPUTE_STREAM
        task = op_task(op, cluster, op.name, stream)
        spans.append(Span(task, now, now + task.duration))
        now += task.duration
    return PhaseTimeline(name, Timeline(tuple(spans), tuple(streams)))


def _pair_run(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
              runs: Mapping[tuple[str, str], PairRun] | None) -> PairRun:
    if runs is not None and (pair.name, str(s)) in runs:
        return runs[(pair.name, str(s))]
    return simulate_pair(pair, s, cluster)


def simulate_layer(layer: Layer, cluster: ClusterSpec, schedules: Mapping[str, Schedule],
                   runs: Mapping[tuple[str, str], PairRun] | None = None
                   ) -> tuple[PhaseTimeline, PhaseTimeline]:
    return (simulate_phase("forward", layer.forward, layer, cluster, schedules, runs),
            simulate_phase("backward", layer.backward, layer, cluster, schedules, runs))
