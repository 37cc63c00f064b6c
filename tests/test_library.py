"""plait's TP ops as torch custom ops (`torch.ops.plait.*`): FakeTensor shapes, autograd,
`torch.compile(fullgraph=True)` and `torch.export` trace through them, on real gloo ranks;
results and gradients equal the eager ops'."""

import re

import pytest
import torch

from plait.runtime.launch import run_ranks
from tests.helpers import on_every_rank

pytestmark = pytest.mark.slow


def _mlp(x, w1, w2, schedules):
    """A sequence-parallel MLP: all-gather -> column GEMM, row GEMM -> reduce-scatter; and the
    contract's other forms (an average, scattering the last dimension) beside it."""
    from plait import ops

    s1, s2 = schedules
    _, (h,) = ops.all_gather_matmul(x, [w1], schedule=s1)
    y = ops.matmul_reduce_scatter(torch.relu(h), w2, schedule=s2)
    side = ops.matmul_reduce_scatter(torch.relu(h), w2.repeat(1, 2), "avg", -1)
    return y + side[: y.shape[0], : y.shape[1]].sum() * 0


def _compiled_equals_eager(rank, world, backend, schedules):
    torch.manual_seed(0)
    x = torch.randn(8 * world, 6)[rank * 8:(rank + 1) * 8].clone().requires_grad_()
    w1 = torch.randn(6, 10, requires_grad=True)
    w2 = torch.randn(10, 4, requires_grad=True)
    eager = _mlp(x, w1, w2, schedules)
    eager.square().sum().backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c: _mlp(a, b, c, schedules), fullgraph=True,
                       backend=backend)
    got = fn(x, w1, w2)
    got.square().sum().backward()
    assert torch.allclose(got, eager, atol=1e-5)
    for t, g in zip((x, w1, w2), want, strict=True):
        assert torch.allclose(t.grad, g, atol=1e-4)
    return tuple(got.shape)


@pytest.mark.parametrize(("backend", "schedules"), [
    ("aot_eager", ("seq/sm", "seq/sm")), ("aot_eager", ("fine/sm/c2/g1/M", "fine/dma/c2/g1/M")),
    ("inductor", ("fine/sm/c2/g1/M", "seq/sm"))])
def test_compile_fullgraph_traces_through_the_ops(backend, schedules):
    shapes = run_ranks(2, _compiled_equals_eager, backend, schedules, timeout_s=400)
    assert shapes == [(8, 4), (8, 4)]


def _fake_shapes(rank, world):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from plait import ops

    with FakeTensorMode():
        x, w = torch.empty(8, 3, 6), torch.empty(6, 10)
        g, (y,) = ops.all_gather_matmul(x, [w], gather_dim=1)
        k_g, (k_y,) = ops.all_gather_matmul(torch.empty(8, 3), [torch.empty(3 * world, 5)],
                                            gather_dim=1)
        z = ops.matmul_reduce_scatter(torch.empty(8, 10), torch.empty(10, 4))
    return [tuple(t.shape) for t in (g, y, k_g, k_y, z)]


def test_fake_tensors_get_the_ops_shapes():
    out = run_ranks(2, _fake_shapes, timeout_s=120)
    assert out[0] == [(8, 6, 6), (8, 6, 10), (8, 6), (8, 5), (4, 4)] and out[0] == out[1]


def _exported(rank, world):
    from plait import ops

    class Column(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ops.all_gather_matmul(x, [self.w])[1][0]

    m = Column()
    x = torch.randn(4, 6)
    ep = torch.export.export(m, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("plait.all_gather_matmul" in t for t in targets), targets
    return torch.allclose(ep.module()(x), m(x))


def test_export_keeps_the_op_in_the_graph():
    on_every_rank(2, _exported, timeout_s=120)


def _compiled_layers(rank, world):
    from plait.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(6, 10, schedule="fine/sm/c2/g1/M"),
                                torch.nn.ReLU(),
                                RowParallelLinear(10, 6, schedule="fine/dma/c2/g1/M"))
    x = torch.randn(8, 6)
    eager = model(x)
    eager.sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    got.sum().backward()
    return torch.allclose(got, eager, atol=1e-5) and all(
        torch.allclose(p.grad, g, atol=1e-4) for p, g in zip(model.parameters(), want,
                                                            strict=True))


def test_plait_layers_compile_fullgraph():
    on_every_rank(2, _compiled_layers, timeout_s=240)


def _autocast_layers(rank, world):
    from plait.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    col, row = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row(torch.relu(col(x)))
    y.float().sum().backward()
    full = row(torch.relu(col(x)))  # fp32 reference
    return (y.dtype, col.weight.grad.dtype, row.weight.grad.dtype,
            bool(torch.allclose(y.float(), full, rtol=0.05, atol=0.05)))


def test_autocast_runs_the_layers_in_its_dtype():
    for got in run_ranks(2, _autocast_layers, timeout_s=120):
        assert got == (torch.bfloat16, torch.float32, torch.float32, True)


def _expert_ops_compiled(rank, world, experts):
    from plait import ops

    torch.manual_seed(0)
    rows = 4 * world * experts
    x = torch.randn(rows, 6, requires_grad=True)
    w1 = torch.randn(*((experts,) if experts > 1 else ()), 6, 10, requires_grad=True)
    w2 = torch.randn(*((experts,) if experts > 1 else ()), 10, 6, requires_grad=True)

    def moe(x, w1, w2):
        _, h = ops.all_to_all_matmul(x, w1, schedule="fine/dma/c2/g1/M")
        return ops.matmul_all_to_all(torch.relu(h), w2, schedule="fine/sm/c2/g1/M")

    eager = moe(x, w1, w2)
    eager.square().sum().backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x, w1, w2)
    got.square().sum().backward()
    return torch.allclose(got, eager, atol=1e-5) and all(
        torch.allclose(t.grad, g, atol=1e-4) for t, g in zip((x, w1, w2), want, strict=True))


@pytest.mark.parametrize("experts", [1, 2])
def test_expert_parallel_ops_compile_fullgraph(experts):
    on_every_rank(2, _expert_ops_compiled, experts, timeout_s=240)


def _init_shards(rank, world):
    from plait.nn import ColumnParallelLinear, ExpertParallelMLP, RowParallelLinear

    torch.manual_seed(0)  # the same seed on every rank, as most training scripts do
    col = ColumnParallelLinear(256, 512, bias=True)
    row = RowParallelLinear(512, 256, bias=True)
    moe = ExpertParallelMLP(16, 32, experts=2)
    torch.manual_seed(0)  # the unsharded layers, drawn the same way
    ref_col, ref_row = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)
    same = (torch.equal(col.weight, ref_col.weight.chunk(world, 0)[rank])
            and torch.equal(col.bias, ref_col.bias.chunk(world)[rank])
            and torch.equal(row.weight, ref_row.weight.chunk(world, 1)[rank])
            and torch.equal(row.bias, ref_row.bias))
    return same, moe.fc1.detach().clone()


def test_parallel_linears_start_as_slices_of_the_unsharded_layer():
    """With one seed everywhere, each shard is its slice of what nn.Linear would have drawn
    for the whole layer (they were per-rank draws: reproducible, but no one layer's slices);
    every rank's experts differ and have nn.Linear's spread."""
    (same0, e0), (same1, e1) = run_ranks(2, _init_shards, timeout_s=60)
    assert same0 and same1
    experts = torch.cat([e0, e1])
    assert all(not torch.equal(experts[i], experts[j]) for i in range(4) for j in range(i))
    bound = 1 / 16 ** 0.5
    assert experts.abs().max() <= bound
    assert abs(experts.std().item() - bound / 3 ** 0.5) < 0.05 * bound  # uniform's std


def _clipped(rank, world):
    from plait.nn import ColumnParallelLinear, RowParallelLinear, clip_grad_norm_

    torch.manual_seed(0)
    w1, w2, bias = torch.randn(12, 6), torch.randn(6, 12), torch.randn(6)
    x = torch.randn(4 * world, 6)
    model = torch.nn.Module()
    model.col, model.row = ColumnParallelLinear(6, 12), RowParallelLinear(12, 6)
    model.bias = torch.nn.Parameter(bias.clone())  # replicated
    with torch.no_grad():
        model.col.weight.copy_(w1.chunk(world, 0)[rank])
        model.row.weight.copy_(w2.chunk(world, 1)[rank])
    y = model.row(torch.relu(model.col(x.chunk(world)[rank]))) + model.bias
    y.square().sum().backward()  # this rank's tokens; the total loss sums the ranks'
    torch.distributed.all_reduce(model.bias.grad)  # a replicated gradient, as SP loops do
    norm = clip_grad_norm_(model, max_norm=0.5)
    ref = torch.nn.Linear(6, 12, bias=False), torch.nn.Linear(12, 6)
    with torch.no_grad():
        ref[0].weight.copy_(w1)
        ref[1].weight.copy_(w2)
        ref[1].bias.copy_(bias)
    ref[1](torch.relu(ref[0](x))).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_([ref[0].weight, ref[1].weight, ref[1].bias], 0.5)
    clipped = torch.cat([ref[0].weight.grad.chunk(world, 0)[rank].flatten(),
                         ref[1].weight.grad.chunk(world, 1)[rank].flatten()])
    mine = torch.cat([model.col.weight.grad.flatten(), model.row.weight.grad.flatten()])
    return float(norm), float(want), bool(torch.allclose(mine, clipped, atol=1e-5))


def test_clip_grad_norm_sees_the_whole_model():
    """Shards' squares are summed over the group, replicated parameters count once: every
    rank gets the unsharded model's norm, and the same clipped gradients."""
    for norm, want, same in run_ranks(2, _clipped, timeout_s=60):
        assert norm == pytest.approx(want, rel=1e-5) and same


def _parallelized(rank, world, compile_it):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel

    torch.manual_seed(0)  # every rank builds the same full model, as torchtitan does
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4 * world, 6)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": PlaitColwiseParallel(schedule="fine/sm/c2/g1/M"),
                                     "2": PlaitRowwiseParallel(schedule="fine/dma/c2/g1/M")})
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_it else model
    y = run(x.chunk(world)[rank])
    y.square().sum().backward()
    want = ref(x)
    want.square().sum().backward()
    same_out = torch.allclose(y, want.chunk(world)[rank], atol=1e-5)
    # parameters are DTensors: their full gradients are the unsharded model's
    grads = all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-4)
                for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return same_out, grads, bool(torch.allclose(norm, want_norm, rtol=1e-5))


@pytest.mark.parametrize("compile_it", [False, True])
def test_parallelize_module_with_plait_styles(compile_it):
    assert run_ranks(2, _parallelized, compile_it, timeout_s=240) == [(True, True, True)] * 2


def _checkpointed(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": PlaitColwiseParallel(), "2": PlaitRowwiseParallel()})
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=folder)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state)
    return all(torch.equal(v.full_tensor(), saved[k]) for k, v in model.state_dict().items())


def test_distributed_checkpoint_restores_every_shard(tmp_path):
    on_every_rank(2, _checkpointed, str(tmp_path / "ckpt"), timeout_s=120)


def _with_bias(rank, world):
    from plait.nn import ColumnParallelLinear, RowParallelLinear, clip_grad_norm_

    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(12, 6), torch.randn(12), torch.randn(6, 12), torch.randn(6)
    x = torch.randn(4 * world, 6)
    model = torch.nn.Sequential(ColumnParallelLinear(6, 12, bias=True), torch.nn.ReLU(),
                                RowParallelLinear(12, 6, bias=True))
    with torch.no_grad():
        model[0].weight.copy_(w1.chunk(world)[rank])
        model[0].bias.copy_(b1.chunk(world)[rank])
        model[2].weight.copy_(w2.chunk(world, 1)[rank])
        model[2].bias.copy_(b2)
    y = model(x.chunk(world)[rank])
    y.square().sum().backward()
    torch.distributed.all_reduce(model[2].bias.grad)  # replicated, sequence-parallel
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    with torch.no_grad():
        for dst, src in zip(ref.parameters(), (w1, b1, w2, b2), strict=True):
            dst.copy_(src)
    want = ref(x)
    want.square().sum().backward()
    norm = clip_grad_norm_(model, 1e9)
    return (torch.allclose(y, want.chunk(world)[rank], atol=1e-5)
            and torch.allclose(model[0].bias.grad, ref[0].bias.grad.chunk(world)[rank],
                               atol=1e-4)
            and torch.allclose(model[2].bias.grad, ref[2].bias.grad, atol=1e-4)
            and abs(float(norm) - float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)))
            < 1e-3)


def test_parallel_linears_with_bias_match_nn_linear():
    on_every_rank(2, _with_bias, timeout_s=60)


def _mlp_case(rank, schedules):
    """This rank's input and the MLP's weights, the plain output and the gradients it gives
    (the reference a checkpointed run must equal); the gradients cleared again."""
    torch.manual_seed(0)
    x = torch.randn(8, 6)[rank * 4:(rank + 1) * 4].clone().requires_grad_()
    w1, w2 = torch.randn(6, 10, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    plain = _mlp(x, w1, w2, schedules)
    plain.square().sum().backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    return x, w1, w2, plain, want


def _checkpointed_activations(rank, world):
    from torch.utils.checkpoint import checkpoint

    schedules = ("fine/dma/c2/g1/M", "fine/sm/c2/g1/M")
    x, w1, w2, plain, want = _mlp_case(rank, schedules)
    again = checkpoint(_mlp, x, w1, w2, schedules, use_reentrant=False)  # recomputed in bwd
    again.square().sum().backward()
    return torch.allclose(again, plain) and all(
        torch.allclose(t.grad, g, atol=1e-5) for t, g in zip((x, w1, w2), want, strict=True))


def test_activation_checkpointing_recomputes_the_ops():
    on_every_rank(2, _checkpointed_activations, timeout_s=60)


class _Block(torch.nn.Module):
    """A block that reads its input through two linears (as a Llama attention reads Q, K, V)
    and its shape, and reshapes their products (as attention splits heads)."""

    def __init__(self, misuse: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(6, 4, bias=False)
        self.misuse = misuse

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        a = self.a(hidden_states).view(*lead, 2, -1)  # heads, as a view of the columns
        b = self.b(hidden_states * 2 if self.misuse else hidden_states)
        return torch.cat([a.flatten(-2), b], -1).tanh()


def _fused(rank, world, misuse):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.errors import SpecError
    from plait.parallel import PlaitFusedColwiseParallel

    torch.manual_seed(0)
    block, ref = _Block(misuse), _Block()
    ref.load_state_dict(block.state_dict())
    x = torch.randn(2, 4 * world, 6)  # (batch, sequence, hidden): the sequence is dim 1
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(block, mesh, PlaitFusedColwiseParallel(("a", "b"), seq_dim=1,
                                                              schedule="fine/sm/c2/g1/M"))
    try:
        y = block(hidden_states=x.chunk(world, 1)[rank])  # called by keyword, as HF does
    except SpecError as exc:
        return str(exc)
    # each rank holds its output columns of the whole sequence: summed over ranks, the
    # unsharded block's (its sum over columns spans the ranks), times the gathered input
    y.sum().backward()
    ref(x).sum().backward()
    grads = all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-4)
                for p, q in zip(block.parameters(), ref.parameters(), strict=True))
    return y.shape == (2, 4 * world, 12 // world), grads


def test_one_all_gather_feeds_a_blocks_input_linears():
    assert run_ranks(2, _fused, False, timeout_s=120) == [(True, True)] * 2
    (err, _) = run_ranks(2, _fused, True, timeout_s=120)
    assert "tensor other than the block's products" in err, err


def _selectively_checkpointed(rank, world):
    """Op-level SAC saves what its policy names: with plait's ops in it, the backward runs
    none of their forward calls again (torchtitan's list names only PyTorch's collectives, so
    every plait call was recomputed: more communication)."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from plait import ops
    from plait.runtime.context import runtime_of

    schedules = ("fine/sm/c2/g1/M", "fine/dma/c2/g1/M")
    x, w1, w2, _, want = _mlp_case(rank, schedules)
    rt = runtime_of(None)
    calls = {}
    for name, context in (("full", None), ("sac", functools.partial(
            create_selective_checkpoint_contexts, ops.sac_policy()))):
        for t in (x, w1, w2):
            t.grad = None
        out = checkpoint(_mlp, x, w1, w2, schedules, use_reentrant=False,
                         **({} if context is None else {"context_fn": context}))
        before = len(rt.records)
        out.square().sum().backward()
        calls[name] = [r.label for r in rt.records[before:]]
        assert all(torch.allclose(t.grad, g, atol=1e-5)
                   for t, g in zip((x, w1, w2), want, strict=True)), name
    forward = {"ag_mm", "mm_rs"}
    assert sum(c in forward for c in calls["full"]) == 3, calls  # the forward, recomputed
    assert not any(c in forward for c in calls["sac"]), calls  # saved: no recompute
    return True


def test_selective_checkpointing_with_plaits_ops_in_its_policy_saves_their_communication():
    on_every_rank(2, _selectively_checkpointed, timeout_s=90)


def _checkpointed_then_compiled(rank, world, style, ac):
    """torchtitan's order: activation checkpointing (full, or selective with plait's
    policy), then per-block compile with fullgraph; gradients against the unsharded block."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from plait.ops import sac_policy
    from plait.parallel import (
        PlaitColwiseParallel,
        PlaitFusedColwiseParallel,
        PlaitRowwiseParallel,
    )

    torch.manual_seed(0)
    if style == "fused":
        block, ref = _Block(), _Block()
        plan = PlaitFusedColwiseParallel(("a", "b"), seq_dim=1, schedule="fine/sm/c2/g1/M")
    else:
        block = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 6, bias=False))
        ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                  torch.nn.Linear(8, 6, bias=False))
        plan = {"0": PlaitColwiseParallel(seq_dim=1, schedule="fine/sm/c2/g1/M"),
                "2": PlaitRowwiseParallel(seq_dim=1, schedule="fine/dma/c2/g1/M")}
    ref.load_state_dict(block.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(block, mesh, plan)
    kwargs = {} if ac == "full" else {"context_fn": functools.partial(
        create_selective_checkpoint_contexts, sac_policy())}
    torch._dynamo.reset()
    compiled = torch.compile(checkpoint_wrapper(block, **kwargs), fullgraph=True,
                             backend="aot_eager")
    x = torch.randn(2, 4 * world, 6)
    y = compiled(x.chunk(world, 1)[rank].clone().requires_grad_())
    y.sum().backward()
    ref(x).sum().backward()
    return all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-4)
               for p, q in zip(block.parameters(), ref.parameters(), strict=True))


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("style", ["fused", "colwise+rowwise"])
def test_plait_styles_checkpointed_then_compiled_match_the_unsharded_block(style, ac):
    on_every_rank(2, _checkpointed_then_compiled, style, ac, timeout_s=240)


def _llama_ends(rank, world):
    """A whole Hugging Face Llama parallelized by `llama_plan` with plait's ends (embedding
    and head) and with PyTorch's: the same logits, loss (under `loss_parallel`) and
    gradients as the unsharded model, and no parameter that communicates outside plait."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.nn import outside_plait
    from plait.parallel import PlaitEmbeddingParallel, llama_plan

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                      max_position_embeddings=16)
    cfg._attn_implementation = "sdpa"
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    want = torch.nn.functional.cross_entropy(ref(ids).logits.flatten(0, 1), target.flatten())
    want.backward()
    out = {}
    for ends in ("plait", "pytorch"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        parallelize_module(model, mesh, llama_plan(schedule="fine/sm/c2/g1/M", ends=ends))
        with loss_parallel():
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
        grads = all(torch.allclose((p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                    else p.grad), q.grad, atol=1e-4)
                    for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        out[ends] = (bool(torch.allclose(loss.full_tensor() if hasattr(loss, "full_tensor")
                                         else loss, want, atol=1e-5)), grads,
                     outside_plait(model))
    emb_ok = isinstance(llama_plan()["model.embed_tokens"], PlaitEmbeddingParallel)
    return out, emb_ok


def test_a_whole_llama_with_plaits_ends_equals_the_unsharded_model():
    for out, emb_ok in run_ranks(2, _llama_ends, timeout_s=180):
        assert emb_ok and out["plait"][:2] == (True, True), out
        assert out["plait"][2] is None, out  # every parameter communicates through plait
        assert out["pytorch"][:2] == (True, True) and "embed_tokens" in out["pytorch"][2], out


class _TitanAttention(torch.nn.Module):
    """torchtitan's attention on flattened tokens (tokens, dim): heads from the width it
    gets (so a rank's shard holds its heads), causal SDPA."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (f(x).view(t, -1, self.head_dim).transpose(0, 1)
                   for f in (self.wq, self.wk, self.wv))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(0, 1).reshape(t, -1))


class _TitanFeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = (torch.nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(torch.nn.Module):
    """A torchtitan-style TransformerBlock fed flattened tokens (tokens, dim)."""

    def __init__(self, dim: int = 16, heads: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attention = _TitanAttention(dim, heads)
        self.feed_forward = _TitanFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _flattened_tokens(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import LLAMA_NAMES, llama_block_plan
    from plait.pipelining import TensorParallelStage

    torch.manual_seed(0)
    block, ref = _TitanBlock(), _TitanBlock()
    ref.load_state_dict(block.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    names = LLAMA_NAMES["torchtitan"]._replace(head="lm_head")  # a layout of one's own
    parallelize_module(block, mesh, llama_block_plan(names, schedule="fine/dma/c2/g1/M",
                                                     seq_dim=0))
    x = torch.randn(8 * world, 16)
    y = TensorParallelStage(block, mesh, seq_dim=0)(x.chunk(world)[rank])
    want = ref(x)
    (y * want.chunk(world)[rank].detach()).sum().backward()  # each rank's tokens' share
    (want * want.detach()).sum().backward()
    ok = torch.allclose(y, want.chunk(world)[rank], atol=1e-5)
    grads = [torch.allclose(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad,
                            q.grad, atol=1e-4)
             for p, q in zip(block.parameters(), ref.parameters(), strict=True)]
    return ok, grads


def test_a_torchtitan_style_block_on_flattened_tokens_equals_the_unsharded_block():
    """`llama_block_plan(seq_dim=0)` for blocks fed flattened tokens (as current torchtitan
    feeds them), with the module names of a layout given as `LlamaNames`."""
    for ok, grads in run_ranks(2, _flattened_tokens, timeout_s=120):
        assert ok and len(grads) == 9 and all(grads), grads  # norms: Partial, summed


class _QKVLinear(torch.nn.Module):
    """torchtitan's 2026 `QKVLinear`: Q, K and V projections, (tokens, heads, head_dim)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.wk, self.wv = (torch.nn.Linear(dim, kv_heads * head_dim, bias=False)
                            for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lead = x.shape[:-1]  # (tokens,) flattened, or (batch, sequence)
        return tuple(f(x).view(*lead, -1, self.head_dim) for f in (self.wq, self.wk, self.wv))


class _FusedQKVLinear(torch.nn.Module):
    """torchtitan's 2026 `FusedQKVLinear`: one `wqkv` whose rows are laid out (KV group,
    R = heads per group + 2, head_dim); the output split along R."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim, self.per_group = head_dim, heads // kv_heads
        self.wqkv = torch.nn.Linear(dim, kv_heads * (self.per_group + 2) * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lead = x.shape[:-1]
        qkv = self.wqkv(x).view(*lead, -1, self.per_group + 2, self.head_dim)
        return tuple(part.reshape(*lead, -1, self.head_dim) for part in
                     torch.split(qkv, [self.per_group, 1, 1], dim=-2))


class _Titan2026Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, fused: bool) -> None:
        super().__init__()
        head_dim = dim // heads
        self.qkv_linear = (_FusedQKVLinear if fused else _QKVLinear)(dim, heads, kv_heads,
                                                                      head_dim)
        self.wo = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flattened tokens (tokens, dim), or torchtitan 0.3.0's batches (batch, seq, dim):
        SDPA on (heads, tokens, head_dim) or (batch, heads, seq, head_dim)."""
        q, k, v = (z.transpose(-3, -2) for z in self.qkv_linear(x))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        return self.wo(out.transpose(-3, -2).flatten(-2))


class _InterleavedFeedForward(torch.nn.Module):
    """torchtitan's latest `FeedForward`: one `w13` whose rows interleave gate and up."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.w2(torch.nn.functional.silu(gate) * up)


class _Titan2026Block(torch.nn.Module):
    def __init__(self, fused: bool, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attention = _Titan2026Attention(dim, 4, 2, fused)
        self.feed_forward = (_InterleavedFeedForward if fused else _TitanFeedForward)(dim,
                                                                                       hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class _Titan2026Decoder(torch.nn.Module):
    """A decoder as torchtitan writes it in 2026: blocks in a `ModuleDict` fed flattened
    tokens, the head `lm_head`, GQA with a plain or fused Q/K/V projection."""

    def __init__(self, fused: bool, dim: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleDict({str(i): _Titan2026Block(fused) for i in range(2)})
        self.norm = torch.nn.RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def _titan_2026(rank, world, fused, batch):
    """`batch` None: flattened tokens; else (batch, sequence) as torchtitan 0.3.0 feeds them.
    No seq_dim anywhere: the plan reads it from the activations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from plait.nn import outside_plait
    from plait.parallel import llama_plan

    mesh = init_device_mesh("cpu", (world,))
    shape = (8 * world,) if batch is None else (batch, 8 * world)
    tokens = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    ref = _Titan2026Decoder(fused)
    model = _Titan2026Decoder(fused)
    model.load_state_dict(ref.state_dict())
    want = torch.nn.functional.cross_entropy(ref(tokens).flatten(0, -2), target.flatten())
    want.backward()
    # the plain layout by its name; the fused one (wqkv, w13) read from the model itself
    layout = model if fused else "torchtitan-2026"
    parallelize_module(model, mesh, llama_plan(layout, schedule="fine/sm/c2/g1/M"))
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, -2), target.flatten())
        loss.backward()
    grads = [bool(torch.allclose(p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                 else p.grad, q.grad, atol=1e-4))
             for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    got = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return bool(torch.allclose(got, want, atol=1e-5)), grads, outside_plait(model)


@pytest.mark.parametrize(("fused", "batch"), [(False, None), (True, None), (True, 1), (False, 2)],
                         ids=["qkv-linear", "fused-wqkv-w13", "fused-batch-1", "qkv-batch-2"])
def test_a_decoder_as_torchtitan_writes_it_in_2026_equals_the_unsharded_model(fused, batch):
    """torchtitan's 2026 layouts (`qkv_linear`; a fused `wqkv` of whole KV groups with an
    interleaved `w13`; `lm_head`) on flattened tokens and on torchtitan 0.3.0's batches
    (batch 1 failed: the plan guessed seq_dim=0 from the layout and sharded the batch): the
    loss under `loss_parallel` and every gradient equal the unsharded model's, and every
    parameter communicates through plait; no seq_dim given anywhere."""
    for ok, grads, outside in run_ranks(2, _titan_2026, fused, batch, timeout_s=180):
        assert ok and all(grads), grads
        assert outside is None, outside


def test_a_llamas_layout_is_read_from_its_own_modules():
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.errors import SpecError
    from plait.parallel import LLAMA_NAMES, llama_names_of

    hf = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=64))
    assert llama_names_of(hf) == LLAMA_NAMES["hf"]
    assert llama_names_of(_Titan2026Decoder(False)) == LLAMA_NAMES["torchtitan-2026"]
    assert llama_names_of(_Titan2026Decoder(True)) == LLAMA_NAMES[
        "torchtitan-2026-fused-qkv"]._replace(up=("w13",))
    with pytest.raises(SpecError, match=re.escape("no mlp module among mlp | feed_forward")):
        llama_names_of(torch.nn.ModuleDict({"layers": torch.nn.ModuleList(
            [torch.nn.ModuleDict({"attention": torch.nn.Linear(2, 2)})])}))


def _deep_copies(rank, world):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.nn import ColumnParallelLinear, plait_groups
    from plait.parallel import PlaitColwiseParallel

    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 8, dist.group.WORLD)
    twin = copy.deepcopy(layer)
    x = torch.randn(4, 8)
    same_layer = (twin.group is layer.group and twin.weight is not layer.weight
                  and torch.equal(twin(x), layer(x)))
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    parallelize_module(model, mesh, {"0": PlaitColwiseParallel()})
    copied = copy.deepcopy(model)
    y = torch.randn(4, 8)
    same_model = (plait_groups(copied) == plait_groups(model)
                  and torch.equal(copied(y), model(y)))
    return same_layer and same_model


def test_plaits_modules_deep_copy_sharing_their_group():
    """`copy.deepcopy` of a plait layer or a module parallelized by a plait style failed
    (a process group cannot be pickled); PyTorch's `ColwiseParallel` linear copies."""
    on_every_rank(2, _deep_copies, timeout_s=120)


def test_a_pipeline_stage_is_planned_for_what_it_holds_and_reads_seq_dim_from_activations():
    """`llama_plan(stage)` refused a stage torchtitan split (its embedding, norm or head set to
    None: "no embed module"); the sequence dimension is read from the activations unless
    given (a layout's guess sharded torchtitan 0.3.0's batch)."""
    from plait.parallel import LLAMA_NAMES, llama_block_plan, llama_plan

    first, middle, last = (_Titan2026Decoder(False) for _ in range(3))
    first.norm = first.lm_head = None
    del first.layers["1"]
    middle.tok_embeddings = middle.norm = middle.lm_head = None
    last.tok_embeddings = None
    del last.layers["0"]
    blocks = set(llama_block_plan("torchtitan-2026"))
    assert set(llama_plan(first)) == {"tok_embeddings"} | {f"layers.*.{k}" for k in blocks}
    assert set(llama_plan(middle)) == {f"layers.*.{k}" for k in blocks}
    assert set(llama_plan(last)) == {"norm", "lm_head"} | {f"layers.*.{k}" for k in blocks}
    for styles, want in ((llama_plan(first), None), (llama_plan("torchtitan-2026"), None),
                         (llama_plan("hf"), None), (llama_plan("hf", seq_dim=0), 0)):
        dims = {getattr(s, "seq_dim", getattr(s, "sequence_dim", "?"))
                for s in styles.values()}
        assert dims == {want}, (dims, want)
    assert LLAMA_NAMES["torchtitan-2026"].embed == "tok_embeddings"


def test_a_tensor_parallel_stage_reads_seq_dim_from_its_input_and_refuses_the_hidden_one(
        monkeypatch):
    """With the default seq_dim=1 a stage of flattened-token blocks sharded the hidden
    dimension: the next ranks failed inside RMSNorm, the previous ones hung. The sequence is
    the dimension before the hidden one, of each input; a seq_dim given that names the
    hidden one is refused."""
    from torch.distributed.tensor import DTensor, Shard

    from plait.errors import SpecError
    from plait.parallel import sequence_dim
    from plait.pipelining import TensorParallelStage

    stage = _Titan2026Decoder(False)
    stage.tok_embeddings = stage.lm_head = None
    assert TensorParallelStage(stage, mesh=None).seq_dim is None
    assert sequence_dim(torch.empty(16, 8), None, "") == 0  # flattened tokens
    assert sequence_dim(torch.empty(2, 16, 8), None, "") == 1  # (batch, sequence, hidden)
    taken: list[object] = []  # the placements each input is taken with
    monkeypatch.setattr(DTensor, "from_local", staticmethod(
        lambda x, mesh, placements, run_check: taken.append(placements) or x))
    auto = TensorParallelStage(stage, mesh=None)
    auto._sharded(torch.randn(1, 16, 8))  # torchtitan 0.3.0's batch of one
    auto._sharded(torch.randn(16, 8))
    assert taken == [[Shard(1)], [Shard(0)]]
    wrong = TensorParallelStage(stage, mesh=None, seq_dim=1)
    with pytest.raises(SpecError, match=r"seq_dim: 1 is the hidden dimension of the stage's "
                       r"input \(16, 16\)\. Fix: pass seq_dim=0"):
        wrong(torch.randn(16, 16))


def _disagreeing_seq_dims(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import llama_block_plan
    from plait.pipelining import TensorParallelStage

    mesh = init_device_mesh("cpu", (world,))
    block = _Titan2026Block(False)
    parallelize_module(block, mesh, llama_block_plan("torchtitan-2026", seq_dim=0))
    TensorParallelStage(block, mesh, seq_dim=1)(torch.randn(2, 8, 16))


def test_a_plan_and_a_stage_that_disagree_on_seq_dim_are_one_line_naming_both():
    """`seq_dim` given to the plan but another to `TensorParallelStage`: gloo aborted with
    "Received data size doesn't match expected size"; PyTorch's SequenceParallel would have
    redistributed the input silently (communication outside plait)."""
    from plait.runtime.launch import RankError

    with pytest.raises(RankError, match=r"seq_dim: .* takes the sequence along dim 0 but its "
                       r"input .* arrives sharded along dim 1"):
        run_ranks(2, _disagreeing_seq_dims, timeout_s=60)
