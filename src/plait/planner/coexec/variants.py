"""`plait coexec plan`: predicted step time of five ways to run a model's layers.

1. sequential: every operator after the previous one;
2. megatron: Megatron-LM's own backward overlaps (`sim.layer`), the baseline every speedup is
   against (`CoexecPrediction.baseline`: the explorer's; sequential for a layer that keeps its
   gathered inputs);
3. intra-batch overlap: each dependent pair under its best FiCCO schedule (`plait explore`);
4. co-execution: forward of micro-batch n beside backward of n-1, aligned by the DP plan;
5. co-execution whose strands also use FiCCO schedules (each pair a fused unit), or the plain
   co-execution plan where that is faster: never worse than 4.
A step of k micro-batches over L layers: k L (T_f + T_b) for 1-3; L T_f + (k-1) L T_plan +
L T_b for 4 and 5 (warm-up forward, steady co-executed layer pairs, drain backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from plait.planner.coexec.costs import CoexecCosts
from plait.planner.explore import Exploration, explore
from plait.schedule.coexec import CoexecPlan, plan_with_moves, validate
from plait.sim.engine import Span, Timeline
from plait.sim.pair import PairRun
from plait.sim.pipeline import stage_step_s
from plait.spec.hardware import ClusterSpec
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec
from plait.workload.operators import Attention, Gemm


@dataclass(frozen=True)
class Variant:
    name: str
    layer_fwd_s: float  # one layer's forward alone
    layer_bwd_s: float
    pair_s: float | None  # one co-executed layer pair (steady state), None: no co-execution
    exposed_fwd_s: float
    exposed_bwd_s: float
    exposed_pair_s: float | None

    def step_s(self, layers: int, k: int, bubble: float = 0.0) -> float:
        """k micro-batches over `layers` layers of a stage, plus `bubble` idle micro-batch slots
        of the pipeline, each as long as one plain forward and backward (every variant pays
        the same bubble count)."""
        return stage_step_s(self.layer_fwd_s, self.layer_bwd_s, layers, k, bubble, self.pair_s)

    def exposed_step_s(self, layers: int, k: int) -> float:
        if self.exposed_pair_s is None or k < 2:
            return k * layers * (self.exposed_fwd_s + self.exposed_bwd_s)
        return layers * (self.exposed_fwd_s + self.exposed_bwd_s + (k - 1) * self.exposed_pair_s)


@dataclass(frozen=True)
class CoexecPrediction:
    model: ModelSpec
    parallel: ParallelSpec
    cluster: ClusterSpec
    exploration: Exploration
    plan: CoexecPlan
    plan_fused: CoexecPlan
    variants: tuple[Variant, ...]
    comm_per_layer_s: float  # all collectives of one layer (fwd + bwd), alone
    flops_per_layer: float  # one layer fwd + bwd on one rank
    timelines: dict[str, Timeline]
    costs: CoexecCosts  # the plain strands' units and simulated block costs
    # whether co-execution + FiCCO's steady state runs the fused FiCCO units (else the plain
    # co-execution plan was faster, and it runs that)
    fused_steady: bool = True

    @property
    def layers(self) -> int:
        return self.model.layers // self.parallel.pp

    @property
    def k(self) -> int:
        return self.parallel.num_micro_batches

    @property
    def baseline(self) -> str:
        """The variant every speedup is against: the explorer's baseline (`megatron` for
        Megatron's layer, `sequential` for one that keeps its gathered inputs)."""
        return self.exploration.baseline

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def step(self, v: Variant) -> float:
        """Predicted step of variant `v`, the pipeline's bubble included."""
        return v.step_s(self.layers, self.k, self.parallel.bubble_slots)

    def speedup(self, v: Variant) -> float:
        """Step speedup of `v` over the baseline (`baseline`)."""
        return self.step(self.variant(self.baseline)) / self.step(v)

    def hidden(self, v: Variant) -> float:
        total = self.comm_per_layer_s * self.layers * self.k
        return 1 - v.exposed_step_s(self.layers, self.k) / total if total > 0 else 0.0

    def mfu(self, v: Variant) -> float:
        peak = self.cluster.gpu.flops(self.parallel.dtype)
        return self.flops_per_layer * self.layers * self.k / (self.step(v)
                                                              * peak)


def _concat(costs: CoexecCosts, plan: CoexecPlan) -> Timeline:
    spans: list[Span] = []
    streams, now = ("F.compute", "F.comm", "B.compute", "B.comm"), 0.0
    for n, blk in enumerate(plan.blocks):
        tl = costs.block_timeline(blk.fwd, blk.bwd, f"{n}:")
        spans += tl.shifted(now).spans
        now += tl.makespan
    return Timeline(tuple(spans), streams)


def _fused_inside(costs: CoexecCosts, tl: Timeline) -> Timeline:
    """For pictures and traces: each fused FiCCO unit's span replaced by its pair's own
    timeline (its GEMM pieces and transfers, on the strand's streams), stretched to the span,
    so the unit's communication shows."""
    spans: list[Span] = []
    streams = list(tl.streams)
    for sp in tl.spans:
        strand, _, name = sp.task.name.partition(".")
        run = costs.ops.get(name)
        if not isinstance(run, PairRun) or run.time_s <= 0:
            spans.append(sp)
            continue
        scale = sp.duration / run.time_s
        for inner in run.timeline.spans:
            stream = f"{strand.split(':')[-1]}.{inner.task.stream}"
            if stream not in streams:
                streams.append(stream)
            task = replace(inner.task, name=f"{sp.task.name}:{inner.task.name}", stream=stream,
                           deps=(), label=f"{run.pair.name}:{inner.task.label or inner.task.name}")
            spans.append(Span(task, sp.start + inner.start * scale, sp.start + inner.end * scale))
    return Timeline(tuple(spans), tuple(streams))


def predict_coexec(model: ModelSpec, par: ParallelSpec, cluster: ClusterSpec,
                   progress: Callable[[str], None] | None = None,
                   fast: bool = False) -> CoexecPrediction:
    """The five variants of a step, the plans of co-execution with and without FiCCO units;
    `progress`: called with each pair's name once the explorer is done with it; `fast`: each
    pair's schedules by the explorer's heuristics alone (`plait plan`'s search, which has
    explored the layer that way)."""
    e = explore(model, par, cluster, progress=progress, fast=fast)
    layer = e.layer
    plain = CoexecCosts(layer, cluster)
    plan = plan_with_moves(plain.fwd, plain.bwd, plain.collective, plain.solo, plain.pair,
                           plain.movable)
    validate(plan, plain.fwd, plain.bwd, plain.collective, plain.movable)
    # each pair's fastest schedule alone (beside the other strand, the layer's own backward
    # overlaps that may keep a pair plain in the layer do not run)
    fused_runs = {r.pair.name: r.runs[0] for r in e.pairs}
    fused = CoexecCosts(layer, cluster, fused_runs)
    plan_f = plan_with_moves(fused.fwd, fused.bwd, fused.collective, fused.solo, fused.pair,
                             fused.movable)
    validate(plan_f, fused.fwd, fused.bwd, fused.collective, fused.movable)
    seq_f, seq_b = e.sequential
    meg_f, meg_b = e.phases("megatron")
    ch_f, ch_b = e.chosen
    tl_plan, tl_fused = _concat(plain, plan), _concat(fused, plan_f)
    # Exposure inside fused units is invisible to the block timeline: add each fused unit's own
    # exposed communication when no other strand ran beside it.
    fused_alone = sum(fused_runs[n.rstrip("*")].exposed_comm_s for b in plan_f.blocks
                      for side, other in ((b.fwd, b.bwd), (b.bwd, b.fwd)) if not other
                      for n in side if n.endswith("*"))
    # Co-execution + FiCCO is never worse than co-execution: each part of its step is the
    # better of the fused and the plain way (both can run), and the report says which it is.
    fused_steady = plan_f.predicted_s <= plan.predicted_s
    steady, steady_tl = (plan_f, tl_fused) if fused_steady else (plan, tl_plan)
    steady_exposed = tl_fused.exposed() + fused_alone if fused_steady else tl_plan.exposed()
    warm_f = ch_f if ch_f.time_s <= seq_f.time_s else seq_f
    warm_b = ch_b if ch_b.time_s <= seq_b.time_s else seq_b
    variants = (
        Variant("sequential", seq_f.time_s, seq_b.time_s, None, seq_f.exposed_comm_s,
                seq_b.exposed_comm_s, None),
        Variant("megatron", meg_f.time_s, meg_b.time_s, None, meg_f.exposed_comm_s,
                meg_b.exposed_comm_s, None),
        Variant("intra-batch overlap (FiCCO)", ch_f.time_s, ch_b.time_s, None,
                ch_f.exposed_comm_s, ch_b.exposed_comm_s, None),
        Variant("co-execution", seq_f.time_s, seq_b.time_s, plan.predicted_s,
                seq_f.exposed_comm_s, seq_b.exposed_comm_s, tl_plan.exposed()),
        Variant("co-execution + FiCCO", warm_f.time_s, warm_b.time_s, steady.predicted_s,
                warm_f.exposed_comm_s, warm_b.exposed_comm_s, steady_exposed),
    )
    comm = sum(sp.duration for ph in e.sequential for sp in ph.timeline.spans
               if sp.task.category != "compute")
    flops = sum(op.flops for op in layer.forward + layer.backward
                if isinstance(op, Gemm | Attention))
    timelines = {"sequential forward+backward": _concat_phases(seq_f.timeline, seq_b.timeline),
                 "co-execution (layer pair)": tl_plan,
                 "co-execution + FiCCO (layer pair)": _fused_inside(fused, steady_tl)
                 if fused_steady else steady_tl}
    return CoexecPrediction(model, par, cluster, e, plan, steady, variants, comm, flops, timelines,
                        plain, fused_steady)


def _concat_phases(a: Timeline, b: Timeline) -> Timeline:
    shifted = b.shifted(a.makespan, prefix="bwd:")
    streams = tuple(dict.fromkeys(a.streams + b.streams))
    return Timeline(a.spans + shifted.spans, streams)
