"""Benchmark: plait's plain schedule against PyTorch's own tensor parallelism, same block.

    python bench/tp_overhead.py            # writes out/tp_overhead.json
    python bench/tp_overhead.py --save     # the committed bench/results/tp_overhead.json

A sequence-parallel MLP block (Linear -> GELU -> Linear, no bias) on 2 gloo ranks,
parallelized by `parallelize_module` three ways: PyTorch's `ColwiseParallel` /
`RowwiseParallel` (its all-gather and reduce-scatter around plain matmuls), plait's
`PlaitColwiseParallel` / `PlaitRowwiseParallel` with `seq/sm` (the same collectives and
matmuls through plait's ops), and the same with plait's cross-rank check on every call (the
runtime's behaviour before it checked each signature once). Training steps (forward and
backward) in interleaved rounds, every step started together on both ranks; the median step
and plait's overhead over PyTorch's per step.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

import results_io
from plait import __version__

VARIANTS = ("pytorch", "plait seq/sm", "plait seq/sm, check every call")


def _rank(rank: int, world: int, tokens: int, hidden: int, rounds: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from plait.ops import runtime_of
    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel
    from plait.runtime.context import close_all
    from plait.runtime.timing import time_calls

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    blocks = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden, bias=False),
                                    torch.nn.GELU(),
                                    torch.nn.Linear(4 * hidden, hidden, bias=False))
        styles = ({"0": ColwiseParallel(input_layouts=Shard(0)),
                   "2": RowwiseParallel(output_layouts=Shard(0))} if name == "pytorch" else
                  {"0": PlaitColwiseParallel(schedule="seq/sm"),
                   "2": PlaitRowwiseParallel(schedule="seq/sm")})
        blocks[name] = parallelize_module(block, mesh, styles)
    x = torch.randn(tokens // world, hidden)
    rt = runtime_of(mesh)

    def step(name: str) -> None:
        rt.verify_every_call = name.endswith("every call")
        blocks[name](x).square().mean().backward()

    for name in VARIANTS:
        step(name)
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            times[name] += time_calls(lambda n=name: step(n), 0, 1)
    close_all()
    return times


def main() -> None:
    from plait.runtime.launch import run_ranks

    ap = results_io.parser(__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hiddens", default="128,512")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    rows = []
    for hidden in map(int, args.hiddens.split(",")):
        times = run_ranks(2, _rank, args.tokens, hidden, args.rounds, timeout_s=1800)[0]
        med = {n: statistics.median(t) for n, t in times.items()}
        spread = {n: statistics.median(abs(v - med[n]) for v in t) for n, t in times.items()}
        base = med["pytorch"]
        rows.append({"hidden": hidden, "tokens": args.tokens, "median_step_s": med,
                     "spread_s": spread, "vs_pytorch": {n: med[n] / base - 1 for n in med}})
        print(f"hidden {hidden}, {args.tokens} tokens, 2 ranks, {args.rounds} rounds:")
        for n in VARIANTS:
            print(f"  {n:32s} {med[n] * 1e3:8.2f} ms +- {spread[n] * 1e3:5.2f}  "
                  f"({med[n] / base - 1:+.1%} vs PyTorch's TP)")
    results_io.write("tp_overhead.json", {
        "plait_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "rounds": args.rounds,
        "results": rows}, args.save)


if __name__ == "__main__":
    main()
