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
Peak activations: the bytes autograd holds for backward (saved tensors, counted from save to
free), the fullest rank's, measured on the step after warm-up; predicted as the simulation's
most chunks held at once times one chunk's saved bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

from plait.runtime.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]


class SavedBytes:
    """The bytes autograd holds for backward (saved activations), now and at the peak: each
    saved tensor counted from when the forward saves it until autograd frees it."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> object:
            box = _Saved(t)
            n = t.untyped_storage().nbytes() if t.layout == torch.strided else 0
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(box, self._free, n)
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def _free(self, n: int) -> None:
        self.now -= n


class _Saved:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


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

    def run_step(kind: str, sched: object, first: bool) -> None:
        if kind == "1F1B" and pp == 0:  # 1F1B: stage 0 and the loss's stage apart
            sched.step(x)  # type: ignore[attr-defined]
        elif kind == "1F1B":
            sched.step(target=y)  # type: ignore[attr-defined]
        elif first:  # DualPipeV: the first and the last stage on rank 0
            sched.step(x, target=y)  # type: ignore[attr-defined]
        else:
            sched.step()  # type: ignore[attr-defined]

    out: dict[str, object] = {}
    for kind in ("1F1B", "DualPipeV", "DualPipeV + plait"):
        sched, _ = build(kind)
        first = pp == 0  # 1F1B: stage 0 and the loss on different ranks; V: both on rank 0
        times = []
        meter = SavedBytes()
        for i in range(args.warmup + args.repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ctx = meter.hooks() if i == args.warmup - 1 else contextlib.nullcontext()
            with ctx:
                run_step(kind, sched, first)
            torch.distributed.barrier()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        out[kind] = statistics.median(times)
        out[f"{kind} peak saved bytes"] = meter.peak

    # one chunk (a quarter of the blocks) alone: forward, and forward + backward
    m = chunk(args.blocks // 4)
    xi = torch.randn(tokens // 2, h, requires_grad=True)
    fwd, both = [], []
    meter = SavedBytes()
    with meter.hooks():
        m(xi).square().mean().backward()
    out["chunk_saved_bytes"] = meter.peak
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


def predict(f: float, b: float, mb: int) -> dict[str, tuple[float, int]]:
    """Per schedule: the simulated step and the most quarter-model chunks of one
    micro-batch any rank holds at once."""
    from plait.sim.pipeline import Costs, dualpipe_v, one_f_one_b, simulate

    one = simulate(one_f_one_b(2, mb), Costs(lambda s: 2 * f, lambda s: 2 * b, lambda s: 0.0))
    v = dualpipe_v(2, mb)
    plain = simulate(v, Costs(lambda s: f, lambda s: b, lambda s: 0.0))
    overlapped = simulate(v, Costs(lambda s: f, lambda s: b, lambda s: 0.0,
                                   fb=lambda a, c: max(f, b)))
    return {"1F1B": (one.step_s, 2 * max(one.peak_activations)),  # its stages: 2 chunks
            "DualPipeV": (plain.step_s, max(plain.peak_activations)),
            "DualPipeV + plait": (overlapped.step_s, max(overlapped.peak_activations))}


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
    kinds = ("1F1B", "DualPipeV", "DualPipeV + plait")
    measured = {k: max(float(r[k]) for r in ranks) for k in kinds}  # type: ignore[arg-type]
    peak = {k: max(int(r[f"{k} peak saved bytes"]) for r in ranks)  # type: ignore[call-overload]
            for k in kinds}
    f = statistics.median(float(r["chunk_forward_s"]) for r in ranks)  # type: ignore[arg-type]
    b = statistics.median(float(r["chunk_backward_s"]) for r in ranks)  # type: ignore[arg-type]
    chunk = max(int(r["chunk_saved_bytes"]) for r in ranks)  # type: ignore[call-overload]
    predicted = predict(f, b, args.micro_batches)
    result = {"command": "python bench/pipeline_step.py" + (" --save" if args.save else ""),
              "layout": "4 gloo ranks, PP=2 x TP=2", "args": {
                  k: v for k, v in vars(args).items() if k != "save"},
              "chunk_forward_s": f, "chunk_backward_s": b, "chunk_saved_bytes": chunk,
              "step_s": {k: {"measured": measured[k], "predicted": predicted[k][0]}
                         for k in kinds},
              "peak_saved_bytes": {k: {"measured": peak[k],
                                       "predicted": predicted[k][1] * chunk} for k in kinds}}
    print(f"chunk ({args.blocks // 4} blocks) alone: forward {f * 1e3:.2f} ms, backward "
          f"{b * 1e3:.2f} ms, saves {chunk / 2**20:.2f} MiB for backward")
    for k in kinds:
        print(f"{k:>18}: step measured {measured[k] * 1e3:7.1f} ms, predicted "
              f"{predicted[k][0] * 1e3:7.1f} ms; peak activations measured "
              f"{peak[k] / 2**20:6.2f} MiB, predicted {predicted[k][1] * chunk / 2**20:6.2f} MiB")
    path = (ROOT / "bench/results" if args.save else ROOT / "out") / "pipeline_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
