"""Benchmark: `schedule="auto"` against every fixed schedule, in training steps.

    python bench/auto_tune.py            # 2 and 4 gloo ranks; writes out/auto_tune.json
    python bench/auto_tune.py --save     # the committed bench/results/auto_tune.json

A sequence-parallel MLP (plait.nn.SequenceParallelMLP: all-gather -> FC1, FC2 ->
reduce-scatter, forward and backward) trains on local gloo ranks, once per variant: each
fixed schedule, and "auto". "auto" first tunes (its first steps, timed as they come: the
tuning overhead is their time beyond as many steady steps), then every variant runs in
interleaved rounds (one step of each per round, every step started together on all ranks,
its slowest rank counted) and the median step counts. Then the same with every copy-engine
(`/dma`) candidate charged `--delay` seconds a timed call in auto's measurements (the tuner's
injected `penalty`, as a slow copy engine would cost): auto must avoid them, and is compared
with the best fixed schedule that is not held back.

Goal (issue 28): auto's steady step within 5% of the best fixed schedule, never worse than
seq/sm beyond noise (the spread of the rounds).
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

import results_io
from plait import __version__

FIXED = ("seq/sm", "seq/dma", "p2p/sm/M", "p2p/dma/M", "fine/sm/c2/g1/M", "fine/dma/c2/g1/M")


def _rank(rank: int, world: int, args: Any, slowed: bool) -> dict[str, Any]:
    from plait import tuning
    from plait.nn import SequenceParallelMLP
    from plait.runtime.context import close_all
    from plait.runtime.timing import time_calls

    torch.set_num_threads(1)
    tuning.configure(cache=False, calls=args.calls,
                     penalty=(lambda s: args.delay * _held_back(s)) if slowed else None)
    x = torch.randn(args.tokens // world, args.hidden, requires_grad=True)
    mlps = {}
    for name in (*FIXED, "auto"):
        torch.manual_seed(0)  # the same weights for every variant
        mlps[name] = SequenceParallelMLP(args.hidden, args.ffn, schedule=name)

    def step(name: str) -> None:
        mlps[name](x).square().mean().backward()

    for name in FIXED:  # warm: engines, buffers, threads
        step(name)
    tuner = tuning.tuner()
    tuning_steps: list[float] = []
    while len(tuning_steps) < 50:
        before = tuner.measurement_calls
        tuning_steps += time_calls(lambda: step("auto"), 0, 1)
        if tuner.measurement_calls == before:  # a step that measured nothing: tuned
            break
    times: dict[str, list[float]] = {name: [] for name in mlps}
    for _ in range(args.rounds):
        for name in mlps:
            times[name] += time_calls(lambda n=name: step(n), 0, 1)
    choices = sorted({d.choice for _, d in tuner.log})
    close_all()
    return {"times_s": times, "tuning_steps_s": tuning_steps, "auto_choices": choices,
            "measurement_calls": tuner.measurement_calls}


def _held_back(schedule: str) -> bool:
    return schedule.split("/")[1:2] == ["dma"]


def run(world: int, args: Any, slowed: bool) -> dict[str, Any]:
    from plait.runtime.launch import run_ranks

    out = run_ranks(world, _rank, args, slowed, timeout_s=1800)[0]
    med = {name: statistics.median(t) for name, t in out["times_s"].items()}
    spread = {name: statistics.median(abs(v - med[name]) for v in t)
              for name, t in out["times_s"].items()}
    best = min((n for n in FIXED if not (slowed and _held_back(n))), key=lambda n: med[n])
    steady = med["auto"]
    overhead = sum(out["tuning_steps_s"]) - len(out["tuning_steps_s"]) * steady
    row = {"world": world, "slowed": "every /dma candidate" if slowed else None,
           "median_step_s": med, "spread_s": spread, "best_fixed": best,
           "auto_vs_best": steady / med[best] - 1, "auto_vs_seq_sm": steady / med["seq/sm"] - 1,
           "auto_choices": out["auto_choices"], "tuning_steps": len(out["tuning_steps_s"]),
           "tuning_overhead_s": overhead, "measurement_calls": out["measurement_calls"]}
    print(f"\n{world} ranks{' (every /dma candidate held back)' if slowed else ''}: median step, "
          f"{args.rounds} interleaved rounds")
    for name in (*FIXED, "auto"):
        print(f"  {name:18s} {med[name] * 1e3:8.2f} ms  +- {spread[name] * 1e3:5.2f}")
    print(f"  auto vs best fixed ({best}): {row['auto_vs_best']:+.1%}; vs seq/sm: "
          f"{row['auto_vs_seq_sm']:+.1%}; auto ran {', '.join(out['auto_choices'])}")
    print(f"  tuning: {row['tuning_steps']} steps, {out['measurement_calls']} measurement "
          f"calls, {overhead * 1e3:.1f} ms beyond as many steady steps")
    return row


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per candidate")
    ap.add_argument("--delay", type=float, default=0.02,
                    help="seconds charged to a held-back candidate's timed call")
    args = ap.parse_args()
    os.environ["PLAIT_TUNING_CACHE"] = "off"
    rows = [run(int(w), args, slowed) for w in args.worlds.split(",")
            for slowed in (False, True)]
    results_io.write("auto_tune.json", {
        "plait_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "model": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn},
        "rounds": args.rounds, "calls": args.calls, "delay_s": args.delay, "results": rows},
        args.save)


if __name__ == "__main__":
    main()
