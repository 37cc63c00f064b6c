"""The operator model: the units a layer is made of, shared by explorer, simulator and runtime.

Every operator is a small frozen record. A GEMM computes an (m x n) output reducing over k;
`count` batches identical GEMMs (local experts). Collectives carry the bytes of the full tensor
they produce (all-gather) or consume (reduce-scatter), per rank, and the operator they feed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from plait.spec.dtypes import DTYPE_BYTES


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


class Role(StrEnum):
    """What a GEMM computes for its linear: the forward product, the gradient of its input
    (data gradient), or of its weight (weight gradient, which nothing in the layer reads)."""

    FORWARD = "forward"
    DATA_GRAD = "dgrad"
    WEIGHT_GRAD = "wgrad"


def gradient_name(pair: str, role: Role) -> str:
    """The name of a pair's gradient GEMM (`fc1` -> `fc1_dgrad`, `fc1_wgrad`): the one place
    the names of the backward's operators, units, tasks and plan entries come from."""
    assert role is not Role.FORWARD, "a forward GEMM is named by its pair"
    return f"{pair}_{role.value}"


def role_of(name: str) -> Role:
    """The role of a GEMM or pair by its name (`gradient_name`'s inverse)."""
    for role in (Role.DATA_GRAD, Role.WEIGHT_GRAD):
        if name.endswith(f"_{role.value}"):
            return role
    return Role.FORWARD


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
    role: Role = Role.FORWARD

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def bytes_moved(self, dtype_bytes: int) -> float:
        c = self.m * self.n * (2 if self.accumulate else 1)
        return float(self.m * self.k + self.k * self.n + c) * dtype_bytes * self.count

    def piece(self, axis: Axis, size: int, name: str) -> Gemm:
        """The part of this GEMM covering `size` of its `axis` dimension."""
        if axis is Axis.M:  # the constructor, not `replace`: this is the planners' inner loop
            return Gemm(name, size, self.n, self.k, self.dtype, self.count, self.accumulate,
                        self.role)
        return Gemm(name, self.m, self.n, size, self.dtype, self.count, True, self.role)


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
    sequences: int = 1  # independent sequences (a micro-batch): tokens attend within their own

    @property
    def flops(self) -> float:
        """q_tokens and kv_tokens are per sequence: FLOPs are linear in the sequences."""
        f = 4.0 * self.q_tokens * self.kv_tokens * self.head_dim * self.heads * self.sequences
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
    # The operator Megatron-LM runs it beside, asynchronously (`sim.layer`'s megatron
    # baseline): in a column-parallel linear's backward, the input's re-gather beside the
    # data-gradient GEMM, the data gradient's reduce-scatter beside the weight-gradient GEMM.
    beside: str | None = None


Op = Gemm | Attention | Elementwise | Collective


class PairKind(StrEnum):
    """The four kinds of dependent pair, in `plait bench --op`'s words."""

    AG = "ag"  # an all-gather feeding the GEMM (tensor and sequence parallel)
    RS = "rs"  # the GEMM's output reduce-scattered
    A2A = "a2a"  # an all-to-all dispatch of the GEMM's input rows to the experts
    MM_A2A = "mm_a2a"  # the experts' output rows combined by an all-to-all

    @property
    def collective(self) -> CollectiveKind:
        return {PairKind.AG: CollectiveKind.AG, PairKind.RS: CollectiveKind.RS}.get(
            self, CollectiveKind.A2A)

    @property
    def direction(self) -> Literal["in", "out"]:
        """"in": the collective produces the GEMM's input; "out": it takes its output."""
        return "in" if self in (PairKind.AG, PairKind.A2A) else "out"

    @property
    def experts(self) -> bool:
        """An expert-parallel pair (local experts may share its rows)."""
        return self in (PairKind.A2A, PairKind.MM_A2A)


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

    @classmethod
    def build(cls, op: PairKind | str, m: int, n: int, k: int, ranks: int, *, experts: int = 1,
              dtype: str = "bf16", axis: Axis = Axis.M, name: str | None = None,
              stride: int = 1) -> OverlapPair:
        """The pair `op` around a GEMM of m x n x k on each rank (m: its rows over all
        `experts` local experts, each computing m / experts of them), in `plait bench --op`'s
        words:

        - "ag": an all-gather feeding the GEMM: of A's rows (m x k, axis M), or of B along the
          reduction (k x n, axis K: a weight gradient's re-gathered input);
        - "rs": the GEMM's output (m x n) reduce-scattered;
        - "a2a": an all-to-all dispatch of the GEMM's input rows (m x k) to the experts;
        - "mm_a2a": the experts' output rows (m x n) combined by an all-to-all.
        """
        try:
            op = PairKind(op)
        except ValueError:
            raise ValueError(f"pair op {op!r}: use one of {', '.join(PairKind)}") from None
        if m % experts:
            raise ValueError(f"m={m} rows do not split among {experts} experts")
        if axis is Axis.K and op is not PairKind.AG:
            raise ValueError(f"{op}: only an all-gather fills the reduction dimension K")
        moved = k if op.direction == "in" else n  # the columns of the rows it moves
        nbytes = (k * n if axis is Axis.K else m * moved) * DTYPE_BYTES[dtype]
        label = name or str(op)
        direction = op.direction
        return cls(label, Collective(label, op.collective, float(nbytes), ranks, stride),
                   Gemm(label, m // experts, n, k, dtype, experts), direction, axis)

    @property
    def kind(self) -> PairKind:
        """The pair in `build`'s words (ag, rs, a2a, mm_a2a)."""
        return next(k for k in PairKind if k.collective is self.collective.kind
                    and k.direction == self.direction)

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

    @property
    def weight_gradients(self) -> tuple[str, ...]:
        """The backward's weight-gradient GEMMs: nothing in the layer reads them, so a plan
        may move them later."""
        return tuple(op.name for op in self.backward
                     if isinstance(op, Gemm) and op.role is Role.WEIGHT_GRAD)

    def pair_of(self, op_name: str) -> OverlapPair | None:
        for p in self.pairs:
            if op_name in (p.collective.name, p.gemm.name):
                return p
        return None
