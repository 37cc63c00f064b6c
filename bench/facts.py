"""The qualitative facts of the FiCCO brief, as the model reproduces them (no per-case tuning).

    python bench/facts.py      # prints the figures quoted in the README

1. Gather speed, shard-level P2P vs finer grain, on a full mesh (MI300X) and a switch (H100).
2. Large compute-bound shapes from the paper's evaluation: chosen time over the ideal bound.
3. Small-M shapes: the explorer keeps a sequential schedule (decomposition loss too high).
4. Ideal overlap speedup (T_gemm + T_comm) / max(T_gemm, T_comm) over the same shapes: <= 2.
"""

from __future__ import annotations

from plait.planner.explore import explore_pair
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.pair import simulate_pair
from plait.spec.hardware import load_hardware
from plait.workload.operators import OverlapPair

P = 8
BRIEF_SHAPES = [(16384, 16384, 131072), (131072, 16384, 16384), (53248, 16384, 131072),
                (16384, 53248, 16384), (8192, 8192, 262144), (262144, 8192, 8192),
                (28672, 8192, 262144), (262144, 28672, 8192), (196608, 18432, 16384),
                (196608, 106496, 16384), (1048576, 10240, 8192), (1048576, 57344, 8192),
                (1607680, 57344, 8192)]


def ag_pair(m: int, n: int, k: int) -> OverlapPair:
    """All-gather of A (m x k, sharded on m) feeding a column-parallel GEMM (n split P ways)."""
    return OverlapPair.build("ag", m, n // P, k, P)


def main() -> None:
    print("1. gather time (GEMM negligible), 128 MiB... 1 GiB all-gather over 8 GPUs")
    for hw in ("mi300x", "h100"):
        c = load_hardware(hw)
        pair = ag_pair(65536, P, 8192)
        p2p = simulate_pair(pair, Schedule(CommPattern.P2P, Engine.DMA), c).time_s
        fine = simulate_pair(pair, Schedule(CommPattern.FINE, Engine.DMA, 8, 1), c).time_s
        print(f"   {hw:7s} shard-level p2p {p2p * 1e3:7.3f} ms   finer grain {fine * 1e3:7.3f} ms"
              f"   ratio {p2p / fine:4.2f}x")
    print("2./4. brief's evaluation shapes (M, N, K), AG->GEMM, 8 GPUs")
    print(f"   {'hw':7s} {'M':>8s} {'N':>7s} {'K':>7s} {'gemm/comm':>9s} {'ideal x':>7s} "
          f"{'chosen x':>8s} {'time/ideal':>10s}  chosen")
    for hw in ("mi300x", "h100"):
        c = load_hardware(hw)
        for m, n, k in BRIEF_SHAPES:
            r = explore_pair(ag_pair(m, n, k), c)
            ch = r.chosen
            ideal_x = (ch.gemm_whole_s + ch.comm_whole_s) / ch.ideal_s
            print(f"   {hw:7s} {m:8d} {n:7d} {k:7d} {ch.gemm_whole_s / ch.comm_whole_s:9.2f} "
                  f"{ideal_x:7.2f} {r.speedup:8.2f} {ch.time_s / ch.ideal_s:10.3f}  {ch.schedule}")
    print("3. small M (tokens per TP group), Llama-3-8B-like QKV: N=6144/8, K=4096")
    for hw in ("mi300x", "h100"):
        c = load_hardware(hw)
        for m in (256, 512, 1024, 2048, 8192):
            r = explore_pair(ag_pair(m, 6144, 4096), c)
            fine = r.best(CommPattern.FINE)
            assert fine is not None
            print(f"   {hw:7s} M={m:5d} chosen {r.chosen.schedule!s:18s} best finer-grain "
                  f"{fine.schedule!s:18s} decomposition loss {fine.decomposition_loss:+5.0%} "
                  f"time vs chosen {fine.time_s / r.chosen.time_s:4.2f}x")


if __name__ == "__main__":
    main()
