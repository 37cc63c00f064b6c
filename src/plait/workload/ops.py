"""The operator model: the units a layer is made of, shared by explorer, simulator and runtime.

Every operator is a small frozen record. A GEMM computes an (m x n) output reducing over k;
`count` batches identical GEMMs (local experts). Collectives carry the bytes of the full tensor
they produce (all-gather) or consume (reduce-scatter), per rank, and the operator they feed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal


class CollectiveKind(StrEnum):
    AG = "all_gather"
    RS = "reduce_scatter"
    AR = "all_reduce"
    A2A = "all_to_all"
    P2P = "p2p"


class Axis(StrEnum):
    """A GEMM dimension along which a GEMM is split: M (rows, tokens) or K (the reduction)."""

    M = "M"
    K = "K"


@dataclass(frozen=True, slots=True)
class Gemm:
    """C[m, n] (+)= A[m, k] @ B[k, n], `count` times (batched experts)."""

    name: str
    m: int
    n: int
    k: int
    dtype: str = "bf16"
    count: int = 1
    accumulate: bool = False  # reads C as well (a K-split piece adding into the output)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def bytes_moved(self, dtype_bytes: int) -> float:
        c = self.m * self.n * (2 if self.accumulate else 1)
        return float(self.m * self.k + self.k * self.n + c) * dtype_bytes * self.count

    def piece(self, axis: Axis, size: int, name: str) -> Gemm:
        """The part of this GEMM covering `size` of its `axis` dimension."""
        if axis is Axis.M:
            return replace(self, name=name, m=size)
        return replace(self, name=name, k=size, accumulate=True)


@dataclass(frozen=True, slots=True)
class Attention:
    """Scaled dot-product attention over the local heads (FlashAttention-style cost)."""

    name: str
    q_tokens: int
    kv_tokens: int
    heads: int
    head_dim: int
    causal: bool = True
    backward: bool = False
    dtype: str = "bf16"

    @property
    def flops(self) -> float:
        f = 4.0 * self.q_tokens * self.kv_tokens * self.head_dim * self.heads
        f *= 0.5 if self.causal else 1.0
        return f * (2.5 if self.backward else 1.0)


@dataclass(frozen=True, slots=True)
class Elementwise:
    """A memory-bound operator (norm, activation, residual add), described by bytes moved."""

    name: str
    bytes: float


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective on a process group of `group` ranks spaced `stride` global ranks apart."""

    name: str
    kind: CollectiveKind
    bytes: float  # full tensor per rank: gathered output (AG), input (RS/AR), sent data (A2A/P2P)
    group: int
    stride: int = 1
    feeds: str | None = None  # the operator that consumes the result
    fed_by: str | None = None  # the operator whose result it moves


Op = Gemm | Attention | Elementwise | Collective


@dataclass(frozen=True, slots=True)
class OverlapPair:
    """A dependent (collective, GEMM) pair that a FiCCO schedule can decompose.

    direction "in": the collective produces the GEMM's input (AG -> GEMM, A2A dispatch -> experts).
    direction "out": the GEMM's output feeds the collective (GEMM -> RS, experts -> A2A combine).
    `axis` is the GEMM dimension that the collective gathers or scatters.
    """

    name: str
    collective: Collective
    gemm: Gemm
    direction: Literal["in", "out"]
    axis: Axis

    @property
    def ranks(self) -> int:
        return self.collective.group

    @property
    def reduces(self) -> bool:
        return self.collective.kind in (CollectiveKind.RS, CollectiveKind.AR)

    @property
    def split_extent(self) -> int:
        """Length of the gathered/scattered GEMM dimension."""
        return self.gemm.m if self.axis is Axis.M else self.gemm.k


@dataclass(frozen=True, slots=True)
class Layer:
    """One transformer layer as explicit forward and backward operator sequences."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    pairs: tuple[OverlapPair, ...]

    def pair_of(self, op_name: str) -> OverlapPair | None:
        for p in self.pairs:
            if op_name in (p.collective.name, p.gemm.name):
                return p
        return None
