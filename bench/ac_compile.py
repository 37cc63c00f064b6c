"""torchtitan's order on a whole block, plait's TP beside PyTorch's: activation checkpointing
(full, or op-level SAC with `plait.ops.sac_policy()`), then `torch.compile(fullgraph=True)`.

    python bench/ac_compile.py            # writes out/ac_compile.json
    python bench/ac_compile.py --save     # the committed bench/results/ac_compile.json

The block is torchtitan's 2026 `TransformerBlock` as `tests/test_library.py` writes it (RMSNorms,
GQA attention under `qkv_linear` with causal SDPA, SwiGLU) fed flattened tokens, on 2 gloo
ranks. Each tensor-parallel plan runs with both block boundaries torchtitan has used: the
residual stream as this rank's local shard (`local`: PyTorch's `RowwiseParallel` default), and
as a `DTensor` sharded along the tokens (`dtensor`: plait's `llama_block_plan`, which only
takes that one). Each cell: "ok" with whether the gradients equal the unsharded block's, or the
error's first line. `tests/test_checkpoint_compile.py` asserts plait's cells.
"""

from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import results_io

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_library import _Titan2026Block

CELLS = [(tp, boundary, ac, backend) for tp in ("plait", "pytorch")
         for boundary in ("dtensor", "local") for ac in ("full", "sac")
         for backend in ("aot_eager", "inductor")
         if not (tp == "plait" and boundary == "local")]


def _pytorch_plan(boundary: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    local = boundary == "local"
    gather = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    return {"attention_norm": SequenceParallel(sequence_dim=0), "attention": gather,
            **{f"attention.qkv_linear.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "attention.wo": RowwiseParallel(output_layouts=Shard(0), use_local_output=local),
            "ffn_norm": SequenceParallel(sequence_dim=0), "feed_forward": gather,
            **{f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(0), use_local_output=local)}


def _cell(rank: int, world: int, tp: str, boundary: str, ac: str, backend: str) -> str:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from plait.ops import sac_policy
    from plait.parallel import llama_block_plan

    torch.manual_seed(0)
    block, ref = _Titan2026Block(False), _Titan2026Block(False)
    ref.load_state_dict(block.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    plan = llama_block_plan(block, schedule="fine/sm/c2/g1/M") if tp == "plait" else \
        _pytorch_plan(boundary)
    parallelize_module(block, mesh, plan)
    kwargs = {} if ac == "full" else {"context_fn": functools.partial(
        create_selective_checkpoint_contexts, sac_policy())}
    torch._dynamo.reset()
    compiled = torch.compile(checkpoint_wrapper(block, **kwargs), fullgraph=True,
                             backend=backend)
    x = torch.randn(8 * world, 16)
    shard = x.chunk(world)[rank].clone().requires_grad_()
    inp = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False) \
        if boundary == "dtensor" else shard
    try:
        y = compiled(inp)
        (y.to_local() if isinstance(y, DTensor) else y).sum().backward()
    except Exception as exc:  # the cell's outcome, reported
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        return f"{type(exc).__name__}: {first[:200]}"
    ref(x).sum().backward()
    same = all(torch.allclose(p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                              else p.grad, q.grad, atol=1e-4)
               for p, q in zip(block.parameters(), ref.parameters(), strict=True))
    return f"ok, gradients {'equal' if same else 'DIFFER'}"


def main() -> None:
    from plait.runtime.launch import run_ranks

    args = results_io.parser(__doc__).parse_args()
    rows = []
    for tp, boundary, ac, backend in CELLS:
        out = run_ranks(2, _cell, tp, boundary, ac, backend, timeout_s=600)
        rows.append({"tp": tp, "boundary": boundary, "ac": ac, "backend": backend,
                     "outcome": out[0]})
        print(f"{tp:8s} {boundary:8s} {ac:5s} {backend:10s} {out[0]}", flush=True)
    results_io.write("ac_compile.json", {"torch": torch.__version__,
                                         "python": platform.python_version(),
                                         "results": rows}, args.save)


if __name__ == "__main__":
    main()
