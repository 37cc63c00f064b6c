"""Step time of a pipelined model on 4 local gloo ranks, PP=2 x TP=2: PyTorch's 1F1B, its
DualPipeV as it runs by default (each OVERLAP_F_B a forward then a backward), and DualPipeV
with plait's OVERLAP_F_B (`plait.pipelining`); predicted beside measured.

    python bench/pipeline_step.py                 # writes out/pipeline_step.json
    python bench/pipeline_step.py --save          # updates bench/results/pipeline_step.json

The model: `--blocks` residual MLP blocks of plait's parallel linears (hidden `--hidden`, FFN
`--ffn`, sequence-parallel over TP); 1F1B puts half of them on each pipeline rank, DualPipeV a
quarter on each of its four stages (rank r: stages r and 3-r). The prediction is plait's
pipeline simulation (`plait.sim.pipeline`) of each schedule's action lists from the measured
forward and backward of one chunk alone (median over the repeats), with no transfer cost;
the overlapped OVERLAP_F_B is predicted as long as the longer of its two halves (what a
perfect overlap would give): the measured figure says how much of that this machine gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from plait.runtime.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV

    from plait.nn import ColumnParallelLinear, RowParallelLinear
    from plait.pipelining import overlap_f_b

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp_group, pp_group = (mesh["pp"].get_local_rank(), mesh["tp"].get_group(),
                              mesh["pp"].get_group())
    h, f, tokens, mb = args.hidden, args.ffn, args.tokens, args.micro_batches

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = ColumnParallelLinear(h, f, tp_group, schedule=args.schedule)
            self.fc2 = RowParallelLinear(f, h, tp_group, schedule=args.schedule)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    def chunk(n: int) -> torch.nn.Module:
        return torch.nn.Sequential(*[Block() for _ in range(n)])

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    x = torch.randn(mb * tokens // 2, h)  # this TP rank's sequence shards, micro-batch-major
    y = torch.randn(mb * tokens // 2, h)

    def build(kind: str) -> tuple[object, list[torch.nn.Module]]:
        if kind == "1F1B":
            mods = [chunk(args.blocks // 2)]
            stages = [PipelineStage(mods[0], pp, 2, torch.device("cpu"), group=pp_group)]
            return Schedule1F1B(stages[0], n_microbatches=mb, loss_fn=loss_fn), mods
        mods = [chunk(args.blocks // 4) for _ in range(2)]
        stages = [PipelineStage(m, s, 4, torch.device("cpu"), group=pp_group)
                  for m, s in zip(mods, (pp, 3 - pp), strict=True)]
        sched = ScheduleDualPipeV(stages, n_microbatches=mb, loss_fn=loss_fn)
        if kind == "DualPipeV + plait":
            overlap_f_b(sched)
        return sched, mods

    def step(sched: object, first: bool) -> None:
        if first:
            sched.step(x, target=y)  # type: ignore[attr-defined]
        else:
            sched.step()  # type: ignore[attr-defined]

    out: dict[str, object] = {}
    for kind in ("1F1B", "DualPipeV", "DualPipeV + plait"):
        sched, _ = build(kind)
        first = pp == 0  # 1F1B: stage 0 and the loss on different ranks; V: both on rank 0
        times = []
        for i in range(args.warmup + args.repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if kind == "1F1B":
                if pp == 0:
                    sched.step(x)  # type: ignore[attr-defined]
                else:
                    sched.step(target=y)  # type: ignore[attr-defined]
            else:
                step(sched, first)
            torch.distributed.barrier()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        out[kind] = statistics.median(times)
    # one chunk (a quarter of the blocks) alone: forward, and forward + backward
    m = chunk(args.blocks // 4)
    xi = torch.randn(tokens // 2, h, requires_grad=True)
    fwd, both = [], []
    for i in range(args.warmup + args.repeats):
        torch.distributed.barrier(group=tp_group)
        t0 = time.perf_counter()
        o = m(xi)
        t1 = time.perf_counter()
        o.square().mean().backward()
        t2 = time.perf_counter()
        if i >= args.warmup:
            fwd.append(t1 - t0)
            both.append(t2 - t0)
    out["chunk_forward_s"] = statistics.median(fwd)
    out["chunk_backward_s"] = statistics.median(both) - statistics.median(fwd)
    return out


def predict(f: float, b: float, mb: int) -> dict[str, float]:
    from plait.sim.pipeline import Costs, dualpipe_v, one_f_one_b, simulate

    one = simulate(one_f_one_b(2, mb), Costs(lambda s: 2 * f, lambda s: 2 * b, lambda s: 0.0))
    v = dualpipe_v(2, mb)
    plain = simulate(v, Costs(lambda s: f, lambda s: b, lambda s: 0.0))
    overlapped = simulate(v, Costs(lambda s: f, lambda s: b, lambda s: 0.0,
                                   fb=lambda a, c: max(f, b)))
    return {"1F1B": one.step_s, "DualPipeV": plain.step_s,
            "DualPipeV + plait": overlapped.step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256, help="per micro-batch, whole sequence")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedule", default="fine/sm/c2/g1/M")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    if args.blocks % 4:
        sys.exit("--blocks: use a multiple of 4 (DualPipeV's four stages)")
    ranks = run_ranks(4, _rank, args, timeout_s=900)
    measured = {k: max(float(r[k]) for r in ranks)  # type: ignore[arg-type]
                for k in ("1F1B", "DualPipeV", "DualPipeV + plait")}
    f = statistics.median(float(r["chunk_forward_s"]) for r in ranks)  # type: ignore[arg-type]
    b = statistics.median(float(r["chunk_backward_s"]) for r in ranks)  # type: ignore[arg-type]
    predicted = predict(f, b, args.micro_batches)
    result = {"command": "python bench/pipeline_step.py" + (" --save" if args.save else ""),
              "layout": "4 gloo ranks, PP=2 x TP=2", "args": {
                  k: v for k, v in vars(args).items() if k != "save"},
              "chunk_forward_s": f, "chunk_backward_s": b,
              "step_s": {k: {"measured": measured[k], "predicted": predicted[k]}
                         for k in measured}}
    print(f"chunk ({args.blocks // 4} blocks) alone: forward {f * 1e3:.2f} ms, backward "
          f"{b * 1e3:.2f} ms")
    for k in measured:
        print(f"{k:>18}: measured {measured[k] * 1e3:8.1f} ms   predicted "
              f"{predicted[k] * 1e3:8.1f} ms")
    path = (ROOT / "bench/results" if args.save else ROOT / "out") / "pipeline_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
