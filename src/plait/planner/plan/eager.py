"""The memory-bound work of a Llama block run eagerly, op by op (PyTorch without a compiler or
fused kernels; the Hugging Face `LlamaDecoderLayer`, torchtitan's model alike), against
the fused kernels the layer model (`plait.workload.transformer`) assumes.

Per layer and micro-batch, bf16, the bytes every non-matmul, non-attention operator reads and
writes (`plait.measure.traffic` counts them; `tests/test_eager_traffic.py` checks the formula
against the Hugging Face layer on CPU, byte for byte): with T tokens, S = T / TP of them
between the TP regions (sequence parallel), h the hidden width, f the MLP width, q and kv the
query and key/value widths and d the head width on one rank,

- forward: 84 S h + 48 S + 4 h (two RMSNorms in fp32, the residual adds), 10 T f (SiLU and
  the gate's product), 20 T (q + kv) + 8 T d (the rotary embedding of q and k);
- backward: 222 S h + 72 S + 8 h, 18 T f, 28 T (q + kv) + 8 T d, and 4 T q and 4 T kv where
  a rank holds more than one query (key/value) head: the copy that makes that gradient
  contiguous, which a single head's transpose does not need;

in 30 kernels forward and 54 backward, plus one per contiguous copy, each paying the GPU's
launch overhead.
"""

from __future__ import annotations

from plait.spec.model import ModelSpec

FORWARD_KERNELS, BACKWARD_KERNELS = 30, 54


def eager_kernels(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(forward, backward) memory-bound kernels of one eager Llama block."""
    copies = (model.heads // tp > 1) + (model.kv_heads // tp > 1)
    return FORWARD_KERNELS, BACKWARD_KERNELS + copies


def eager_bytes(model: ModelSpec, tokens: int, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes of the memory-bound operators of one eager Llama block."""
    shard = tokens // tp
    h, d = model.hidden, model.head_dim
    heads, kv_heads = model.heads // tp, max(1, model.kv_heads // tp)
    q, kv = heads * d, kv_heads * d
    f = (model.ffn if model.moe is None else model.moe.top_k * model.moe.expert_ffn) // tp
    fwd = 84 * shard * h + 48 * shard + 4 * h + 10 * tokens * f + 20 * tokens * (q + kv) \
        + 8 * tokens * d
    copies = 4 * tokens * (q * (heads > 1) + kv * (kv_heads > 1))
    bwd = 222 * shard * h + 72 * shard + 8 * h + 18 * tokens * f + 28 * tokens * (q + kv) \
        + 8 * tokens * d + copies
    return float(fwd), float(bwd)
