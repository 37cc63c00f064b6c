"""plait against the torchtitan users install: torchtitan 0.3.0's own Llama3 (its debug flavor,
built by its `model_registry`), parallelized by plait's plan in place of torchtitan's TP step,
on 2 gloo ranks, against the same model unsharded. torchtitan's attention backends for
language models (FlexAttention, varlen) have no CPU backward, so the blocks run its
`ScaledDotProductAttention` (4-D SDPA on batched `(batch, sequence, hidden)` activations).

Runs in `make test-torchtitan`'s environment (torch 2.13.0, torchtitan 0.3.0, triton 3.9.0);
skipped, with one line, where torchtitan is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.runtime.launch import run_ranks
from tests.helpers import gloo_pipelining_skip, step_and_stage_grads

pytest.importorskip("torchtitan", reason="needs torchtitan 0.3.0 (make test-torchtitan)")

pytestmark = pytest.mark.slow

VOCAB = 2048


def _llama3(seed: int) -> torch.nn.Module:
    """torchtitan's debug Llama3 (6 layers, dim 256, 16 heads, fused `wqkv`), SDPA inside."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights()
    return model


def _grads_equal(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    """The parameters whose gradient differs from the unsharded model's."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if g is None or not torch.allclose(g, q.grad, atol=2e-4, rtol=1e-3):
            bad.append(name)
    return bad


def _tp_job(world: int, backend: str, batch: int, seed: int) -> tuple[Any, ...]:
    """A TP mesh of `world` ranks under torchtitan's `backend`, a batch of token ids and
    labels, the unsharded model with its loss (torchtitan's) backpropagated, and a copy to
    parallelize: (mesh, tokens, labels, ref, model, the reference loss)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend(backend)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, 16 * world), generator=g)
    labels = torch.randint(0, VOCAB, (batch, 16 * world), generator=g)
    ref, model = _llama3(0), _llama3(0)
    want = cross_entropy_loss(ref(tokens), labels)  # no TP mesh current: the plain loss
    want.backward()
    return mesh, tokens, labels, ref, model, want


def _tensor_parallel(rank, world, schedule, batch):
    """plait's `llama_plan(model)` (no seq_dim: read from the batches) under `schedule`;
    torchtitan's `cross_entropy_loss` on plait's vocabulary-parallel head (its
    `partial_dtensor` backend takes a head's DTensor) against the unsharded model's."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.components.loss import cross_entropy_loss

    from plait.nn import outside_plait
    from plait.parallel import llama_plan
    from plait.runtime.context import close_all, runtime_of

    mesh, tokens, labels, ref, model, want = _tp_job(world, "partial_dtensor", batch, 1)
    parallelize_module(model, mesh["tp"], llama_plan(model, schedule=schedule))
    loss = cross_entropy_loss(model(tokens), labels)
    loss.backward()
    ran = sorted({r.schedule for r in runtime_of(mesh["tp"].get_group()).records})
    got = float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
    out = (got, float(want), _grads_equal(model, ref), outside_plait(model), ran)
    close_all()
    return out


@pytest.mark.parametrize(("schedule", "batch"), [
    ("seq/sm", 1), ("p2p/sm/M", 2), ("fine/dma/c2/g1/M", 1), ("auto", 2)])
def test_torchtitans_llama3_under_plaits_plan_equals_the_unsharded_model(schedule, batch):
    """torchtitan 0.3.0's own Llama3, TP 2 under plait's plan: the loss (torchtitan's own) and
    every gradient equal the unsharded model's, every parameter communicates through plait,
    and the schedules that ran are the ones asked for (`auto`: its candidates)."""
    for got, want, bad, outside, ran in run_ranks(2, _tensor_parallel, schedule, batch,
                                                  timeout_s=300):
        assert got == pytest.approx(want, rel=1e-4) and not bad, (got, want, bad)
        assert outside is None, outside
        assert ran and (schedule == "auto" or ran == [schedule]), ran


def _fsdp_and_tp(rank, world):
    """DP 2 (FSDP2's `fully_shard` per block and on the root, as torchtitan's
    `apply_fsdp_to_decoder` shards it) x TP 2 under plait's plan, on torchtitan's Llama3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import set_spmd_backend

    from plait.parallel import llama_plan
    from plait.runtime.context import close_all

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    d = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=g)
    labels = torch.randint(0, VOCAB, (2, 32), generator=g)
    ref, model = _llama3(0), _llama3(0)
    (cross_entropy_loss(ref(tokens), labels) / 2).backward()  # the mean over DP ranks
    parallelize_module(model, mesh["tp"], llama_plan(model, schedule="fine/sm/c2/g1/M"))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    loss = cross_entropy_loss(model(tokens[d:d + 1]), labels[d:d + 1])
    loss.backward()  # FSDP averages the gradients over DP
    bad = _grads_equal(model, ref)
    close_all()
    return bad


def test_fsdp2_over_plaits_tensor_parallel_llama3_equals_the_unsharded_model():
    """FSDP2 shards plait's DTensor parameters over the data-parallel mesh: the gradients,
    reduced over DP and gathered whole, equal the unsharded model's on the whole batch."""
    for bad in run_ranks(4, _fsdp_and_tp, timeout_s=300):
        assert not bad, bad


def _stage_of(model: torch.nn.Module, keep: range, first: bool, last: bool) -> torch.nn.Module:
    """A pipeline stage as torchtitan's split makes one: a copy of the model keeping the blocks
    in `keep`, its embedding set to None unless first, its norm and head unless last (its own
    forward skips what it lacks)."""
    import copy

    stage = copy.deepcopy(model)
    for name in list(stage.layers):
        if int(name) not in keep:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = stage.lm_head = None
    return stage


MB = 4  # micro-batches of one sequence


def _dualpipev(rank, world, overlap):
    """PP 2 x TP 2: torchtitan's Llama3 cut into DualPipeV's four stages (blocks 0-1, 2, 3,
    4-5), each planned by `llama_plan(stage)` and wrapped by `TensorParallelStage` (no
    seq_dim given), with plait's OVERLAP_F_B or PyTorch's default order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import llama_plan
    from plait.pipelining import TensorParallelStage, overlap_f_b
    from plait.runtime.context import close_all

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    p, r, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank(), world // 2
    model = _llama3(0)
    blocks = [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    mine = (p, 3 - p)
    modules = [_stage_of(model, blocks[s], s == 0, s == 3) for s in mine]
    for m in modules:
        parallelize_module(m, mesh["tp"], llama_plan(m, schedule="fine/sm/c2/g1/M"))
    pipe = [PipelineStage(TensorParallelStage(m, mesh["tp"]), s, 4, torch.device("cpu"),
                          group=mesh["pp"].get_group()) for m, s in zip(modules, mine,
                                                                        strict=True)]
    shard = VOCAB // tp

    def loss_fn(out, target):  # this rank's vocabulary shard of the logits
        return (out.float() - target).square().sum() / VOCAB

    schedule = ScheduleDualPipeV(pipe, n_microbatches=MB, loss_fn=loss_fn)
    ran = overlap_f_b(schedule, measure=0) if overlap else None
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (MB, 16), generator=g)
    target = torch.randn(MB, 16, VOCAB, generator=g)[..., r * shard:(r + 1) * shard]
    grads = step_and_stage_grads(schedule, p == 0, ids, target,
                                 dict(zip(mine, modules, strict=True)))
    records = None if ran is None else [(rec.overlapped, len(rec.calls)) for rec in ran.records]
    close_all()
    return grads, records


@gloo_pipelining_skip()
def test_torchtitans_llama3_in_dualpipev_overlaps_and_equals_pytorchs_default_order():
    """torchtitan's Llama3 split into DualPipeV's stages, PP 2 x TP 2 under plait's plan:
    every OVERLAP_F_B action overlapped (its strands' plait calls made), and every gradient
    equal to PyTorch's default order's."""
    default = run_ranks(4, _dualpipev, False, timeout_s=300)
    plait = run_ranks(4, _dualpipev, True, timeout_s=300)
    for (grads, records), (grads0, _) in zip(plait, default, strict=True):
        assert records and all(ok and calls > 0 for ok, calls in records), records
        assert grads.keys() == grads0.keys() and grads
        for n, g in grads.items():
            assert torch.allclose(g, grads0[n], atol=1e-5), n


def _checkpointed_compiled(rank, world, backend):
    """torchtitan's order on its own blocks: full activation checkpointing, then per-block
    `torch.compile(fullgraph=True)`, over plait's plan with `local=True` (no DTensor in a
    block: with one, 4-D SDPA under checkpointing + compile fails in PyTorch)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.components.loss import cross_entropy_loss

    from plait.parallel import llama_plan
    from plait.runtime.context import close_all

    mesh, tokens, labels, ref, model, want = _tp_job(world, "partial_dtensor", 2, 6)
    parallelize_module(model, mesh["tp"], llama_plan(model, schedule="fine/sm/c2/g1/M",
                                                     local=True))
    torch._dynamo.reset()
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(checkpoint_wrapper(block), fullgraph=True,
                                           backend=backend)
    loss = cross_entropy_loss(model(tokens), labels)
    loss.backward()
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want_grad = q.grad
        if grad.shape != q.shape:  # a plain shard of this rank
            dim = next(d for d in range(grad.dim()) if grad.shape[d] != q.shape[d])
            want_grad = q.grad.chunk(world, dim)[rank]
        if not torch.allclose(grad, want_grad, atol=2e-4, rtol=1e-3):
            bad.append(name)
    got = float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
    close_all()
    return got, float(want), bad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torchtitans_blocks_checkpointed_then_compiled_under_plaits_local_plan(backend):
    for got, want, bad in run_ranks(2, _checkpointed_compiled, backend, timeout_s=600):
        assert got == pytest.approx(want, rel=1e-4) and not bad, (got, want, bad)


def _default_backend_loss(rank, world):
    """torchtitan's loss as it ships (its `spmd_types` backend, inside its TP mesh, as its
    trainer runs it) on plait's head with `local_logits=True` (a DTensor there: a bare
    AssertionError in torchtitan's loss)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh

    from plait.parallel import llama_plan
    from plait.runtime.context import close_all

    mesh, tokens, labels, ref, model, want = _tp_job(world, "spmd_types", 1, 8)
    parallelize_module(model, mesh["tp"], llama_plan(model, local_logits=True))
    with set_current_spmd_mesh(mesh):
        logits = model(tokens)
        loss = cross_entropy_loss(logits, labels, global_vocab_size=VOCAB)
        loss.backward()
    out = (type(logits).__name__, float(loss.detach()), float(want), _grads_equal(model, ref))
    close_all()
    return out


def test_torchtitans_loss_under_its_default_backend_takes_plaits_local_logits():
    for kind, got, want, bad in run_ranks(2, _default_backend_loss, timeout_s=300):
        assert kind == "Tensor" and got == pytest.approx(want, rel=1e-4) and not bad, (
            kind, got, want, bad)


def _torchtitans_own_path(rank, world):
    """torchtitan's own `parallelize_llama` (TP 2 x FSDP 2, its FSDP2 wrapping; fp32 mixed
    precision, to compare exactly) with plait's plan in place of its TP step
    (`torchtitan_tensor_parallel`).
    On CPU ranks: torchtitan builds CUDA meshes (its device type set to CPU here) and FSDP2's
    PREMUL_SUM is not in gloo (sum reduction forced)."""
    import torchtitan.distributed.parallel_dims as torchtitan_dims
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3 import parallelize_llama

    from plait.parallel import torchtitan_tensor_parallel
    from plait.runtime.context import close_all

    torchtitan_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")
    par = ParallelismConfig(tensor_parallel_degree=2, data_parallel_shard_degree=world // 2,
                            spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(par, world)
    dims.build_mesh()
    ref, model = _llama3(0), _llama3(0)
    torchtitan_tensor_parallel(model, schedule="fine/sm/c2/g1/M")
    fp32 = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    parallelize_llama(model, parallel_dims=dims, training=fp32, parallelism=par,
                      compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=g)
    labels = torch.randint(0, VOCAB, (2, 32), generator=g)
    d = dims.get_mesh("fsdp").get_local_rank()
    cross_entropy_loss(ref(tokens), labels).backward()  # torchtitan sums over DP (divide 1)
    cross_entropy_loss(model(tokens[d:d + 1]), labels[d:d + 1]).backward()
    bad = _grads_equal(model, ref)
    close_all()
    return bad


def test_torchtitans_own_parallelize_path_runs_plaits_plan_in_place_of_its_tp_step():
    for bad in run_ranks(4, _torchtitans_own_path, timeout_s=300):
        assert not bad, bad
