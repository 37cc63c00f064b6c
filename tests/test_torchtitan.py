"""plait against the torchtitan users install: torchtitan 0.3.0's own Llama3 (its debug flavor,
built by its `model_registry`), parallelized by plait's plan in place of torchtitan's TP step,
on 2 gloo ranks, against the same model unsharded. torchtitan's attention backends for
language models (FlexAttention, varlen) have no CPU backward, so the blocks run its
`ScaledDotProductAttention` (4-D SDPA on batched `(batch, sequence, hidden)` activations).

Runs in `make test-torchtitan`'s environment (torch 2.13.0, torchtitan 0.3.0, triton 3.9.0);
skipped, with one line, where torchtitan is not installed."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.launch import run_ranks

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


def _tensor_parallel(rank, world, schedule, batch):
    """plait's `llama_plan(model)` (no seq_dim: read from the batches) under `schedule`;
    torchtitan's `cross_entropy_loss` on plait's vocabulary-parallel head (its
    `partial_dtensor` backend takes a head's DTensor) against the unsharded model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import set_spmd_backend

    from plait.nn import outside_plait
    from plait.parallel import llama_plan
    from plait.runtime.context import close_all, runtime_of

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, 16 * world), generator=g)
    labels = torch.randint(0, VOCAB, (batch, 16 * world), generator=g)
    ref, model = _llama3(0), _llama3(0)
    want = cross_entropy_loss(ref(tokens), labels)
    want.backward()
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
