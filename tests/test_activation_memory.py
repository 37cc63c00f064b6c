"""The saved-activation model (`plait.planner.plan.memory.saved_bytes`) against what autograd
keeps on CPU, byte for byte, for every activation-checkpointing mode: a Hugging Face Llama
decoder layer, and plait's own sequence-parallel MLP."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from plait.measure.activations import retained_bytes, saved_tensor_bytes
from plait.planner.plan.memory import saved_bytes

transformers = pytest.importorskip("transformers")

# torchtitan's op-level SAC: attention's outputs saved, and every other matmul of a block
SAVED_OPS = {torch.ops.aten.mm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy():  # type: ignore[no-untyped-def]
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        if op is torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            matmuls[key] += 1
            if matmuls[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def _modes(forward):  # type: ignore[no-untyped-def]
    return {"none": forward,
            "full": lambda x: checkpoint(forward, x, use_reentrant=False),
            "selective": lambda x: checkpoint(forward, x, use_reentrant=False,
                                              context_fn=_policy)}


@pytest.mark.parametrize(("heads", "kv_heads", "batch", "seq"), [(8, 2, 2, 64), (4, 4, 1, 96)])
def test_a_hugging_face_llama_layer_keeps_what_the_model_predicts(heads, kv_heads, batch, seq):
    from plait.spec.model import from_hf_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=1000, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    layer = model.model.layers[0]
    leaf = torch.randn(batch, seq, 256, dtype=torch.bfloat16, requires_grad=True)
    rotary = model.model.rotary_emb(leaf, torch.arange(seq).unsqueeze(0).expand(batch, seq))

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, position_embeddings=rotary, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    spec = from_hf_config(config.to_dict())
    params = list(model.parameters())
    measured = {mode: retained_bytes(f, leaf.clone(), params)
                for mode, f in _modes(forward).items()}
    predicted = {mode: saved_bytes(spec, batch * seq, 1, mode) for mode in measured}
    assert measured == predicted
    assert measured["none"] > measured["selective"] > measured["full"] > 0
    # autograd's own account (saved_tensors_hooks) agrees where no checkpoint is involved
    assert saved_tensor_bytes(forward, leaf.clone(), params, rotary) == measured["none"]


def _mlp_rank(rank: int, world: int) -> bool | str:
    from plait.nn import SequenceParallelMLP

    torch.manual_seed(0)
    tokens, hidden, ffn = 48, 64, 160
    mlp = SequenceParallelMLP(hidden, ffn, None, gated=True, dtype=torch.bfloat16)
    shard = torch.randn(tokens // world, hidden, dtype=torch.bfloat16, requires_grad=True)
    got = retained_bytes(mlp, shard.clone(), list(mlp.parameters()))
    # the model's MLP terms: gate and up (one fused output here), activation, product, each
    # tokens x ffn / tp; and the column-parallel linear's gathered input, tokens x hidden
    want = 4 * tokens * (ffn // world) * 2 + tokens * hidden * 2
    return True if got == want else f"kept {got} bytes, the model says {want}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_plaits_sequence_parallel_mlp_keeps_what_the_model_predicts(world):
    """plait's MLP on a TP group (sequence parallel, the gathered input kept for the weight
    gradient), its saved bytes as the model's MLP terms count them; and those terms are what
    `saved_bytes` adds per unit of MLP width."""
    from plait.spec.model import ModelSpec
    from tests.helpers import on_every_rank

    on_every_rank(world, _mlp_rank)
    spec = ModelSpec(layers=1, hidden=64, heads=4, kv_heads=4, ffn=160, vocab=16)
    assert saved_bytes(spec, 48, 2, "none") - saved_bytes(
        spec.with_(ffn=2), 48, 2, "none") == 4 * 48 * (80 - 1) * 2
