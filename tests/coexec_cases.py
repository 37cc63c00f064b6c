"""Rank bodies for the co-execution tests."""

from __future__ import annotations

import random

from plait.measure.coexec.small_model import build_sharded
from plait.measure.coexec.trainer import Trainer
from plait.planner.coexec.costs import CoexecCosts
from plait.runtime.context import close_all, runtime_of
from plait.schedule.coexec import (
    CoexecBlock,
    CoexecPlan,
    moved_later,
    plan_dp,
    validate,
)
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec, MoESpec
from plait.workload.transformer import build_layer

SPEC = ModelSpec(name="tiny", layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=50)
PAR = ParallelSpec(tp=2, seq_len=16, dtype="fp32")


def random_plan(fwd, bwd, collective, rng: random.Random) -> CoexecPlan:  # type: ignore[no-untyped-def]
    """A random legal plan: random segments, randomly paired."""
    from plait.schedule.coexec import segment_ends

    fe, be = segment_ends(fwd, collective), segment_ends(bwd, collective)
    i = j = 0
    blocks = []
    while i < len(fwd) or j < len(bwd):
        k = rng.choice(fe[i]) if i < len(fwd) else i
        m = rng.choice(be[j]) if j < len(bwd) else j
        f, b = tuple(fwd[i:k]), tuple(bwd[j:m])
        if f and b and (any(map(collective, f)) and any(map(collective, b))):
            b, m = (), j  # illegal together: run the forward segment alone
        elif f and b and rng.random() < 0.3:
            f, k = (), i  # sometimes a segment alone
        blocks.append(CoexecBlock(f, b))
        i, j = k, m
    return CoexecPlan(tuple(blocks), 0.0)


# A FiCCO schedule for every pair of the layer, all kinds among them: finer grain on the
# collective and the copy engines, shard-level P2P, sequential; rows and the tokens a weight
# gradient sums over (K).
FICCO = {"qkv": "fine/sm/c2/g1/M", "out_proj": "fine/sm/c2/g1/M", "fc1": "fine/dma/c2/g1/M",
         "fc2": "p2p/sm/M", "fc2_dgrad": "p2p/dma/M", "fc1_dgrad": "fine/dma/c2/g1/M",
         "fc1_wgrad": "fine/sm/c2/g1/K", "out_proj_dgrad": "fine/sm/c4/peer/M",
         "qkv_dgrad": "seq/dma", "qkv_wgrad": "fine/dma/c2/g1/K"}


def ficco_plans(seed: int, par: ParallelSpec = PAR) -> dict[str, CoexecPlan | None]:
    """Co-execution + FiCCO: the DP plan and a random legal plan over the fused units (each
    pair of `FICCO` the layer has one unit), and no plan (FiCCO alone)."""
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import simulate_pair

    layer, cluster = build_layer(SPEC, par), load_hardware("cpu")
    runs = {p.name: simulate_pair(p, Schedule.parse(FICCO[p.name]), cluster)
            for p in layer.pairs}
    costs = CoexecCosts(layer, cluster, runs)
    out: dict[str, CoexecPlan | None] = {
        "ficco": None,
        "ficco+dp": plan_dp(costs.fwd, costs.bwd, costs.collective, costs.solo, costs.pair),
        "ficco+random": random_plan(costs.fwd, costs.bwd, costs.collective,
                                    random.Random(seed))}
    for p in out.values():
        if p is not None:
            validate(p, costs.fwd, costs.bwd, costs.collective, costs.movable)
    return out


# An expert-parallel MoE layer on 2 ranks: TP 1, EP = DP = 2 (each rank its own data), 4
# experts top-2 at capacity factor 1, so the routing drops copies.
MOE_SPEC = ModelSpec(name="tiny-moe", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64,
                     vocab=50, moe=MoESpec(experts=4, top_k=2, expert_ffn=32))
MOE_PAR = ParallelSpec(tp=1, ep=2, dp=2, seq_len=16, dtype="fp32")


def plans(seed: int, spec: ModelSpec = SPEC, par: ParallelSpec = PAR
          ) -> dict[str, CoexecPlan | None]:
    costs = CoexecCosts(build_layer(spec, par), load_hardware("cpu"))
    out: dict[str, CoexecPlan | None] = {
        "plain": None,
        "dp": plan_dp(costs.fwd, costs.bwd, costs.collective, costs.solo, costs.pair),
        # weight gradients moved to the end of the backward (the executor follows the plan)
        "moved": plan_dp(costs.fwd, moved_later(costs.bwd, costs.movable), costs.collective,
                         costs.solo, costs.pair)}
    rng = random.Random(seed)
    for n in range(2):
        out[f"random{n}"] = random_plan(costs.fwd, costs.bwd, costs.collective, rng)
    for p in out.values():
        if p is not None:
            validate(p, costs.fwd, costs.bwd, costs.collective, costs.movable)
    return out


# FiCCO schedules for the MoE layer's four all-to-all pairs: finer grain on either engine,
# shard-level P2P on either.
MOE_FICCO = {"fc1": "fine/sm/c2/g1/M", "fc2": "fine/dma/c2/g1/M", "fc2_dgrad": "p2p/sm/M",
             "fc1_dgrad": "p2p/dma/M"}


def moe_train_step(rank: int, world: int, seed: int, micro_batches: int):  # type: ignore[no-untyped-def]
    from plait.schedule.schedule import Schedule
    from plait.sim.pair import simulate_pair

    rt = runtime_of(None)
    out = {}
    layer, cluster = build_layer(MOE_SPEC, MOE_PAR), load_hardware("cpu")
    ficco = {n: Schedule.parse(x) for n, x in MOE_FICCO.items()}
    costs = CoexecCosts(layer, cluster, {p.name: simulate_pair(p, ficco[p.name], cluster)
                                         for p in layer.pairs})
    fused_plan = plan_dp(costs.fwd, costs.bwd, costs.collective, costs.solo, costs.pair)
    runs = {**plans(seed, MOE_SPEC, MOE_PAR), "ficco": None, "ficco+dp": fused_plan}
    for name, plan in runs.items():
        model = build_sharded(MOE_SPEC, MOE_PAR, rank, seed=seed)
        fused = ficco if name.startswith("ficco") else None
        r = Trainer(model, rt.collective(), micro_batches, seed=seed, fused=fused,
                    rt=rt).step(plan)
        out[name] = (r.loss, r.peak_activation_bytes, r.grads, None if plan is None else
                     str(plan), r.filled)
    close_all()
    return out


# The layer as DTensor TP runs it: the backward keeps the forward's gathered inputs for the
# weight gradients instead of re-gathering them.
KEPT = PAR.model_copy(update={"regather": False})


def train_step(rank: int, world: int, seed: int, micro_batches: int,  # type: ignore[no-untyped-def]
               par: ParallelSpec = PAR):
    from plait.schedule.schedule import Schedule

    rt = runtime_of(None)
    comm = rt.collective()
    out = {}
    ficco = {n: Schedule.parse(s) for n, s in FICCO.items()}
    for name, plan in (plans(seed, SPEC, par) | ficco_plans(seed, par)).items():
        model = build_sharded(SPEC, par, rank, seed=seed)
        fused = ficco if name.startswith("ficco") else None
        r = Trainer(model, comm, micro_batches, seed=seed, fused=fused, rt=rt).step(plan)
        out[name] = (r.loss, r.peak_activation_bytes, r.grads, None if plan is None else
                     str(plan), r.filled)
    close_all()
    return out


def sequential_plan(fwd, bwd, solo):
    """No co-execution: the whole forward, then the whole backward (what a plan must beat)."""
    from plait.schedule.coexec import CoexecBlock, CoexecPlan

    return CoexecPlan((CoexecBlock(tuple(fwd), ()), CoexecBlock((), tuple(bwd))),
                solo("F", tuple(fwd)) + solo("B", tuple(bwd)))
