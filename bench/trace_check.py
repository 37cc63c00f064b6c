"""A profiler trace of one sequence-parallel step, for `plait analyze` on real hardware.

    torchrun --standalone --nproc-per-node N bench/trace_check.py --out DIR
    plait analyze DIR --json DIR/analyze.json

Each rank all-gathers its tokens into an FC1 GEMM and reduce-scatters the FC2 product (plain
PyTorch: NCCL on GPUs, gloo on CPUs), 3 profiled steps, and writes DIR/rank<r>.json. On a GPU
this exercises the parts of `plait analyze` that CPU CI checks only on synthetic traces: NCCL
kernel metadata, kernel-to-operator links for GEMM shapes, streams. `bench/gpu_check.sh` runs it
on one GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from plait.runtime.engines import all_gather_tensor, reduce_scatter_tensor
from plait.runtime.launch import init_from_env, leave_group
from plait.spec.dtypes import torch_dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    args = ap.parse_args()
    device = init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch_dtype("bf16" if device.type == "cuda" else "fp32")
    x = torch.randn(args.tokens // world, args.hidden, device=device, dtype=dtype)
    w1 = torch.randn(args.hidden, args.ffn // world, device=device, dtype=dtype)
    w2 = torch.randn(args.ffn // world, args.hidden, device=device, dtype=dtype)
    gathered = torch.empty(args.tokens, args.hidden, device=device, dtype=dtype)
    out = torch.empty(args.tokens // world, args.hidden, device=device, dtype=dtype)
    with torch.profiler.profile(record_shapes=True) as prof:
        for step in range(3):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                all_gather_tensor(gathered, x)
                h = torch.relu(gathered @ w1)
                reduce_scatter_tensor(out, h @ w2)
        if device.type == "cuda":
            torch.cuda.synchronize()
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.out / f"rank{rank}.json"))
    leave_group()


if __name__ == "__main__":
    main()
