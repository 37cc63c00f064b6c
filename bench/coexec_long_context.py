"""Co-execution's predicted gain under context parallelism whose ring crosses nodes, by
sequence length.

    python bench/coexec_long_context.py [--save] [-m llama3-8b gpt3-175b] [-H h100]

Two ways to grow the sequence, TP 8 within each node and one CP rank per node: a fixed CP 4
(each rank's block grows with the sequence), and CP grown with the sequence (16k tokens a
rank: CP 2, 4, 8, 16 over as many nodes). For each, the predicted step of `megatron` (Megatron-LM's
own overlaps; ring attention overlapping each ring step with its own attention) and of
co-execution, 8 micro-batches, and the share of the baseline's communication left exposed.
Two models by default: one with grouped-query attention (8 key/value heads: a small ring) and
one with a key/value head per query head (a ring as large as the queries).
Prints a table and writes out/coexec_long_context.json (bench/results/ with --save).
"""

from __future__ import annotations

import results_io
from plait.planner.coexec.variants import predict_coexec
from plait.spec.hardware import load_hardware
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model

SEQS = (16384, 32768, 65536, 131072)


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("-m", "--models", nargs="+", default=["llama3-8b", "gpt3-175b"])
    ap.add_argument("-H", "--hardware", default="h100")
    args = ap.parse_args()
    cluster = load_hardware(args.hardware)
    rows = []
    for name in args.models:
        model = load_model(name)
        for how, cps in (("fixed CP 4", (4,) * len(SEQS)), ("CP grows", (2, 4, 8, 16))):
            for seq, cp in zip(SEQS, cps, strict=True):
                r = predict_coexec(model, ParallelSpec(tp=8, cp=cp, seq_len=seq,
                                                       num_micro_batches=8), cluster)
                meg, co = r.variant("megatron"), r.variant("co-execution")
                rows.append({"model": model.name, "kv_heads": model.kv_heads, "how": how,
                             "seq_len": seq, "cp": cp,
                             "megatron_step_s": r.step(meg), "coexec_step_s": r.step(co),
                             "coexec_speedup": r.speedup(co),
                             "megatron_exposed_share": 1 - r.hidden(meg),
                             "coexec_exposed_share": 1 - r.hidden(co)})
    print(f"{cluster.name}, TP 8 in a node, the CP ring across nodes, 8 micro-batches "
          "(uncalibrated preset)")
    print("| model | sequence | CP | megatron step | co-execution step | speedup | exposed comm, "
          "megatron -> co-execution |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['seq_len'] // 1024}k ({row['how']}) | {row['cp']} | "
              f"{row['megatron_step_s'] * 1e3:,.0f} ms | {row['coexec_step_s'] * 1e3:,.0f} ms | "
              f"{row['coexec_speedup']:.2f}x | {row['megatron_exposed_share']:.0%} -> "
              f"{row['coexec_exposed_share']:.0%} |")
    results_io.write("coexec_long_context.json", {
        "models": args.models, "hardware": cluster.name, "rows": rows}, args.save)


if __name__ == "__main__":
    main()
