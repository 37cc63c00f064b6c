"""An expert-parallel MLP scheduled by plait: --experts local experts per rank, the all-to-all
dispatch and combine overlapped with the expert GEMMs.

    plait explore -m mixtral-8x7b --tp 1 --dp 8 --ep 8 -H h100 --json moe-plan.json
    torchrun --nproc-per-node 2 examples/ep_moe.py --plan moe-plan.json   # gloo on CPU

Without --plan both pairs use --schedule. Each rank routes its tokens top-1 to one of the
ranks x experts experts with a fixed random router, packs them into equal-capacity groups by
destination rank and expert (dropping what overflows, as capacity-factor MoE does), runs the
expert MLPs, and scatters the results back to the tokens. Prints the loss, the tokens dropped,
and which schedule and engine ran per call.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from plait.nn import ExpertParallelMLP
from plait.runtime.context import close_all, runtime_for
from plait.runtime.launch import init_from_env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="a `plait explore --json` file")
    ap.add_argument("--schedule", default="fine/dma/c2/g1/M")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--experts", type=int, default=1, help="local experts per rank")
    ap.add_argument("--capacity", type=float, default=1.5, help="capacity factor")
    args = ap.parse_args()
    device = init_from_env()  # NCCL and this rank's GPU where there are GPUs, else gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    pick = {"plan": args.plan} if args.plan else {"schedule": args.schedule}
    moe = ExpertParallelMLP(args.hidden, args.ffn, experts=args.experts, device=device, **pick)
    n = world * args.experts  # experts in all; expert i lives on rank i // args.experts
    torch.manual_seed(0)  # the same router everywhere
    router = torch.randn(args.hidden, n, device=device)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)

    # Top-1 routing into equal-capacity groups, one per expert, ordered by rank then local
    # expert (a multiple of 2 rows each, so the schedules' sub-chunks split them).
    cap = 2 * -(-int(args.capacity * args.tokens / n) // 2)
    expert = (x.detach() @ router).argmax(-1)
    slots = torch.full((n * cap,), -1, dtype=torch.long, device=device)
    for i in range(n):
        mine = (expert == i).nonzero().flatten()[:cap]
        slots[i * cap:i * cap + len(mine)] = mine
    kept = slots >= 0
    packed = torch.zeros(n * cap, args.hidden, device=device)
    packed = packed.index_put((kept.nonzero().flatten(),), x[slots[kept]])

    out = moe(packed)  # dispatch (all-to-all -> FC1), expert MLP, combine (FC2 -> all-to-all)
    y = torch.zeros_like(x).index_put((slots[kept],), out[kept])
    loss = (x + y).square().mean()
    loss.backward()
    total = torch.stack([loss.detach(), (~kept).sum().float() - (n * cap - args.tokens)])
    dist.all_reduce(total)
    if rank == 0:
        print(f"loss {float(total[0]) / world:.6f}; tokens dropped {int(total[1])}; grad norms "
              f"fc1 {moe.fc1.grad.norm():.4f} fc2 {moe.fc2.grad.norm():.4f}")
        print("\n".join(f"  {r}" for r in runtime_for(None).records))
    close_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
