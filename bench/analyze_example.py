"""Measured exposed communication of the sequence-parallel MLP example, plain and overlapped.

    python bench/analyze_example.py [--ranks 2] [--schedules seq/sm,fine/sm/c4/g1/M,...]

Runs `examples/sp_mlp.py --profile` under torchrun once per schedule (3 steps, 4096 tokens,
hidden 1024, FFN 4096, fp32 on CPU), then `plait analyze` on every rank's trace; reports rank
0. Writes out/analyze_sp_mlp.json (with --save: bench/results/).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import results_io
from plait.analyze.analysis import analyze
from plait.report.analysis import to_dict
from plait.spec.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = results_io.parser(__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--schedules", default="seq/sm,fine/sm/c4/g1/M,fine/dma/c2/g1/M")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.schedules.split(","):
            folder = Path(tmp) / s.replace("/", "_")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.ranks}", str(ROOT / "examples/sp_mlp.py"),
                            "--schedule", s, "--tokens", "4096", "--hidden", "1024", "--ffn",
                            "4096", "--steps", "3", "--profile", str(folder)],
                           check=True, capture_output=True)
            ranks = [folder / f"rank{r}.json" for r in range(args.ranks)]
            doc = to_dict(analyze(ranks, load_hardware("cpu")))
            (dev,) = doc["traces"][0]["devices"]  # rank 0; the others tell its waiting apart
            print(f"{s}: {doc['window']['note']}")
            out[s] = {k: dev[k] for k in ("steps", "span_us", "compute_us", "comm_us",
                                          "overlapped_us", "exposed_us", "waiting_us",
                                          "plait_check_us")}
            per = {k: v / dev["steps"] for k, v in out[s].items() if k != "steps"}
            print(f"{s:>18}: per step {per['span_us'] / 1e3:8.1f} ms, communication "
                  f"{per['comm_us'] / 1e3:7.1f} ms, exposed {per['exposed_us'] / 1e3:7.1f} ms "
                  f"({dev['exposed_fraction']:.1%}), of it waiting for the other rank "
                  f"{per['waiting_us'] / 1e3:6.1f} ms; plait's shape check "
                  f"{per['plait_check_us'] / 1e3:6.1f} ms")
    results_io.write("analyze_sp_mlp.json", {"results": out}, args.save)


if __name__ == "__main__":
    main()
