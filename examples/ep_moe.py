"""An expert-parallel MLP scheduled by plait: --experts local experts per rank, the all-to-all
dispatch and combine overlapped with the expert GEMMs.

    plait explore -m examples/tiny_moe.json --tp 1 --dp 2 --ep 2 --seq-len 256 \
        --json moe-plan.json
    torchrun --nproc-per-node 2 examples/ep_moe.py --plan moe-plan.json   # gloo on CPU

With --plan the experts are the plan's model's (hidden, expert FFN, experts per rank, top-k:
the shapes its schedules were chosen for; a plan for another group size is refused). Without
it both pairs use --schedule. Each rank routes its tokens to the top-k of the
ranks x experts experts with a fixed random router (softmax gates); `ExpertParallelMLP.routed`
packs the choices into each expert's rows (dropless by default: every rank pads to the largest
count; with --capacity, what overflows is dropped), runs the overlapped expert MLPs, and sums the
gated outputs per token. Prints the loss, the choices dropped, and which schedule and engine ran
per call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from plait.nn import ExpertParallelMLP
from plait.runtime.context import close_all, runtime_of
from plait.runtime.launch import init_from_env, leave_group, run_main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="a `plait explore --json` file")
    ap.add_argument("--schedule", default="fine/dma/c2/g1/M")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--experts", type=int, default=1, help="local experts per rank")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity", type=int, help="slots per expert and rank (default: dropless)")
    args = ap.parse_args()
    device = init_from_env()  # NCCL and this rank's GPU where there are GPUs, else gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    pick = {"plan": args.plan} if args.plan else {"schedule": args.schedule}
    if args.plan:  # the plan's model: the shapes its schedules were chosen for
        model = json.loads(Path(args.plan).read_text()).get("model", {})
        moe_spec = model.get("moe") or {}
        args.hidden = model.get("hidden", args.hidden)
        args.ffn = moe_spec.get("expert_ffn", args.ffn)
        args.experts = max(1, moe_spec.get("experts", world) // world)
        args.top_k = moe_spec.get("top_k", args.top_k)
    moe = ExpertParallelMLP(args.hidden, args.ffn, experts=args.experts, device=device, **pick)
    torch.manual_seed(0)  # the same router everywhere
    router = torch.randn(args.hidden, world * args.experts, device=device)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)

    gates, experts = (x @ router).softmax(-1).topk(args.top_k, dim=-1)
    # all-to-all dispatch -> FC1, expert MLPs, FC2 -> all-to-all combine, gated sum per token
    y, dropped = moe.routed(x, experts, gates, capacity=args.capacity)
    loss = (x + y).square().mean()
    loss.backward()
    total = torch.stack([loss.detach(), torch.tensor(float(dropped), device=device)])
    dist.all_reduce(total)
    if rank == 0:
        print(f"loss {float(total[0]) / world:.6f}; choices dropped {int(total[1])}; rows sent "
              f"x{moe.capacity_factor:.2f} of balanced routing (plait explore "
              f"--capacity-factor); grad norms fc1 {moe.fc1.grad.norm():.4f} "
              f"fc2 {moe.fc2.grad.norm():.4f}")
        print("\n".join(f"  {r}" for r in runtime_of(None).records))
    close_all()
    leave_group()


if __name__ == "__main__":
    run_main(main)
