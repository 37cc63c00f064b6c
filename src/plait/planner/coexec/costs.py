"""Block costs for the co-execution planner, from the simulator.

A segment's operators run one after another on their strand's streams (`F.compute`, `F.comm`,
`B.compute`, `B.comm`); two segments of a block run at the same time and share the GPU's
resources as the simulator shares them (two compute kernels gain almost nothing together; a
collective under the other strand's compute is mostly hidden, minus contention).

With `fused` (pair name -> its FiCCO run), each dependent (collective, GEMM) pair of a strand
becomes one unit that takes the pair's overlapped time and holds the group: co-execution whose
strands also use FiCCO schedules.

Ring attention (context parallelism) is a unit per ring step, `cp_kv_ring+attn.<j>`, as DHeLlam
runs it: each step's transfer runs beside its own attention block (`sim.layer.RingStep`), on the
CP group, and the other strand shares the GPU with both; so the plan can put a different part of
the other strand beside each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from plait.cost import contention
from plait.sim.engine import Task, Timeline, simulate
from plait.sim.layer import RingStep, units
from plait.sim.optask import op_task
from plait.sim.pair import PairRun
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Collective, Layer, Op


class CoexecCosts:
    def __init__(self, layer: Layer, cluster: ClusterSpec,
                 fused: Mapping[str, PairRun] | None = None) -> None:
        self.cluster, self.fused = cluster, dict(fused or {})
        self.movable = layer.weight_gradients  # what a plan may move later
        self.fwd, self.bwd = self._strand(layer.forward, layer), self._strand(layer.backward, layer)
        self.ops: dict[str, Op | PairRun | RingStep] = {}
        for strand in (layer.forward, layer.backward):
            for unit in units(strand):
                self.ops[unit.name] = unit
                if isinstance(unit, RingStep):  # its parts keep their names too
                    self.ops |= {unit.ring.name: unit.ring, unit.attn.name: unit.attn}
        for name, run in self.fused.items():
            self.ops[f"{name}*"] = run
        self.solo = lru_cache(maxsize=None)(self._solo)
        self.pair = lru_cache(maxsize=None)(self._pair)

    def _strand(self, ops: tuple[Op, ...], layer: Layer) -> tuple[str, ...]:
        names: list[str] = []
        for op in units(ops):
            pair = None if isinstance(op, RingStep) else layer.pair_of(op.name)
            if pair is not None and pair.name in self.fused:
                if f"{pair.name}*" not in names:
                    names.append(f"{pair.name}*")
                continue
            names.append(op.name)
        return tuple(names)

    def collective(self, name: str) -> str | None:
        """The process group the unit communicates on, None for compute: its size and stride
        (the TP group, the CP ring and the EP group differ); a fused pair holds its
        collective's group."""
        unit = self.ops[name]
        coll = (unit.pair.collective if isinstance(unit, PairRun) else
                unit.ring if isinstance(unit, RingStep) and unit.nbytes > 0 else unit)
        if not isinstance(coll, Collective):
            return None
        return f"{coll.group} ranks, stride {coll.stride}"

    def tasks(self, strand: str, names: tuple[str, ...], prefix: str = "") -> list[Task]:
        """The units `names` one after another on the strand's streams."""
        out: list[Task] = []
        deps: tuple[str, ...] = ()  # what the next unit waits for: all of the previous one
        for name in names:
            unit = self.ops[name]
            tname = f"{prefix}{strand}.{name}"
            if isinstance(unit, RingStep):
                tasks = unit.tasks(self.cluster, f"{tname}:", f"{strand}.compute",
                                   f"{strand}.comm", deps)
            elif isinstance(unit, PairRun):
                gemm_share = min(1.0, unit.gemm_whole_s / unit.time_s)
                tasks = [Task(tname, f"{strand}.compute", unit.time_s, contention.COMPUTE,
                              deps, {"compute": gemm_share},
                              slowdowns=contention.slowdowns(self.cluster)[contention.COMPUTE],
                              label=f"{name} {unit.schedule}")]
            else:
                stream = f"{strand}.comm" if isinstance(unit, Collective) else f"{strand}.compute"
                tasks = [op_task(unit, self.cluster, tname, stream, deps)]
            out += tasks
            deps = tuple(t.name for t in tasks)
        return out

    def _solo(self, strand: str, names: tuple[str, ...]) -> float:
        tasks = self.tasks(strand, names)
        if any(isinstance(self.ops[n], RingStep) for n in names):
            return simulate(tasks).makespan  # a ring step's transfer beside its attention
        return sum(t.duration for t in tasks)

    def _pair(self, fwd: tuple[str, ...], bwd: tuple[str, ...]) -> float:
        return simulate(self.tasks("F", fwd) + self.tasks("B", bwd)).makespan

    def block_timeline(self, fwd: tuple[str, ...], bwd: tuple[str, ...], prefix: str
                       ) -> Timeline:
        return simulate(self.tasks("F", fwd, prefix) + self.tasks("B", bwd, prefix))
