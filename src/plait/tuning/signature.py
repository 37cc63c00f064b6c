"""What a tuning decision depends on: the pair's GEMM problem on its group and device."""

from __future__ import annotations

from dataclasses import dataclass

from plait.workload.operators import Axis, OverlapPair, PairKind


@dataclass(frozen=True, slots=True)
class Signature:
    """One kind of call: the pair (`OverlapPair.build`'s words: m x n x k is the GEMM on
    each rank, over its `experts` local experts), the group's size and backend, the device.
    Calls of one signature run alike whatever their tensors' leading dimensions: the ops
    flatten them to these rows first."""

    kind: PairKind
    m: int
    n: int
    k: int
    ranks: int
    dtype: str
    axis: Axis = Axis.M
    experts: int = 1
    backend: str = "gloo"
    device: str = "cpu"

    @property
    def key(self) -> str:
        """The signature as one line (the tuning cache's key)."""
        experts = f" e{self.experts}" if self.experts != 1 else ""
        return (f"{self.kind} {self.m}x{self.n}x{self.k}{experts} {self.dtype} /{self.axis} "
                f"p{self.ranks} {self.backend} on {self.device}")

    def pair(self) -> OverlapPair:
        return OverlapPair.build(self.kind, self.m, self.n, self.k, self.ranks,
                                 experts=self.experts, dtype=self.dtype, axis=self.axis,
                                 name=str(self.kind))
