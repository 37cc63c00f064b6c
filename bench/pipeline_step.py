"""Step time and activation memory of a pipelined model on 4 local gloo ranks, PP=2 x TP=2:
PyTorch's 1F1B, its DualPipeV as it runs by default (each OVERLAP_F_B a forward then a
backward), and DualPipeV with plait's OVERLAP_F_B (`plait.pipelining`: the strands free, and
from a plan of the timed units); predicted beside
measured (`plait.measure.pipeline` says how; `plait coexec run --pp 2 --ranks 4` is the same
measurement from the CLI).

    python bench/pipeline_step.py                 # writes out/pipeline_step.json
    python bench/pipeline_step.py --save          # updates bench/results/pipeline_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from plait.measure.pipeline import KINDS, PipelineJob, pipeline_rank, predict
from plait.runtime.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    defaults = PipelineJob()
    for f in dataclasses.fields(PipelineJob):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    job = PipelineJob(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PipelineJob)})
    job.check(args.ranks)
    m = run_ranks(args.ranks, pipeline_rank, job, timeout_s=900)[0]
    c = m["chunk"]
    plans = m["DualPipeV + plait plan"]["plans"]
    pred = predict(job, m)
    result = {"command": "python bench/pipeline_step.py" + (" --save" if args.save else ""),
              "ranks": args.ranks, "job": dataclasses.asdict(job), "chunk": c,
              "step_s": {k: {"measured": m[k]["step_s"], "predicted": pred[k]["step_s"]}
                         for k in KINDS},
              "peak_saved_bytes": {k: {"measured": m[k]["peak_saved_bytes"],
                                       "predicted": pred[k]["peak_saved_bytes"]}
                                   for k in KINDS},
              "overlap_f_b": {k: m[k]["overlap_f_b"] for k in KINDS[2:]}, "plans": plans}
    print(f"chunk ({job.blocks // (2 * job.pp)} blocks) alone: forward "
          f"{c['forward_s'] * 1e3:.2f} ms, backward {c['backward_s'] * 1e3:.2f} ms, saves "
          f"{c['saved_bytes'] / 2**20:.2f} MiB for backward")
    for k in KINDS:
        print(f"{k:>22}: step measured {m[k]['step_s'] * 1e3:7.1f} ms, predicted "
              f"{pred[k]['step_s'] * 1e3:7.1f} ms; peak activations measured "
              f"{m[k]['peak_saved_bytes'] / 2**20:6.2f} MiB, predicted "
              f"{pred[k]['peak_saved_bytes'] / 2**20:6.2f} MiB")
    path = (ROOT / "bench/results" if args.save else ROOT / "out") / "pipeline_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
