"""The values co-execution units are made of and run on: a strand's `Store` of tensors, one
copy of a layer's weights (`LayerParams`), a GEMM unit's operands (`Matmul`) and the `Unit`
itself. Their own module, below both the dense units (`units`) and the expert-parallel ones
(`experts`), so neither imports the other to name them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plait.runtime.engines import CollectiveEngine, Handle

Store = dict[str, torch.Tensor]


@dataclass
class LayerParams:
    """One copy of a layer's local weights and their accumulated gradients."""

    g1: torch.Tensor
    wqkv: torch.Tensor  # (H, (heads + 2 kv) * hd)
    wo: torch.Tensor  # (heads * hd, H)
    g2: torch.Tensor
    w1: torch.Tensor  # (H, 2 F)  [gate | up]; MoE: (local experts, H, 2 F)
    w2: torch.Tensor  # (F, H); MoE: (local experts, F, H)
    wr: torch.Tensor | None = None  # MoE: the router (H, experts), replicated
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return ("g1", "wqkv", "wo", "g2", "w1", "w2", *(("wr",) if self.wr is not None else ()))

    def accumulate(self, name: str, g: torch.Tensor) -> None:
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g.clone()


@dataclass(frozen=True)
class Matmul:
    """A GEMM unit's operands: `a` (a store tensor; transposed for a weight gradient, which
    sums over the tokens) times `b` (a weight, possibly transposed, or a store tensor); the
    product written to store tensor `out`, or added to weight gradient `grad`."""

    a: str
    b: Callable[[Store, LayerParams], torch.Tensor]
    out: str = ""
    grad: str = ""

    def operand(self, st: Store) -> torch.Tensor:
        return st[self.a].T if self.grad else st[self.a]

    def write(self, st: Store, p: LayerParams, product: torch.Tensor) -> None:
        if self.grad:
            p.accumulate(self.grad, product)
        else:
            st[self.out] = product


@dataclass(frozen=True)
class Unit:
    """One operator: `run(store, params, comm)` reads `inputs`, writes `outputs`; a collective
    unit returns the handle of its asynchronous transfer. A GEMM unit declares its `matmul`
    (so `fuse` can build its FiCCO unit); a fused unit runs a dependent (collective, GEMM) pair
    under a FiCCO schedule, communicating and computing in one call (`fused` names the
    schedule)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run: Callable[[Store, LayerParams, CollectiveEngine], Handle | None]
    collective: bool = False
    matmul: Matmul | None = None
    fused: str = ""
