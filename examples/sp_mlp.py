"""A sequence-parallel MLP block scheduled by plait: the drop-in way to run a plan.

    plait explore -m examples/tiny_llama.json --tp 2 --seq-len 256 --json plan.json  # pick
    torchrun --nproc-per-node 2 examples/sp_mlp.py --plan plan.json  # run them (gloo on CPU)

With --plan the MLP is the plan's model's (hidden, FFN, gated or not: its shapes are those the
schedules were chosen for; a plan for another group size or model is refused). Without it,
every pair uses --schedule on --hidden and --ffn. Each rank holds its sequence shard of the
input; the column-parallel FC1 all-gathers it, the row-parallel FC2 reduce-scatters back to
the shards, each overlapped as its schedule says. Prints the loss, and which schedule and
engine ran per call.

With --profile DIR, --steps steps run under torch.profiler and every rank writes
DIR/rank<r>.json, which `plait analyze DIR/rank0.json` reads: measured exposed communication,
e.g. `--schedule seq/sm` (the plain way) against an overlapped schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from plait.nn import SequenceParallelMLP
from plait.runtime.context import close_all, runtime_of
from plait.runtime.launch import init_from_env, leave_group, run_main
from plait.tracing import every_thread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="a `plait explore --json` file")
    ap.add_argument("--schedule", default="fine/dma/c2/g1/M")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--profile", type=Path, help="write torch.profiler traces to this folder")
    args = ap.parse_args()
    device = init_from_env()  # NCCL and this rank's GPU where there are GPUs, else gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    pick = {"plan": args.plan} if args.plan else {"schedule": args.schedule}
    gated = False
    if args.plan:  # the plan's model: the shapes its schedules were chosen for
        model = json.loads(Path(args.plan).read_text()).get("model", {})
        args.hidden, args.ffn = model.get("hidden", args.hidden), model.get("ffn", args.ffn)
        gated = bool(model.get("gated_mlp"))
    torch.manual_seed(1000 + rank)  # reproducible weights and inputs, run to run
    mlp = SequenceParallelMLP(args.hidden, args.ffn, gated=gated, device=device, **pick)
    fc1, fc2 = mlp.fc1, mlp.fc2
    x = torch.randn(args.tokens // world, args.hidden, device=device, requires_grad=True)

    def step() -> torch.Tensor:
        y = mlp(x)  # all-gather -> GEMM, activation, GEMM -> reduce-scatter
        loss = y.square().mean()
        loss.backward()
        return loss

    if args.profile:  # one untimed step first: buffers, threads and caches set up
        step()
        for t in (x, fc1.weight, fc2.weight):
            t.grad = None
        runtime_of(None).records.clear()
    # every thread: the peer-copy engine's copier thread (the CPU's stand-in DMA engine) too
    prof = (torch.profiler.profile(record_shapes=True, experimental_config=every_thread())
            if args.profile else contextlib.nullcontext())
    with prof:
        for i in range(args.steps):
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                loss = step()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.profile / f"rank{rank}.json"))
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"loss {float(total) / world:.6f}; grad norms fc1 {fc1.weight.grad.norm():.4f} "
              f"fc2 {fc2.weight.grad.norm():.4f}")
        print("\n".join(f"  {r}" for r in runtime_of(None).records))
    close_all()
    leave_group()


if __name__ == "__main__":
    run_main(main)
