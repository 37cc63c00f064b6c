"""Measure the CPU host's transfer engines with 2 gloo ranks and fit latency + bandwidth.

    python bench/cpu_links.py     # the figures behind the `cpu` hardware preset's links

Writes bench/results/cpu_links.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.measure.links import fit_latency_bandwidth, transfer_times_rank
from plait.runtime.launch import run_ranks


def main() -> None:
    world = 2
    times = run_ranks(world, transfer_times_rank, timeout_s=300)[0]
    fits = {e: fit_latency_bandwidth(t, world) for e, t in times.items()}
    for e, f in fits.items():
        pts = ", ".join(f"{kb} KiB {t * 1e3:.2f} ms" for kb, t in f["points"].items())
        print(f"{e:4s} latency {f['latency_s'] * 1e3:.3f} ms, {f['bytes_per_s'] / 1e9:.2f} GB/s "
              f"({pts})")
    out = Path(__file__).parent / "results" / "cpu_links.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "ranks": world,
                               "command": "python bench/cpu_links.py", "fits": fits}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
