"""GEMM time: roofline, tile and wave quantization over the compute units, the sustained
(power-limited) rate, launch cost.

A GEMM's output is cut in tiles; each compute unit computes one tile at a time, so the kernel runs
in ceil(tiles / units) waves and a partial last wave wastes units. Skinny GEMMs may use shorter
tiles (less efficient per flop, fewer wasted rows), and the cheapest tile height is taken, as a
library's heuristic would. The time is the larger of the compute time and the time to stream the
operands through memory, plus one kernel launch. Splitting a GEMM into pieces therefore costs more
than the whole (the decomposition loss): more launches, more partial waves, operands (B for an M
split, C for a K split) read again.
"""

from __future__ import annotations

import math

from plait.cost.grid import GridTable
from plait.cost.resources import Cost
from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Attention, Gemm, Role

# Tile shapes tried: tile_m and tile_n each halved up to 3 times; each halving keeps this share
# of per-flop efficiency (lower arithmetic intensity per tile).
_TILE_SHRINK_EFFICIENCY = 0.9
_TILE_SHRINKS = 4
_MIN_TILE = 16


def _measured(cluster: ClusterSpec, dtype: str) -> GridTable | None:
    """The calibration's GEMM grid for `dtype`, built once per parameter set."""
    def build() -> GridTable | None:
        pts = [(m, n, k, t) for d, m, n, k, t in cluster.params.gemm_measured if d == dtype]
        return GridTable(pts) if pts else None

    return cluster.params.cached(("gemm", dtype), build)


def _tiles(cluster: ClusterSpec, dtype: str) -> tuple[tuple[int, int, float], ...]:
    """The tile shapes tried, as (tile rows, tile columns, per-unit FLOP/s at that shape's
    efficiency; a shape reached by several shrinks keeps its best), fastest first; built
    once per cluster and dtype."""
    def build() -> tuple[tuple[int, int, float], ...]:
        gpu = cluster.gpu
        per_unit = (gpu.flops(dtype) * cluster.params.gemm_peak_fraction
                    * cluster.params.clock_fraction / gpu.compute_units)
        shapes: dict[tuple[int, int], float] = {}
        for sm in range(_TILE_SHRINKS):
            tm = max(_MIN_TILE, gpu.tile_m >> sm)
            for sn in range(_TILE_SHRINKS):
                tn = max(_MIN_TILE, gpu.tile_n >> sn)
                shapes.setdefault((tm, tn), per_unit * _TILE_SHRINK_EFFICIENCY ** (sm + sn))
        return tuple(sorted(((tm, tn, rate) for (tm, tn), rate in shapes.items()),
                            key=lambda shape: -shape[2]))

    return cluster.cached(("tiles", dtype), build)


def gemm_compute_time(g: Gemm, cluster: ClusterSpec) -> float:
    """Time on the compute units alone (no memory bound, no launch), all units available:
    the cheapest tile shape's waves, and never faster than the sustained rate (the maximum
    achievable matmul rate, `gemm_sustained_fraction` of peak: under full tensor-core load the
    power limit holds the clock below its boost). Both scale with `clock_fraction` (a part
    held at a lower power limit runs every tile slower). An FP8 gradient GEMM takes
    `fp8_split_accumulator_slowdown` longer (the stacks accumulate it precisely). A shape is
    skipped once even a GEMM without wasted tile rows or columns would take longer at its (and
    every later shape's) rate."""
    units = cluster.gpu.compute_units
    m, n, k, count = g.m, g.n, g.k, g.count
    unwasted = 2.0 * m * n * k * count / units  # FLOP per unit with every tile full
    best = math.inf
    for tm, tn, rate in _tiles(cluster, g.dtype):
        if unwasted / rate > best * (1 + 1e-12):
            break
        waves = -(-(-(-m // tm) * -(-n // tn) * count) // units)
        t = waves * 2.0 * tm * tn * k / rate
        if t < best:
            best = t
    t = max(best, g.flops / sustained_flops(cluster, g.dtype))  # as the ceiling is stated
    if g.dtype == "fp8" and g.role is not Role.FORWARD:  # the split accumulator
        t *= 1 + cluster.params.fp8_split_accumulator_slowdown
    return t


def sustained_flops(cluster: ClusterSpec, dtype: str) -> float:
    """The rate no GEMM of `dtype` exceeds: `gemm_sustained_fraction` of peak at the part's
    `clock_fraction`."""
    p = cluster.params
    return cluster.gpu.flops(dtype) * p.gemm_sustained_fraction * p.clock_fraction


def gemm_memory_time(g: Gemm, cluster: ClusterSpec) -> float:
    bw = cluster.gpu.hbm_bytes_per_s * cluster.params.hbm_fraction
    return g.bytes_moved(DTYPE_BYTES[g.dtype]) / bw


def gemm_time(g: Gemm, cluster: ClusterSpec) -> float:
    """Standalone time of one GEMM kernel: measured (calibrated grid) or modelled."""
    return gemm_cost(g, cluster).duration


def gemm_cost(g: Gemm, cluster: ClusterSpec) -> Cost:
    """A GEMM kernel as a task: its standalone time (measured on the calibrated grid, or
    modelled), all the compute units, and the share of HBM bandwidth its operands stream at
    that speed."""
    memory = gemm_memory_time(g, cluster)
    table = _measured(cluster, g.dtype)
    t = (table(g.m, g.n, g.k) * g.count if table is not None else
         cluster.gpu.launch_overhead_s + max(gemm_compute_time(g, cluster), memory))
    return Cost(t, {"compute": 1.0, "hbm": min(1.0, memory / t)})


def attention_time(a: Attention, cluster: ClusterSpec) -> float:
    """A fused (FlashAttention-style) kernel, one launch, compute-bound at a rate that grows
    with the keys each query visits: rate = peak x fraction x keys / (keys + half_keys), times
    the causal factor under a causal mask (where a query visits half the keys on average).
    Forward and backward kernels have their own fraction and half point."""
    p = cluster.params
    frac, half = ((p.attention_bwd_peak_fraction, p.attention_bwd_half_keys) if a.backward
                  else (p.attention_fwd_peak_fraction, p.attention_fwd_half_keys))
    keys = a.kv_tokens * (0.5 if a.causal else 1.0)
    rate = (cluster.gpu.flops(a.dtype) * p.clock_fraction * frac * keys / (keys + half)
            * (p.attention_causal_factor if a.causal else 1.0))
    return cluster.gpu.launch_overhead_s + a.flops / rate
