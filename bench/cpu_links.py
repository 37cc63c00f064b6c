"""Measure the CPU host's transfer engines with 2 gloo ranks and fit latency + bandwidth: the
transfer items of `plait profile --full` (the one transfer measurement) and its fit.

    python bench/cpu_links.py [--save]   # the figures behind the `cpu` preset's links

Writes out/cpu_links.json (with --save: bench/results/cpu_links.json).
"""

from __future__ import annotations

from typing import Any

import results_io
from plait.measure.profile import ProfilePlan, profile_rank, transfer_fits
from plait.runtime.launch import run_ranks


def main() -> None:
    args = results_io.parser(__doc__).parse_args()
    world = 2
    plan = ProfilePlan(quick=False, ranks=world, repeats=5, parts=("transfer",))
    measured: dict[str, Any] = {}

    def got(_rank: int, item: tuple[str, Any]) -> None:
        measured[item[0]] = item[1]

    run_ranks(world, profile_rank, plan, plan.todo(()), timeout_s=600, progress=got)
    fits = transfer_fits(measured, world)
    for e, f in fits.items():
        pts = ", ".join(f"{kb} KiB {t * 1e3:.2f} ms" for kb, t in f["points"].items())
        print(f"{e:5s} latency {f['latency_s'] * 1e3:.3f} ms, {f['bytes_per_s'] / 1e9:.2f} GB/s "
              f"({pts})")
    results_io.write("cpu_links.json", {"ranks": world, "fits": fits}, args.save)


if __name__ == "__main__":
    main()
