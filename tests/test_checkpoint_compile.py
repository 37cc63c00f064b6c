"""torchtitan's order on whole blocks: activation checkpointing (full, op-level SAC with plait's
policy, torchtitan's SAC), then per-block `torch.compile(fullgraph=True)`, on a whole
torchtitan-style block (norms `SequenceParallel`, GQA attention with SDPA, SwiGLU) and on a
2-layer decoder planned by `llama_plan`, 2 gloo ranks: gradients (and the loss) equal to the
unsharded model's. `fullgraph=True` makes any graph break an error."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.helpers import on_every_rank
from tests.test_library import _Titan2026Block, _Titan2026Decoder

pytestmark = pytest.mark.slow


def _titan_sac_policy() -> Any:
    """torchtitan's op-level SAC: a save list of compute-heavy ops and collectives, every
    second matmul recomputed; plait's ops saved beside them (`plait.ops.sac_save_ops`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from plait.ops import sac_save_ops

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default,
            *sac_save_ops()}
    counts: dict[str, int] = {}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op is aten.mm.default:
            counts[mode] = counts.get(mode, 0) + 1
            if counts[mode] % 2 == 0:  # every second matmul recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(module: torch.nn.Module, ac: str) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from plait.ops import sac_policy

    if ac == "full":
        return checkpoint_wrapper(module)
    make = sac_policy if ac == "sac" else _titan_sac_policy
    return checkpoint_wrapper(module, context_fn=functools.partial(
        create_selective_checkpoint_contexts, make()))


def _grads_equal(model: torch.nn.Module, ref: torch.nn.Module, rank: int = 0,
                 world: int = 1) -> bool:
    """Every gradient equals the unsharded model's: a `DTensor`'s whole, a plain parameter
    holding this rank's shard (`local=True`) against that shard of the reference's."""
    def whole(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if g.shape == q.shape:
            return g, q.grad
        dim = next(d for d in range(g.dim()) if g.shape[d] != q.shape[d])
        return g, q.grad.chunk(world, dim)[rank]

    return all(torch.allclose(*whole(p, q), atol=1e-4)
               for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def _block(rank: int, world: int, ac: str, backend: str) -> bool:
    """One whole block, its input and output `DTensor`s sharded along the flattened tokens (as
    `llama_plan`'s embedding hands them on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.parallel import llama_block_plan

    torch.manual_seed(0)
    block, ref = _Titan2026Block(False), _Titan2026Block(False)
    ref.load_state_dict(block.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(block, mesh, llama_block_plan(block, schedule="fine/sm/c2/g1/M"))
    torch._dynamo.reset()
    compiled = torch.compile(_checkpointed(block, ac), fullgraph=True, backend=backend)
    x = torch.randn(8 * world, 16)
    shard = x.chunk(world)[rank].clone().requires_grad_()
    y = compiled(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False))
    y.to_local().sum().backward()
    xi = x.clone().requires_grad_()
    want = ref(xi)
    want.sum().backward()
    return bool(torch.allclose(y.to_local(), want.chunk(world)[rank], atol=1e-5)) and \
        _grads_equal(block, ref) and \
        bool(torch.allclose(shard.grad, xi.grad.chunk(world)[rank], atol=1e-4))


def _decoder(rank: int, world: int, ac: str, backend: str) -> bool:
    """A 2-layer decoder as torchtitan writes it (GQA, flattened tokens, `lm_head`), planned by
    `llama_plan` from its own modules, each block checkpointed then compiled as torchtitan
    does; the loss under `loss_parallel`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from plait.parallel import llama_plan

    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, 64, (8 * world,), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 64, (8 * world,), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    ref, model = _Titan2026Decoder(True), _Titan2026Decoder(True)
    model.load_state_dict(ref.state_dict())
    want = torch.nn.functional.cross_entropy(ref(tokens), target)
    want.backward()
    parallelize_module(model, mesh, llama_plan(model, schedule="fine/sm/c2/g1/M"))
    torch._dynamo.reset()
    for name, layer in list(model.layers.items()):
        model.layers[name] = torch.compile(_checkpointed(layer, ac), fullgraph=True,
                                           backend=backend)
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
    return bool(torch.allclose(loss.full_tensor(), want, atol=1e-5)) and \
        _grads_equal(model, ref)


def _batched_decoder(rank: int, world: int, ac: str, backend: str) -> bool:
    """torchtitan 0.3.0's shape of the same decoder: batches (batch, sequence, hidden), so its
    attention calls 4-D SDPA, which fails under checkpointing + compile wherever a `DTensor`
    is in the region (PyTorch's own TP styles too: a `DeviceMesh` saved among its tensors).
    `llama_plan(local=True)` leaves none in the blocks: plain shards, plain activations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from plait.parallel import llama_plan

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8 * world), generator=g)
    target = torch.randint(0, 64, (2, 8 * world), generator=g)
    torch.manual_seed(0)
    ref, model = _Titan2026Decoder(True), _Titan2026Decoder(True)
    model.load_state_dict(ref.state_dict())
    want = torch.nn.functional.cross_entropy(ref(tokens).flatten(0, 1), target.flatten())
    want.backward()
    parallelize_module(model, mesh, llama_plan(model, schedule="fine/sm/c2/g1/M", local=True))
    torch._dynamo.reset()
    for name, layer in list(model.layers.items()):
        model.layers[name] = torch.compile(_checkpointed(layer, ac), fullgraph=True,
                                           backend=backend)
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        loss.backward()
    from plait.nn import clip_grad_norm_

    norm = clip_grad_norm_(model, 1e9)  # the plain shards and the ends' DTensors together
    return bool(torch.allclose(loss.full_tensor(), want, atol=1e-5)) and \
        _grads_equal(model, ref, rank, world) and \
        bool(torch.allclose(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9),
                            atol=1e-5))


@pytest.mark.parametrize(("ac", "backend"), [("full", "aot_eager"), ("sac", "inductor"),
                                             ("titan-sac", "aot_eager")])
def test_a_whole_block_checkpointed_then_compiled_equals_the_unsharded_block(ac, backend):
    on_every_rank(2, _block, ac, backend, timeout_s=300)


@pytest.mark.parametrize(("ac", "backend"), [("sac", "aot_eager"), ("full", "inductor")])
def test_a_decoder_checkpointed_then_compiled_per_block_equals_the_unsharded_model(ac,
                                                                                    backend):
    on_every_rank(2, _decoder, ac, backend, timeout_s=300)


@pytest.mark.parametrize(("ac", "backend"), [("full", "aot_eager"), ("sac", "inductor"),
                                             ("titan-sac", "aot_eager")])
def test_batched_blocks_with_4d_sdpa_checkpointed_then_compiled_equal_the_unsharded_model(
        ac, backend):
    """With `local=True` (no `DTensor` in a block) where PyTorch's TP styles, and plait's
    default plan, fail (`../shared/repro/ac_compile_4d_sdpa.py` beside this repository)."""
    on_every_rank(2, _batched_decoder, ac, backend, timeout_s=300)
