"""Which transfers of a trace form a dependent pair with a GEMM beside them.

A transfer that feeds a GEMM (all-gather, all-to-all dispatch) is paired with one of the first
GEMMs that start after it and read exactly what it moved (its A operand, M*K elements, or for a
weight gradient its B operand, K*N); one that a GEMM feeds (reduce-scatter, all-to-all combine)
with one of the last GEMMs that started before it and wrote exactly what it moves (M*N
elements). The operands' strides tell whether the gather filled the GEMM's rows (M) or its
reduction (K). No planner here: `advice` explores the pairs, `findings` names them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Literal

from plait.analyze.kineto import Comm, DeviceTrace, Kernel
from plait.spec.dtypes import DTYPE_BYTES
from plait.workload.operators import Axis, Collective, CollectiveKind, Gemm, OverlapPair

LOOKAHEAD = 4  # GEMMs examined on each side of a transfer for its partner
_DIRECTIONS: dict[CollectiveKind, tuple[Literal["in", "out"], ...]] = {
    CollectiveKind.AG: ("in",), CollectiveKind.RS: ("out",), CollectiveKind.A2A: ("in", "out")}


def _partner(c: Comm, gemms: Sequence[Kernel], starts: Sequence[float]
             ) -> tuple[OverlapPair, Kernel] | None:
    if c.kind not in _DIRECTIONS or c.group < 2 or c.elems <= 0 or c.plaits_own:
        return None
    at = bisect_left(starts, c.start)  # gemms[at:] start at or after the transfer
    for direction in _DIRECTIONS[c.kind]:
        near = (gemms[at:at + LOOKAHEAD] if direction == "in"
                else gemms[max(0, at - LOOKAHEAD):at][::-1])
        for g in near:
            for axis, (m, n, k, count) in _readings(c, g, direction):
                if (m if axis is Axis.M else k) % c.group:
                    continue
                dtype = g.dtype or c.dtype or "bf16"  # a GEMM records its input types
                name = (f"{c.kind.name.lower()}:{m}x{n}x{k}" + (f"x{count}" if count > 1 else "")
                        + ("/K" if axis is Axis.K else ""))
                coll = Collective(name, c.kind, c.elems * DTYPE_BYTES[dtype], c.group)
                return OverlapPair(name, coll, Gemm(name, m, n, k, dtype, count), direction,
                                   axis), g
    return None


def _readings(c: Comm, g: Kernel, direction: str
              ) -> list[tuple[Axis, tuple[int, int, int, int]]]:
    """How GEMM `g` can be the partner of transfer `c`: the axis the transfer fills and the
    GEMM (m, n, k, count) as plait's pair has it. What an all-gather fills is the stored
    tensor's rows: A's rows (tokens, M) when A is stored as is; the reduction K when A is a
    transposed view, or when the gathered tensor is B (a weight gradient, dW = dY^T X: plait's
    pair is its transpose, X^T dY)."""
    assert g.gemm is not None
    m, n, k, count = g.gemm
    a_t, b_t = g.transposed
    if direction == "out":  # the product's rows go out
        return [(Axis.M, g.gemm)] if m * n * count == c.elems else []
    out = []
    if m * k * count == c.elems:
        out.append((Axis.K, g.gemm) if a_t and c.kind is CollectiveKind.AG
                   else (Axis.M, g.gemm))
    if c.kind is CollectiveKind.AG and not b_t and count == 1 and k * n == c.elems:
        out.append((Axis.K, (n, m, k, 1)))
    return out


def dependent_pairs(device: DeviceTrace) -> dict[OverlapPair, list[tuple[Comm, Kernel]]]:
    """Every dependent pair on `device`, with its calls (the transfer and its GEMM)."""
    gemms = [g for g in device.compute if g.gemm is not None]  # in start order
    starts = [g.start for g in gemms]
    found: dict[OverlapPair, list[tuple[Comm, Kernel]]] = {}
    for c in device.comms:
        match = _partner(c, gemms, starts)
        if match is not None:
            pair, g = match
            found.setdefault(pair, []).append((c, g))
    return found
