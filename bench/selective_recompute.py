"""Selective against full recomputation on Megatron-LM's stack, as `plait plan` predicts them
for GPT-3-style models of 22B, 175B and 530B parameters (the shapes of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", MLSys'23: 48/96/105 layers,
hidden 6144/12288/20480, 64/96/128 heads, sequence 2048, TP 8 with sequence parallelism, PP
1/8/35, 1F1B) on A100s. The ratio comes from the mechanism (selective recomputes the fused
attention kernel's forward, full the whole forward), fitted to nothing; beside it the paper's
one published end-to-end figure: the 530B model on 2,240 A100s at 54.2% MFU with selective
recomputation and sequence parallelism against 42.1% with full recomputation, a step ratio
of 0.777 (the paper's attention kernel was not fused, so its selective recomputation did
more than a fused kernel's forward).

    python bench/selective_recompute.py [--save]
"""

from __future__ import annotations

import results_io
from plait.planner.plan.space import Layout
from plait.planner.plan.step import Job
from plait.spec.hardware import load_hardware
from plait.spec.model import ModelSpec

MODELS = {  # name: (layers, hidden, heads, pp)
    "gpt3-22b": (48, 6144, 64, 1),
    "gpt3-175b": (96, 12288, 96, 8),
    "gpt3-530b": (105, 20480, 128, 35),
}
PUBLISHED_530B = 42.1 / 54.2  # full over selective MFU = selective over full step


def ratios() -> dict[str, dict[str, float]]:
    cluster = load_hardware("a100")
    out = {}
    for name, (layers, hidden, heads, pp) in MODELS.items():
        model = ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                          ffn=4 * hidden, vocab=51200, gated_mlp=False)
        tp, m = 8, 4 * pp
        job = Job(model, cluster, tp * pp, 2048, m, cluster.gpu.memory_bytes)
        steps = {}
        for ac in ("none", "selective", "full"):
            lay = Layout(tp=tp, pp=pp, micro_batches=m, ac=ac,  # type: ignore[arg-type]
                         schedule="1F1B" if pp > 1 else "none")
            p = job.predict(lay, ("plain",))
            steps[ac] = p.step_s
            steps[f"{ac}_gib"] = p.memory.total / 2**30
        out[name] = steps | {"selective_over_full": steps["selective"] / steps["full"],
                             "selective_over_none": steps["selective"] / steps["none"]}
    return out


def main() -> None:
    args = results_io.parser(__doc__).parse_args()
    got = ratios()
    print("model       selective/full  selective/none  GiB none / selective / full")
    for name, r in got.items():
        print(f"{name:11s} {r['selective_over_full']:14.3f} {r['selective_over_none']:15.3f}  "
              f"{r['none_gib']:.0f} / {r['selective_gib']:.0f} / {r['full_gib']:.0f}")
    print(f"published (530B, 2,240 A100s, unfused attention): {PUBLISHED_530B:.3f}")
    results_io.write("selective_recompute.json",
                     {"published_530b": PUBLISHED_530B, "models": got}, args.save)


if __name__ == "__main__":
    main()
