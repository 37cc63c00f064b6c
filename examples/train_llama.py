"""Train a small Hugging Face Llama with plait's overlap: tensor x data parallel, TP x FSDP2.

    pip install transformers                                   # (plait's `dev` extra has it)
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --steps 300 --out out/llama

    # schedules per pair for this model and group, then trained with them:
    plait explore -m examples/tiny_llama.json --tp 2 --seq-len 64 -H h100 --json plan.json
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --plan plan.json

The model is `--config` (default `examples/tiny_llama.json`: 2 layers, hidden 64, 4 heads of
which 2 KV). A 2-d mesh (`dp` x `tp`): it is parallelized with one `parallelize_module` call from
`plait.parallel.llama_plan` (sequence-parallel TP whose all-gather -> GEMM and GEMM ->
reduce-scatter pairs are plait's overlapped ops, under `--schedule` or a `--plan` from
`plait explore --json`), then sharded with FSDP2 (`fully_shard`) over `dp`. The same model is
trained beside it without plait (PyTorch's own ColwiseParallel / RowwiseParallel, as
torchtitan lays out a Llama), from the same initialization on the same data: a byte-level
language model on Python's reference topics (`pydoc_data`), under bf16 autocast by default.

It checks and writes to `--out` (`result.json`, `loss.png`):
- the loss curves of plait and plain, and their largest difference;
- the first step's gradients of both against the unsharded model on the whole batch, one
  process, no parallelism (every parameter, gathered from its shards);
- a checkpoint (`torch.distributed.checkpoint`, model and optimizer) saved mid-run and
  resumed in a fresh model: the continuation's losses against the uninterrupted run's;
- step time per schedule (`--time-schedules`), plait against plain.
Exits 1 if a check misses its tolerance (per dtype: `--dtype bf16|fp32`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from plait.parallel import llama_plan
from plait.runtime.launch import init_from_env, leave_group, run_main
from plait.schedule.schedule import Schedule

# Tolerances per dtype. grad: the first step's gradients against the unsharded model (largest
# difference relative to each gradient's largest entry); resume: the resumed run's losses
# against the uninterrupted one's. loss: plait's loss curve against plain's, step by step over
# the first `early` steps. Two runs whose sums are ordered differently (plait's reduce-scatter
# and PyTorch's) drift apart as training amplifies the last bits (in fp32 ~1e-6 at step 50,
# ~1e-4 at 250, ~5e-3 at 300; in bf16 sooner, and a loss spike in one run need not come in the
# other), so after those steps the check is on the median of the last `late` steps (`late_loss`).
TOLERANCE = {"fp32": {"grad": 1e-5, "loss": 1e-4, "early": 100, "late": 50, "late_loss": 1e-2,
                      "resume": 1e-6},
             "bf16": {"grad": 2e-2, "loss": 2e-2, "early": 20, "late": 50, "late_loss": 5e-2,
                      "resume": 1e-6}}
CONFIG = Path(__file__).with_name("tiny_llama.json")


def config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_json_file(str(args.config))
    cfg._attn_implementation = "sdpa"
    return cfg


def plain_plan() -> dict[str, Any]:
    """torchtitan's Llama layout with PyTorch's own styles (Hugging Face module names)."""
    layer = "model.layers.*"
    gathered = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1), use_local_output=False),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **{f"{layer}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1),
                                                     use_local_output=False),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": PrepareModuleInput(**gathered),
        **{f"{layer}.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1),
                                                  use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    }


def build(args: argparse.Namespace, mesh: DeviceMesh | None, how: str,
          schedule: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model from one seed, parallelized `how` ("plait", "plain"; no mesh: unsharded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config(args))
    if mesh is not None:
        tp_plan = (llama_plan(plan=args.plan) if how == "plait" and args.plan else
                   llama_plan(schedule=schedule) if how == "plait" else plain_plan())
        parallelize_module(model, mesh["tp"], tp_plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def corpus() -> torch.Tensor:
    """The text: Python's own reference topics (`pydoc_data`, shipped with every CPython: the
    same bytes for a given Python version, whatever this repository's docs say today)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics)).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(args: argparse.Namespace, dp: int, data: torch.Tensor) -> Iterator[torch.Tensor]:
    """Step after step, `batch * dp` windows of `seq + 1` bytes of `data` (one seed)."""
    gen = torch.Generator().manual_seed(args.seed)
    while True:
        start = torch.randint(0, data.numel() - args.seq - 1, (args.batch * dp,), generator=gen)
        yield torch.stack([data[s:s + args.seq + 1] for s in start.tolist()])


def loss_of(model: nn.Module, tokens: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """Mean next-byte cross entropy of these windows, under the run's autocast. Call it, and
    the backward, inside `loss_parallel()` (a plain tensor's loss is the usual one there)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1])[None]
    with torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bf16"):
        logits = model(input_ids=inputs, position_ids=positions).logits
    # vocabulary-parallel logits (a DTensor): the loss over the shards, under loss_parallel
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor,
         args: argparse.Namespace) -> float:
    """One optimizer step on this rank's windows; the loss over the whole batch."""
    with loss_parallel():
        loss = loss_of(model, tokens, args)
        loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    value = value.detach().clone()
    dist.all_reduce(value, dist.ReduceOp.AVG)  # every rank's local mean: the batch's mean
    return float(value)


def rows(tokens: torch.Tensor, mesh: DeviceMesh, args: argparse.Namespace) -> torch.Tensor:
    """This data-parallel rank's windows of the global batch."""
    r = mesh["dp"].get_local_rank()
    return tokens[r * args.batch:(r + 1) * args.batch]


def train(model: nn.Module, optim: torch.optim.Optimizer, mesh: DeviceMesh,
          args: argparse.Namespace, steps: range, data: Iterator[torch.Tensor],
          at_step: Callable[[int], None] | None = None, label: str = "") -> list[float]:
    """The steps' losses; rank 0 logs each step (its loss and time) as it ends, at most
    every 10 s after the first few."""
    losses = []
    logged = 0.0
    for i in steps:
        if at_step is not None:
            at_step(i)
        t0 = time.perf_counter()
        losses.append(step(model, optim, rows(next(data), mesh, args), args))
        now = time.perf_counter()
        if dist.get_rank() == 0 and (i < 3 or now - logged >= 10 or i == steps[-1]):
            print(f"{label} step {i}: loss {losses[-1]:.4f}, {1e3 * (now - t0):.0f} ms",
                  flush=True)
            logged = now
    return losses


def first_grads(model: nn.Module, tokens: torch.Tensor, args: argparse.Namespace
                ) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the first step, whole (gathered from its shards)."""
    with loss_parallel():
        loss_of(model, tokens, args).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().float().clone()
    model.zero_grad(set_to_none=True)
    return out


def grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference over all gradients, relative to each one's largest entry."""
    worst, where = 0.0, ""
    for name, w in want.items():
        err = float((got[name] - w).abs().max() / w.abs().max().clamp_min(1e-12))
        if err > worst:
            worst, where = err, name
    return worst, where


def timed(args: argparse.Namespace, mesh: DeviceMesh, runs: dict[str, tuple[str, str]],
          data: torch.Tensor) -> dict[str, float]:
    """Median step time (ms) of each run (name -> (how, schedule)): all built first, then
    measured round-robin, one step of each per round (the machine's drift is shared), over
    `--time-steps` rounds after two untimed ones."""
    built = {name: build(args, mesh, how, s) for name, (how, s) in runs.items()}
    feed = batches(args, mesh["dp"].size(), data)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(2 + args.time_steps):
        tokens = rows(next(feed), mesh, args)
        for name, (model, optim) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(model, optim, tokens, args)
            if i >= 2:
                times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_ylabel("loss (cross entropy, nats/byte)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.legend()
    a, b = curves.values()
    dx.plot(range(1, len(a) + 1), [x - y for x, y in zip(a, b, strict=True)], linewidth=1)
    dx.set_ylabel("plait - plain (nats/byte)")
    dx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--resume-at", type=int, help="checkpoint here, resume (default: half)")
    ap.add_argument("--schedule", default="fine/sm/c2/peer/M")
    ap.add_argument("--plan", help="a `plait explore --json` file (else --schedule)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--config", type=Path, default=CONFIG,
                    help="the model: a Hugging Face Llama config.json")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="windows per data-parallel rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-schedules", default="seq/sm,p2p/sm/M,fine/sm/c2/peer/M",
                    help="comma-separated; empty: no timing")
    ap.add_argument("--time-steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("out/train_llama"))
    args = ap.parse_args()
    for s in [x for x in args.time_schedules.split(",") if x]:
        Schedule.parse(s)  # a bad one is refused now, not after the training runs
    init_from_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        raise SystemExit(f"--tp: {args.tp} does not divide the {world} ranks")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].size()
    tol = TOLERANCE[args.dtype]
    resume_at = args.resume_at or args.steps // 2
    result: dict[str, Any] = {"world": world, "mesh": {"dp": dp, "tp": args.tp},
                              "dtype": args.dtype, "schedule": args.plan or args.schedule,
                              "steps": args.steps, "tolerance": tol}

    # gradients of the first step: plait and plain against the unsharded model
    text = corpus()
    tokens = next(batches(args, dp, text))
    reference = first_grads(build(args, None, "", "")[0], tokens, args)
    for how in ("plait", "plain"):
        model, _ = build(args, mesh, how, args.schedule)
        err, where = grad_error(first_grads(model, rows(tokens, mesh, args), args), reference)
        result[f"grad_error_{how}"] = {"max_relative": err, "parameter": where,
                                       "parameters": len(reference)}

    # training, plait and plain, same data; plait checkpoints at `resume_at`
    folder = Path(tempfile.mkdtemp()) if rank == 0 else None
    shared = [str(folder)]
    dist.broadcast_object_list(shared)
    checkpoint = Path(shared[0]) / "step"
    curves: dict[str, list[float]] = {}
    for how in ("plait", "plain"):
        model, optim = build(args, mesh, how, args.schedule)

        def save(i: int, model: nn.Module = model, optim: Any = optim) -> None:
            if i == resume_at:
                sd_model, sd_optim = get_state_dict(model, optim)
                dcp.save({"model": sd_model, "optim": sd_optim}, checkpoint_id=str(checkpoint))

        curves[how] = train(model, optim, mesh, args, range(args.steps), batches(args, dp, text),
                            save if how == "plait" else None, label=how)
    # resume: a fresh model and optimizer from the checkpoint, the same data from there on
    model, optim = build(args, mesh, "plait", args.schedule)
    sd_model, sd_optim = get_state_dict(model, optim)
    state = {"model": sd_model, "optim": sd_optim}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    data = batches(args, dp, text)
    for _ in range(resume_at):
        next(data)
    resumed = train(model, optim, mesh, args, range(resume_at, args.steps), data)
    tail = curves["plait"][resume_at:]
    result["resume"] = {"at": resume_at, "max_difference": max(
        (abs(a - b) for a, b in zip(resumed, tail, strict=True)), default=0.0)}
    result["loss"] = {how: {"first": c[0], "last": c[-1]} for how, c in curves.items()}
    diffs = [abs(a - b) for a, b in zip(curves["plait"], curves["plain"], strict=True)]
    late = min(tol["late"], len(diffs))
    result["loss_max_difference"] = max(diffs)
    result["loss_max_difference_early"] = max(diffs[:tol["early"]])
    result["loss_late_median_difference"] = (abs(statistics.median(curves["plait"][-late:])
                                                 - statistics.median(curves["plain"][-late:]))
                                             if late else 0.0)
    result["curves"] = curves

    # step time per schedule
    runs = {f"plait {s}": ("plait", s) for s in args.time_schedules.split(",") if s}
    if runs:
        runs["plain (PyTorch styles)"] = ("plain", "")
    times = timed(args, mesh, runs, text) if runs else {}
    result["step_ms"] = times

    checks = {"gradients (plait)": result["grad_error_plait"]["max_relative"] <= tol["grad"],
              "gradients (plain)": result["grad_error_plain"]["max_relative"] <= tol["grad"],
              "loss curves": result["loss_max_difference_early"] <= tol["loss"]
              and result["loss_late_median_difference"] <= tol["late_loss"],
              "resume": result["resume"]["max_difference"] <= tol["resume"]}
    result["checks"] = checks
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(curves, args.out / "loss.png",
             f"HF Llama {args.config.name}, {world} CPU ranks "
             f"dp={dp} x tp={args.tp} (TP x FSDP2), {args.dtype} autocast; plait: "
             f"{args.plan or args.schedule}; plain: PyTorch's TP styles")
        for key in ("grad_error_plait", "grad_error_plain"):
            e = result[key]
            print(f"{key}: {e['max_relative']:.2e} ({e['parameter']}, of {e['parameters']})")
        print(f"loss: plait {curves['plait'][0]:.4f} -> {curves['plait'][-1]:.4f}, plain "
              f"{curves['plain'][0]:.4f} -> {curves['plain'][-1]:.4f}; largest difference "
              f"{result['loss_max_difference']:.2e} (first {min(tol['early'], args.steps)} "
              f"steps {result['loss_max_difference_early']:.2e}"
              + (f", median of the last {late} {result['loss_late_median_difference']:.2e})"
                 if late else ")"))
        print(f"resume at step {resume_at}: largest difference "
              f"{result['resume']['max_difference']:.2e}")
        for name, ms in times.items():
            print(f"step {name}: {ms:.1f} ms")
        print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
        print(f"wrote {args.out / 'result.json'} and {args.out / 'loss.png'}")
    leave_group()
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    run_main(main)
