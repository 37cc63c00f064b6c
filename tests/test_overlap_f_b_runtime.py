"""plait's OVERLAP_F_B inside PyTorch's DualPipeV (plait.pipelining), on 4 gloo ranks:
PP=2 x TP=2 (dense blocks, or MoE blocks with EP=2) and PP=4 x TP=1; the same losses and
gradients as PyTorch's default (forward then backward) and as the unsharded model in one
process."""

import pytest
import torch
import torch.nn.functional as F

from plait.runtime.launch import run_ranks
from tests.helpers import gloo_pipelining_skip, on_every_rank, step_and_stage_grads

pytestmark = pytest.mark.slow

H, FFN, T, MB = 8, 16, 8, 8  # hidden, FFN, tokens a micro-batch, micro-batches

_GLOO_PIPELINING = gloo_pipelining_skip()


def _weights(kind, stages, ranks):  # "plain" blocks are "dense" ones in torch.nn.Linear
    """Per stage the whole layer: dense (W1 (FFN, H), W2 (H, FFN)); MoE, one expert per rank
    of the group: (E, 2 FFN, H) gate|up and (E, H, FFN)."""
    g = torch.Generator().manual_seed(7)
    if kind in ("dense", "plain", "pytorch"):
        return [(torch.randn(FFN, H, generator=g) / H**0.5,
                 torch.randn(H, FFN, generator=g) / FFN**0.5) for _ in range(stages)]
    return [(torch.randn(ranks, 2 * FFN, H, generator=g) / H**0.5,
             torch.randn(ranks, H, FFN, generator=g) / FFN**0.5) for _ in range(stages)]


def _inputs():
    g = torch.Generator().manual_seed(8)
    return torch.randn(MB, T, H, generator=g), torch.randn(MB, T, H, generator=g)


def _block(kind, x, w1, w2, ranks):
    """One unsharded block on a micro-batch's whole sequence. MoE: rank r holds rows r*T/P..
    and sends their chunk q to expert q (rank q's), which sends the result back."""
    if kind in ("dense", "plain", "pytorch"):
        return x + F.gelu(x @ w1.T) @ w2.T
    out = []
    for rows in x.chunk(ranks):  # each rank's tokens
        for q, part in enumerate(rows.chunk(ranks)):  # ... chunk q to expert q
            gate, up = (part @ w1[q].T).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ w2[q].T)
    return x + torch.cat(out)


def _reference(kind, stages, ranks):
    """Every micro-batch through the unsharded blocks; the loss is the mean squared error over
    the whole micro-batch (the schedule divides each one's gradient by MB)."""
    ws = [(a.clone().requires_grad_(), b.clone().requires_grad_())
          for a, b in _weights(kind, stages, ranks)]
    xs, ys = _inputs()
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h = x
        for w1, w2 in ws:
            h = _block(kind, h, w1, w2, ranks)
        loss = (h - y).square().sum() / (T * H)
        (loss / MB).backward()
        losses.append(loss.detach())
    return torch.stack(losses), [(a.grad, b.grad) for a, b in ws]


def _pipelined(rank, world, kind, pp, overlap, order, measure=0, steps=1, slow_overlap=0.0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from plait.nn import ColumnParallelLinear, ExpertParallelMLP, RowParallelLinear
    from plait.pipelining import overlap_f_b

    tp = world // pp
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    p, r = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    group = mesh["tp"].get_group()  # TP, or EP for the MoE blocks
    stages = 2 * pp
    full = _weights(kind, stages, tp)

    class Dense(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, group, schedule="fine/sm/c2/g1/M")
            self.fc2 = RowParallelLinear(FFN, H, group, schedule="fine/dma/c2/g1/M")
            w1, w2 = full[index]
            with torch.no_grad():
                self.fc1.weight.copy_(w1.chunk(tp, 0)[r])
                self.fc2.weight.copy_(w2.chunk(tp, 1)[r])

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

        def grads(self):
            return self.fc1.weight.grad.clone(), self.fc2.weight.grad.clone()

    class Moe(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.moe = ExpertParallelMLP(H, FFN, group, schedule="fine/sm/c2/g1/M")
            w1, w2 = full[index]
            with torch.no_grad():
                self.moe.fc1.copy_(w1[r])
                self.moe.fc2.copy_(w2[r])

        def forward(self, x):
            return x + self.moe(x)

        def grads(self):
            return self.moe.fc1.grad.clone(), self.moe.fc2.grad.clone()

    class Plain(torch.nn.Module):  # no plait layer: plait's OVERLAP_F_B must not overlap it
        def __init__(self, index):
            super().__init__()
            self.fc1 = torch.nn.Linear(H, FFN, bias=False)
            self.fc2 = torch.nn.Linear(FFN, H, bias=False)
            w1, w2 = full[index]
            with torch.no_grad():
                self.fc1.weight.copy_(w1)
                self.fc2.weight.copy_(w2)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

        def grads(self):
            return self.fc1.weight.grad.clone(), self.fc2.weight.grad.clone()

    block = {"dense": Dense, "moe": Moe, "plain": Plain, "pytorch": Plain}[kind]
    mine = (p, stages - 1 - p)  # DualPipeV: stage p and its mirror
    blocks = [block(s) for s in mine]
    if kind == "pytorch":  # PyTorch's own TP styles: DTensor collectives outside plait
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for b in blocks:
            parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})

        def grads(b):
            return tuple(w.grad.full_tensor().clone() for w in (b.fc1.weight, b.fc2.weight))
    else:
        def grads(b):
            return b.grads()
    pipe = [PipelineStage(b, s, stages, torch.device("cpu"), group=mesh["pp"].get_group())
            for b, s in zip(blocks, mine, strict=True)]

    def loss_fn(out, target):  # this rank's tokens' share of the micro-batch's mean
        return (out - target).square().sum() / (T * H)

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn)
    if order == "plan, every weight gradient moved":
        _move_every_weight_gradient()
    planned = isinstance(order, str) and order.startswith("plan")
    ran = None if not overlap else overlap_f_b(schedule, plan=True, measure=measure) \
        if planned else overlap_f_b(schedule, order, measure=measure)
    if slow_overlap:  # every overlapped action held back
        from plait.pipelining import OVERLAPPED

        ran.penalty = lambda candidate: slow_overlap * (candidate == OVERLAPPED)
    xs, ys = _inputs()
    shard = slice(r * T // tp, (r + 1) * T // tp)  # this rank's tokens of each micro-batch
    losses = []
    for _ in range(steps):
        if p == 0:  # holds the first and the last stage
            schedule.step(xs[:, shard].reshape(-1, H), target=ys[:, shard].reshape(-1, H),
                          losses=losses)
        else:
            schedule.step()
    grads = {s: grads(b) for s, b in zip(mine, blocks, strict=True)}
    local = torch.stack([x.detach() for x in losses]) if losses else None
    records = None if ran is None else [(rec.overlapped, len(rec.calls), rec.reason)
                                        for rec in ran.records]
    plans = None if ran is None or not ran.plan else {
        "planned": sum(rec.planned for rec in ran.records), "plans": len(ran.plans),
        "deferred": sum(rec.deferred for rec in ran.records),
        "stray": [rec.stray for rec in ran.records if rec.stray]}
    verdicts = None if ran is None else {k: (v.overlap, v.reason) for k, v in
                                         ran.verdicts.items()}
    return r, local, grads, records, plans, verdicts


def _move_every_weight_gradient():
    """Make `plait.pipelining`'s plans defer every weight gradient they can to the end of the
    backward strand (a plan the timings would seldom choose on these tiny blocks)."""
    from plait.pipelining import StagePlan, overlap
    from plait.schedule.coexec import moved_later, plan_dp

    made = overlap._plan  # where the overlap's verbs look it up

    def moving(fwd, bwd, stages):
        sp = made(fwd, bwd, stages)
        movable = [u.name for u in sp.bwd if u.group is None and u.deferrable]
        units = {("F", u.name): u for u in sp.fwd} | {("B", u.name): u for u in sp.bwd}

        def total(strand, names):
            return sum(units[strand, n].compute_s + units[strand, n].wait_s for n in names)

        plan = plan_dp([u.name for u in sp.fwd], moved_later([u.name for u in sp.bwd], movable),
                       {u.name: u.group for u in (*sp.fwd, *sp.bwd)}.get, total,
                       lambda f, b: max(total("F", f), total("B", b)))
        return StagePlan(plan, sp.fwd, sp.bwd, frozenset(movable))

    overlap._plan = moving


def _shard(kind, w, r, tp, which):
    if kind == "moe":
        return w[r]
    if kind in ("plain", "pytorch"):
        return w
    return w.chunk(tp, 0 if which == 0 else 1)[r]


@pytest.mark.parametrize(("kind", "pp", "order"), [
    ("dense", 2, None), ("dense", 2, "FFBB"), ("dense", 2, "random"), ("moe", 2, None),
    ("dense", 4, None), ("plain", 4, None), ("pytorch", 4, None), ("dense", 2, "plan"),
    ("moe", 2, "plan, every weight gradient moved"),
    ("dense", 2, "plan, every weight gradient moved")])
@_GLOO_PIPELINING
def test_overlap_f_b_equals_pytorchs_default_and_the_unsharded_model(kind, pp, order):
    """Each strand on its own communicators (no order), or sharing them in a given order of
    calls: a fixed one, or any random order (every order is legal: a strand whose turn comes
    after the other finished runs freely); or the blocks of a plan made from the timed units,
    its weight gradients where the timings put them, or all of them deferred."""
    import random

    tp = 4 // pp
    want_loss, want = _reference(kind, 2 * pp, tp)
    default = run_ranks(4, _pipelined, kind, pp, False, None, timeout_s=240)
    calls = order if order is None or order.startswith("plan") else list(
        "".join(random.Random(3).choice("FB") for _ in range(160)) if order == "random"
        else order * 40)
    plait = run_ranks(4, _pipelined, kind, pp, True, calls, timeout_s=240)
    loss_sum = torch.zeros(MB)
    for (r, loss, grads, records, plans, _), (_, loss0, grads0, *_) in zip(plait, default,
                                                                          strict=True):
        for s, got in grads.items():
            for which in (0, 1):
                # exactly PyTorch's default: the same ops, only interleaved
                assert torch.equal(got[which], grads0[s][which])
                assert torch.allclose(got[which], _shard(kind, want[s][which], r, tp, which),
                                      atol=1e-5)
        if loss is not None:
            assert torch.equal(loss, loss0)
            loss_sum += loss
        if kind == "plain":  # no plait layer: PyTorch's order, and the record says why
            assert records and all(not ok and "no plait layer" in why
                                   for ok, _, why in records), records
        elif kind == "pytorch":  # DTensor TP outside plait: not overlapped, and why
            assert records and all(not ok and "communicates outside plait" in why
                                   and "fc1.weight" in why for ok, _, why in records), records
        elif plans is not None:  # each pair of stages timed once, then run as planned
            timed = [why for ok, _, why in records if not ok]
            assert timed and all("timed its units" in why for why in timed), records
            assert plans["plans"] == len(timed) and plans["planned"] == len(records) - len(timed)
            assert plans["planned"] > 0 and not plans["stray"], plans
            if "moved" in order:  # deferred, and still exactly PyTorch's gradients
                assert plans["deferred"] >= 2 * plans["planned"], plans
        else:  # every OVERLAP_F_B of DualPipeV ran overlapped, through plait's ops
            assert records and all(ok and calls > 0 for ok, calls, _ in records), records
    assert torch.allclose(loss_sum, want_loss, atol=1e-5)  # the ranks' shares add up


@pytest.mark.parametrize("order", [None, "plan"])
@pytest.mark.parametrize("slow", [0.0, 0.05])
@_GLOO_PIPELINING
def test_overlap_f_b_measures_both_orders_and_keeps_the_faster_alike_on_every_rank(order,
                                                                                    slow):
    """With `measure`, each pair of stages' first actions run in PyTorch's order and
    overlapped alternately; the faster is kept on every rank of the stages' groups. With
    every overlapped call held back on purpose, PyTorch's order wins and the records say
    why; the gradients are PyTorch's default's either way."""
    steps = 3  # DualPipeV's OVERLAP_F_Bs of a pair of stages, over steps: enough to decide
    default = run_ranks(4, _pipelined, "dense", 2, False, None, 0, steps, timeout_s=240)
    plait = run_ranks(4, _pipelined, "dense", 2, True, order, 1, steps, slow, timeout_s=240)
    verdicts = [v for *_, v in plait]
    assert verdicts[0] and all(v == verdicts[0] for v in verdicts[1:2])  # a TP group alike
    assert all(v == verdicts[2] for v in verdicts[3:])
    for (_, loss, grads, records, _, v), (_, loss0, grads0, *_) in zip(plait, default,
                                                                       strict=True):
        for s, got in grads.items():
            for which in (0, 1):
                assert torch.equal(got[which], grads0[s][which])
        if loss is not None:
            assert torch.equal(loss, loss0)
        assert any("measuring stages" in why for *_, why in records), records
        if slow:  # the overlap held back: PyTorch's order kept, and said so
            assert all(not won and "overlap does not pay here" in why
                       for won, why in v.values()), v
            after = [r for r in records if "does not pay" in r[2]]
            assert after and all(not ok for ok, *_ in after), records


@_GLOO_PIPELINING
def test_coexec_run_pp_measures_four_runs_beside_their_prediction(tmp_path):
    import json

    from typer.testing import CliRunner

    from plait.cli.main import app

    out = tmp_path / "run.json"
    res = CliRunner().invoke(app, ["coexec", "run", "--pp", "2", "--ranks", "4", "--layers",
                                   "4", "--hidden", "32", "--ffn", "64", "--seq-len", "32",
                                   "--micro-batches", "4", "--repeats", "1", "--json",
                                   str(out), "--trace", str(tmp_path / "trace")])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    # one trace of every rank per schedule (a process per rank); the PNG of the V schedules,
    # whose plait run shows its backward strand on a track of its own
    merged = json.loads((tmp_path / "trace" / "dualpipev-plait.json").read_text())["traceEvents"]
    procs = {e["pid"] for e in merged if e.get("name") == "process_name"}
    assert procs == {0, 1, 2, 3}
    assert any(str(e.get("name", "")).startswith("plait:B") for e in merged)
    # 1F1B's actions are recorded too (PyTorch's Schedule1F1B records none of its own): every
    # micro-batch's forward and backward on every rank
    one = json.loads((tmp_path / "trace" / "1f1b.json").read_text())["traceEvents"]
    actions = {(e["pid"], e["name"]) for e in one if e.get("ph") == "X"
               and str(e.get("name", "")).startswith("PP:")}
    assert {(r, f"PP:{r // 2}{fb}{m}") for r in range(4) for fb in "FB" for m in range(4)
            } <= actions, sorted(actions)
    assert (tmp_path / "trace" / "pipeline-step.png").stat().st_size > 10_000
    for kind in ("1F1B", "DualPipeV", "DualPipeV + plait", "DualPipeV + plait plan"):
        got, want = data["measured"][kind], data["predicted"][kind]
        assert got["step_s"] > 0 and want["step_s"] > 0
        # activations: the simulation's chunks held x one chunk's saved bytes
        assert 0.7 < got["peak_saved_bytes"] / want["peak_saved_bytes"] < 1.3, (kind, got, want)
    # what plait's OVERLAP_F_B ran is reported: every action overlapped, none fell back
    ran = data["measured"]["DualPipeV + plait"]["overlap_f_b"]
    assert ran["actions"] > 0 and ran["overlapped"] == ran["actions"] and not ran["fell_back"]
    # ... and from a plan: each pair of stages timed once, every later action planned; the
    # plans of every rank are reported, each no slower than its timed forward then backward
    ran = data["measured"]["DualPipeV + plait plan"]["overlap_f_b"]
    assert ran["planned"] == ran["overlapped"] > 0 and not ran["fell_back"], ran
    plans = data["measured"]["DualPipeV + plait plan"]["plans"]
    pairs = [tuple(map(int, k.split(","))) for k in plans]
    assert all(f != b and 0 <= f < 4 and 0 <= b < 4 for f, b in pairs), pairs
    assert plans and all(0 < v["predicted_s"] <= v["sequential_s"] * (1 + 1e-9)
                         for v in plans.values()), plans
    # the folded V holds more micro-batches' activations than 1F1B, as predicted
    assert (data["measured"]["DualPipeV"]["peak_saved_bytes"]
            > data["measured"]["1F1B"]["peak_saved_bytes"])
    bad = CliRunner().invoke(app, ["coexec", "run", "--pp", "2", "--ranks", "3"])
    assert bad.exit_code == 2 and "ranks" in bad.output


def _norm_backward(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    norm = parallelize_module(torch.nn.RMSNorm(H), mesh, SequenceParallel())
    x = DTensor.from_local(torch.randn(1, T // world, H), mesh, [Shard(1)])

    def collectives(fn):  # the collectives `fn` issues, as the profiler names them
        with torch.profiler.profile() as prof:
            fn()
        return sorted({e.name for e in prof.events() if "c10d" in e.name})

    backward = collectives(lambda: norm(x).to_local().sum().backward())
    gather = collectives(x.full_tensor)  # the check sees a collective where there is one
    return backward, gather, [p.is_partial() for p in norm.weight.grad.placements]


def test_sequence_parallel_norms_communicate_nothing_in_backward():
    """What lets a stage of plait-parallelized blocks use PyTorch's SequenceParallel norms
    under OVERLAP_F_B (stages must communicate only through plait): the norm weights'
    gradients stay Partial through the backward, reduced later by whoever reads them."""
    for backward, gather, partial in run_ranks(2, _norm_backward, timeout_s=120):
        assert backward == [] and gather and partial == [True], (backward, gather, partial)


LLAMA_STAGES = 4  # DualPipeV on PP=2: two stages a rank, one Llama block each


def _llama_blocks():
    """Hugging Face Llama blocks, the same weights on every rank (one seed), and the rotary
    embedding; causal attention through PyTorch's SDPA."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=LLAMA_STAGES, vocab_size=32,
                      max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(11)
    blocks = [LlamaDecoderLayer(cfg, i) for i in range(LLAMA_STAGES)]
    for b in blocks:  # non-trivial norm weights, so their gradients are checked too
        for n in (b.input_layernorm, b.post_attention_layernorm):
            torch.nn.init.uniform_(n.weight, 0.5, 1.5)
    return blocks, LlamaRotaryEmbedding(cfg)


class _LlamaStage(torch.nn.Module):
    """One block on a micro-batch's sequence, with the rotary embedding of the whole sequence
    (what a Hugging Face model's forward hands each block): model code, no plait glue."""

    def __init__(self, block, rotary):
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, h):
        pos = torch.arange(T)[None]
        cos_sin = self.rotary(torch.empty(0), pos)  # needs only a dtype and a device
        return self.block(h, position_ids=pos, position_embeddings=cos_sin)


def _llama_reference():
    blocks, rotary = _llama_blocks()
    stages = [_LlamaStage(b, rotary) for b in blocks]
    xs, ys = _inputs()
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h = x[None]
        for s in stages:
            h = s(h)
        loss = (h - y[None]).square().sum() / (T * H)
        (loss / MB).backward()
        losses.append(loss.detach())
    return torch.stack(losses), [{n: p.grad.clone() for n, p in b.named_parameters()}
                                 for b in blocks]


def _llama_pipelined(rank, world, overlap):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import llama_block_plan
    from plait.pipelining import TensorParallelStage, overlap_f_b

    pp = 2
    tp = world // pp
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    p, r = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    blocks, rotary = _llama_blocks()
    mine = (p, LLAMA_STAGES - 1 - p)
    stages = []
    for s in mine:  # parallelized the torchtitan way; the stage takes and gives plain tensors
        parallelize_module(blocks[s], mesh["tp"], llama_block_plan(schedule="fine/sm/c2/g1/M"))
        stages.append(TensorParallelStage(_LlamaStage(blocks[s], rotary), mesh["tp"]))
    pipe = [PipelineStage(m, s, LLAMA_STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
            for m, s in zip(stages, mine, strict=True)]

    def loss_fn(out, target):  # this rank's tokens' share of the micro-batch's loss
        return (out - target).square().sum() / (T * H)

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn)
    ran = overlap_f_b(schedule, plan=overlap == "plan", measure=0) if overlap else None
    xs, ys = _inputs()
    shard = slice(r * T // tp, (r + 1) * T // tp)
    losses = []
    if p == 0:
        schedule.step(xs[:, shard], target=ys[:, shard], losses=losses)  # a (1, T/tp, H) each
    else:
        schedule.step()
    grads = {s: {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
                 for n, prm in blocks[s].named_parameters() if (g := prm.grad) is not None}
             for s in mine}
    local = torch.stack([x.detach() for x in losses]) if losses else None
    overlapped = None if ran is None else all(  # a plan's first action per pair is timed
        (rec.overlapped and rec.calls and rec.planned == (overlap == "plan") and not rec.stray)
        or (overlap == "plan" and "timed its units" in rec.reason)
        for rec in ran.records) and any(rec.overlapped for rec in ran.records)
    return local, grads, overlapped


@_GLOO_PIPELINING
def test_llama_blocks_under_overlap_f_b_equal_pytorchs_default_and_the_unsharded_model():
    """Hugging Face Llama blocks, each parallelized as torchtitan does (`llama_block_plan`:
    sequence-parallel norms, plait's fused QKV and gate/up all-gathers, reduce-scattered
    output projections), as DualPipeV's four stages on PP=2 x TP=2: with plait's
    OVERLAP_F_B (strands free, or from a plan of their timed units) every gradient equals
    PyTorch's default exactly, and both the unsharded blocks trained in one process."""
    want_loss, want = _llama_reference()
    default = run_ranks(4, _llama_pipelined, False, timeout_s=240)
    plait = run_ranks(4, _llama_pipelined, True, timeout_s=240)
    planned = run_ranks(4, _llama_pipelined, "plan", timeout_s=240)
    loss_sum = torch.zeros(MB)
    for (loss, grads, overlapped), (loss0, grads0, _), (loss1, grads1, ok1) in zip(
            plait, default, planned, strict=True):
        assert ok1, "every OVERLAP_F_B timed once per pair of stages, then planned"
        if loss is not None:
            assert torch.equal(loss1, loss0)
        for s, got in grads1.items():
            for n, g in got.items():
                assert torch.equal(g, grads0[s][n]), (s, n)
        assert overlapped, "every OVERLAP_F_B ran overlapped through plait's ops"
        for s, got in grads.items():
            assert set(got) == set(want[s])  # every parameter has its gradient
            for n, g in got.items():
                assert torch.equal(g, grads0[s][n]), (s, n)
                assert torch.allclose(g, want[s][n], atol=1e-5), (s, n)
        if loss is not None:
            assert torch.equal(loss, loss0)
            loss_sum += loss
    assert torch.allclose(loss_sum, want_loss, atol=1e-5)


def _fsdp_over_plait(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.nn import outside_plait, plait_groups
    from plait.parallel import PlaitColwiseParallel

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    block = torch.nn.Sequential(torch.nn.Linear(H, FFN, bias=False))
    parallelize_module(block, mesh["tp"], {"0": PlaitColwiseParallel()})
    alone = outside_plait(block)  # plait's TP alone: nothing outside plait
    fully_shard(block, mesh=mesh["dp"])
    return alone, outside_plait(block), len(plait_groups(block))


def test_fsdp_over_plaits_layers_is_communication_outside_plait():
    """FSDP's gathers and reduce-scatters are collectives outside plait: a stage whose
    plait-parallelized parameters FSDP also shards is found (and OVERLAP_F_B runs it in
    PyTorch's order), while plait's tensor parallelism alone is not."""
    for alone, with_fsdp, groups in run_ranks(4, _fsdp_over_plait, timeout_s=120):
        assert alone is None and groups == 1
        assert with_fsdp is not None and "0.weight" in with_fsdp and "FSDP" in with_fsdp, with_fsdp


def _ddp_over_plait(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from plait.nn import ColumnParallelLinear, outside_plait

    block = torch.nn.Sequential(ColumnParallelLinear(H, FFN, dist.group.WORLD))
    alone = outside_plait(block)
    return alone, outside_plait(torch.nn.Sequential(DistributedDataParallel(block)))


def test_ddp_over_plaits_layers_is_communication_outside_plait():
    """DDP all-reduces gradients in backward, on a group plait does not order: found."""
    for alone, with_ddp in run_ranks(2, _ddp_over_plait, timeout_s=120):
        assert alone is None
        assert with_ddp is not None and "DistributedDataParallel" in with_ddp, with_ddp


def _cuda_streams(rank, world, streams):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from plait.nn import ColumnParallelLinear, RowParallelLinear
    from plait.pipelining import overlap_f_b

    dev = torch.device("cuda", 0)
    group = dist.new_group([0], backend="nccl")  # NCCL: the stages' P2P too (gloo's fails
    torch.manual_seed(0)                         # before torch 2.13)

    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, group, schedule="seq/sm", device=dev)
            self.fc2 = RowParallelLinear(FFN, H, group, schedule="seq/sm", device=dev)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    blocks = [Dense(), Dense()]
    pipe = [PipelineStage(b, s, 2, dev, group=group) for s, b in enumerate(blocks)]
    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB,
                                 loss_fn=lambda out, y: (out - y).square().sum())
    ran = overlap_f_b(schedule, streams=streams, measure=0)
    xs, ys = _inputs()
    schedule.step(xs.reshape(-1, H).to(dev), target=ys.reshape(-1, H).to(dev))
    torch.cuda.synchronize()
    return ([p.grad.cpu() for b in blocks for p in b.parameters()], len(ran.streams),
            [r.overlapped for r in ran.records], [r.calls for r in ran.records])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a stream per stage)")
def test_a_stream_per_stage_on_cuda_gives_the_same_gradients():
    (plain, none, _, _), = run_ranks(1, _cuda_streams, False, timeout_s=240)
    (grads, streams, overlapped, calls), = run_ranks(1, _cuda_streams, True, timeout_s=240)
    assert none == 0 and streams == 2 and overlapped and all(overlapped)
    # the backward strand's calls run on CUDA's autograd device thread: still its own
    assert all(any(strand == "B" for strand, _ in c) for c in calls), calls
    for a, b in zip(grads, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_cpu_stages_get_no_stream():
    from types import SimpleNamespace

    from plait.pipelining import stream_per_stage

    stage = SimpleNamespace(device=torch.device("cpu"), stage_index=0, forward_one_chunk=len,
                            backward_one_chunk=len)
    assert stream_per_stage(SimpleNamespace(_stages=[stage])) == {}
    assert stage.forward_one_chunk is len  # left as it was


class _ModelStage(torch.nn.Module):
    """Stage `index` of a whole Hugging Face Llama split the torchtitan way (4 stages): the
    first holds the embedding, the last the final norm and the output head; each one block.
    Model code only: the boundaries are `TensorParallelStage`'s."""

    def __init__(self, model, index):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if index == 0 else None
        self.block = inner.layers[index]
        self.norm, self.head = (inner.norm, model.lm_head) if index == 3 else (None, None)
        self.rotary = inner.rotary_emb

    def forward(self, h):
        pos = torch.arange(T)[None]
        if self.embed is not None:
            h = self.embed(h)
        h = self.block(h, position_ids=pos,
                       position_embeddings=self.rotary(torch.empty(0), pos))
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def _llama_model_pipelined(rank, world, overlap, ac):
    """A whole tiny Llama as DualPipeV's 4 stages on PP=2 x TP=2, parallelized by
    `llama_plan` (plait's ends: embedding and head too), each stage (full or selective
    activation checkpointing around its block) wrapped by `TensorParallelStage`; the loss on
    each rank's vocabulary shard of the logits."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.ops import sac_policy
    from plait.parallel import llama_plan
    from plait.pipelining import TensorParallelStage, overlap_f_b

    pp, tp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    p, r = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=4, vocab_size=32,
                      max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(11)
    model = LlamaForCausalLM(cfg)
    parallelize_module(model, mesh["tp"], llama_plan(schedule="fine/sm/c2/g1/M"))
    if ac:
        kwargs = {} if ac == "full" else {"context_fn": functools.partial(
            create_selective_checkpoint_contexts, sac_policy())}
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer, **kwargs)
    mine = (p, 3 - p)
    pipe = [PipelineStage(TensorParallelStage(_ModelStage(model, s), mesh["tp"]), s, 4,
                          torch.device("cpu"), group=mesh["pp"].get_group()) for s in mine]

    def loss_fn(out, target):  # this rank's vocabulary shard of the logits
        return (out - target).square().sum() / (T * 32)

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn)
    ran = overlap_f_b(schedule, measure=0) if overlap else None
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (MB, T), generator=g)
    target = torch.randn(MB, T, 32, generator=g)[..., r * 32 // tp:(r + 1) * 32 // tp]
    losses = []
    if p == 0:
        schedule.step(ids, target=target, losses=losses)
    else:
        schedule.step()
    grads = {n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).clone()
             for n, q in model.named_parameters() if q.grad is not None}
    records = None if ran is None else [(rec.overlapped, len(rec.calls), rec.reason)
                                        for rec in ran.records]
    return grads, records


@pytest.mark.parametrize("ac", [None, "full"])
@_GLOO_PIPELINING
def test_every_rank_of_a_whole_llamas_v_overlaps_and_equals_pytorchs_default(ac):
    """Embedding and head by plait's styles: the ranks holding them overlap too (no record
    falls back), also with full activation checkpointing; every gradient equals PyTorch's
    default order's exactly. (Selective checkpointing fails inside DualPipeV in PyTorch's
    default order already: "Trying to backward an extra time".)"""
    default = run_ranks(4, _llama_model_pipelined, False, ac, timeout_s=240)
    plait = run_ranks(4, _llama_model_pipelined, True, ac, timeout_s=240)
    for (grads, records), (grads0, _) in zip(plait, default, strict=True):
        assert records and all(ok and calls > 0 for ok, calls, _ in records), records
        assert grads.keys() == grads0.keys() and grads
        for n, g in grads.items():
            assert torch.equal(g, grads0[n]), n


def _llama_cross_entropy_pipelined(rank, world):
    """The recipe of docs/pytorch.md for the loss of a pipelined, plait-parallelized model:
    the last stage hands on its vocabulary shard of the logits (`TensorParallelStage`); the
    loss function wraps it back as that shard of a `DTensor` and takes the cross-entropy
    under `loss_parallel()`, which is held around the whole `schedule.step` (the schedule
    runs the backward inside it); each micro-batch's mean divided by their count, with
    `scale_grads=False`, is the batch's mean, as torchtitan rescales it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.parallel import llama_plan
    from plait.pipelining import TensorParallelStage, overlap_f_b

    pp, tp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    p = mesh["pp"].get_local_rank()
    cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=4, vocab_size=32,
                      max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(11)
    model, ref = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (MB, T), generator=g)
    labels = torch.randint(0, 32, (MB, T), generator=g)
    want = torch.nn.functional.cross_entropy(ref(ids).logits.flatten(0, 1), labels.flatten())
    want.backward()
    parallelize_module(model, mesh["tp"], llama_plan(schedule="fine/sm/c2/g1/M"))
    mine = (p, 3 - p)
    pipe = [PipelineStage(TensorParallelStage(_ModelStage(model, s), mesh["tp"]), s, 4,
                          torch.device("cpu"), group=mesh["pp"].get_group()) for s in mine]

    def loss_fn(out, target):  # this rank's vocabulary shard of the logits, as a DTensor
        logits = DTensor.from_local(out, mesh["tp"], [Shard(-1)], run_check=False)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()) / MB

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn, scale_grads=False)
    ran = overlap_f_b(schedule, measure=0)
    losses = []
    with loss_parallel():
        if p == 0:
            schedule.step(ids, target=labels, losses=losses)
        else:
            schedule.step()
    got = sum(x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses)
    loss_ok = p != 0 or bool(torch.allclose(got, want, atol=1e-5))
    held = [q for q in model.parameters() if q.grad is not None]
    grads_ok = bool(held) and all(
        torch.allclose(q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad,
                       r.grad, atol=1e-5)
        for q, r in zip(model.parameters(), ref.parameters(), strict=True)
        if q.grad is not None)
    return loss_ok and grads_ok and all(rec.overlapped for rec in ran.records)


@_GLOO_PIPELINING
def test_a_pipelined_llamas_cross_entropy_under_loss_parallel_equals_the_unsharded_loss():
    """docs/pytorch.md's loss recipe, followed: DualPipeV PP=2 x TP=2, plait's OVERLAP_F_B on
    every action, the vocabulary-parallel cross-entropy: the loss and every gradient a rank
    holds equal the unsharded model's."""
    on_every_rank(4, _llama_cross_entropy_pipelined, timeout_s=240)


def _titan_stage(model, index, stages):
    """Stage `index` of `stages` split as torchtitan's `pipeline_module_split` does: a copy of
    the whole model keeping one block, its embedding set to None unless first, its norm and
    head unless last; its forward skips what it lacks, as torchtitan's decoders do."""
    import copy

    stage = copy.deepcopy(model)
    for name in list(stage.layers):
        if int(name) != index:
            del stage.layers[name]
    if index != 0:
        stage.tok_embeddings = None
    if index != stages - 1:
        stage.norm = stage.lm_head = None

    def forward(h):
        if stage.tok_embeddings is not None:
            h = stage.tok_embeddings(h)
        for layer in stage.layers.values():
            h = layer(h)
        return h if stage.lm_head is None else stage.lm_head(stage.norm(h))

    stage.forward = forward
    return stage


def _titan_split_pipelined(rank, world, overlap, seq_dim=None, batched=False):
    """A 4-layer torchtitan 2026 decoder (GQA; flattened tokens, or `batched` as torchtitan
    0.3.0 feeds them, one sequence a micro-batch) split into DualPipeV's four stages the
    torchtitan way, each planned by `llama_plan(stage)` and wrapped by `TensorParallelStage`
    with no hand-written plan and no seq_dim: both read it from the activations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import llama_plan
    from plait.pipelining import TensorParallelStage, overlap_f_b
    from tests.test_library import _Titan2026Block, _Titan2026Decoder

    pp, tp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    p, r = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(5)
    model = _Titan2026Decoder(False, vocab=32)
    model.layers.update({str(i): _Titan2026Block(False) for i in (2, 3)})
    mine = (p, 3 - p)
    modules = [_titan_stage(model, s, 4) for s in mine]
    for m in modules:
        parallelize_module(m, mesh["tp"], llama_plan(m, schedule="fine/sm/c2/g1/M"))
    pipe = [PipelineStage(TensorParallelStage(m, mesh["tp"], seq_dim), s, 4,
                          torch.device("cpu"), group=mesh["pp"].get_group())
            for m, s in zip(modules, mine, strict=True)]

    def loss_fn(out, target):  # this rank's vocabulary shard of the logits
        return (out - target).square().sum() / (16 * 32)

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn)
    ran = overlap_f_b(schedule, measure=0) if overlap else None
    g = torch.Generator().manual_seed(3)
    shape = (MB, 16) if batched else (MB * 16,)  # 16 tokens a micro-batch
    ids = torch.randint(0, 32, shape, generator=g)
    target = torch.randn(*shape, 32, generator=g)[..., r * 32 // tp:(r + 1) * 32 // tp]
    grads = step_and_stage_grads(schedule, p == 0, ids, target,
                                 dict(zip(mine, modules, strict=True)))
    records = None if ran is None else [(rec.overlapped, len(rec.calls), rec.reason)
                                        for rec in ran.records]
    return grads, records, [st.seq_dim for st in (x.submod for x in pipe)]


@_GLOO_PIPELINING
@pytest.mark.parametrize("batched", [False, True], ids=["flattened", "batch-of-one"])
def test_a_torchtitan_split_planned_by_llama_plan_overlaps_and_equals_pytorchs_default(batched):
    """torchtitan's stage split of a 2026 decoder, DualPipeV PP=2 x TP=2: `llama_plan(stage)`
    plans each stage for what it holds, `TensorParallelStage` and the plan read the sequence
    dimension from the activations (a batch of one sequence failed: the layout's guess
    sharded the batch); every action overlaps and every gradient equals PyTorch's default
    order's."""
    default = run_ranks(4, _titan_split_pipelined, False, None, batched, timeout_s=240)
    plait = run_ranks(4, _titan_split_pipelined, True, None, batched, timeout_s=240)
    for (grads, records, dims), (grads0, _, _) in zip(plait, default, strict=True):
        assert dims == [None, None], dims
        assert records and all(ok and calls > 0 for ok, calls, _ in records), records
        assert grads.keys() == grads0.keys() and grads
        for n, g in grads.items():
            assert torch.equal(g, grads0[n]), n


@_GLOO_PIPELINING
def test_a_wrong_seq_dim_in_a_pipeline_is_one_line_and_no_rank_hangs():
    """seq_dim=1 on flattened tokens: the ranks holding the first stage refuse the input in
    one line naming what to pass, and the run ends (the other ranks, waiting on them, are
    ended with it, as torchrun ends a job whose rank failed) instead of hanging."""
    from plait.runtime.launch import RankError

    with pytest.raises(RankError, match=r"seq_dim: 1 is the hidden dimension .* Fix: pass "
                       r"seq_dim=0"):
        run_ranks(4, _titan_split_pipelined, True, 1, timeout_s=120)
