"""The predicted per-layer breakdown of Megatron-LM's TP layer: compute and exposed
communication, forward and backward.

    python bench/layer_breakdown.py [--save] [-H h200] [--tp 8]

The `megatron` baseline (Megatron-LM with sequence parallelism, no --tp-comm-overlap: in the
backward of a column-parallel linear the input's re-gather beside the data gradient and its
reduce-scatter beside the weight gradient), one micro-batch, for a few models and sequence
lengths; and how the compute splits into GEMMs, attention and memory-bound kernels. This is
the form of the published per-layer breakdowns (issue 27, item 4) that plait is compared with.
Prints a table and writes out/layer_breakdown.json (bench/results/ with --save).
"""

from __future__ import annotations

import results_io
from plait.sim.layer import simulate_layer
from plait.sim.optask import op_task
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.operators import Attention, Elementwise, Gemm
from plait.workload.transformer import build_layer

CASES = (("llama3-8b", 8192), ("llama3-70b", 4096), ("llama3-70b", 8192), ("gpt3-175b", 2048))


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("-H", "--hardware", default="h200")
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args()
    cluster = load_hardware(args.hardware)
    rows = []
    for name, seq in CASES:
        layer = build_layer(load_model(name), ParallelSpec(tp=args.tp, seq_len=seq))
        fwd, bwd = simulate_layer(layer, cluster, {}, megatron=True)
        kinds = {"gemm": 0.0, "attention": 0.0, "memory-bound": 0.0}
        for op in layer.forward + layer.backward:
            kind = ("gemm" if isinstance(op, Gemm) else "attention" if isinstance(op, Attention)
                    else "memory-bound" if isinstance(op, Elementwise) else None)
            if kind:
                kinds[kind] += op_task(op, cluster, op.name, "compute").duration
        rows.append({"model": name, "seq_len": seq, "tp": args.tp,
                     "forward": {"compute_s": fwd.compute_s, "exposed_comm_s": fwd.exposed_comm_s,
                                 "time_s": fwd.time_s},
                     "backward": {"compute_s": bwd.compute_s,
                                  "exposed_comm_s": bwd.exposed_comm_s, "time_s": bwd.time_s},
                     "compute_by_kind_s": kinds})
    print(f"Megatron-LM's layer (`megatron`), TP {args.tp}, {cluster.name}, one micro-batch, ms")
    print("| model | sequence | fwd compute | fwd exposed | bwd compute | bwd exposed | "
          "GEMM / attention / memory-bound |\n|---|---|---|---|---|---|---|")
    for r in rows:
        f, b, k = r["forward"], r["backward"], r["compute_by_kind_s"]
        print(f"| {r['model']} | {r['seq_len']} | {f['compute_s'] * 1e3:.2f} | "
              f"{f['exposed_comm_s'] * 1e3:.2f} | {b['compute_s'] * 1e3:.2f} | "
              f"{b['exposed_comm_s'] * 1e3:.2f} | {k['gemm'] * 1e3:.2f} / "
              f"{k['attention'] * 1e3:.2f} / {k['memory-bound'] * 1e3:.2f} |")
    results_io.write("layer_breakdown.json", {"hardware": cluster.name, "rows": rows},
                     args.save)


if __name__ == "__main__":
    main()
