"""The eager memory-bound traffic model (`plait.planner.plan.eager`) against the operators
PyTorch dispatches for a Hugging Face Llama layer on CPU: bytes and kernels, per phase."""

from __future__ import annotations

import pytest
import torch

from plait.measure.traffic import memory_traffic
from plait.planner.plan.eager import eager_bytes, eager_kernels

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("hidden", "ffn", "heads", "kv_heads", "head_dim", "batch", "seq"), [
    (256, 768, 8, 2, 32, 2, 64), (128, 256, 8, 4, 8, 4, 24), (256, 512, 8, 8, 64, 1, 64),
    (96, 288, 2, 1, 80, 1, 72)])
def test_eager_traffic_is_the_dispatched_operators(hidden, ffn, heads, kv_heads, head_dim,
                                                  batch, seq):
    from plait.spec.model import from_hf_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1, head_dim=head_dim,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=100,
        attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    rotary = tuple(t.detach() for t in model.model.rotary_emb(x, positions))

    def forward(t: torch.Tensor) -> torch.Tensor:
        out = model.model.layers[0](t, position_embeddings=rotary, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    got = memory_traffic(forward, x)
    spec = from_hf_config(config.to_dict())
    assert (got.bytes["forward"], got.bytes["backward"]) == eager_bytes(spec, batch * seq, 1)
    assert (got.kernels["forward"], got.kernels["backward"]) == eager_kernels(spec, 1)
