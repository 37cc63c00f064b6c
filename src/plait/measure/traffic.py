"""The memory-bound work of a forward and its backward as PyTorch runs them op by op: every
dispatched operator that is not a matmul, an attention kernel or a view, its kernels counted
and the bytes it reads and writes summed (inputs plus outputs, as a kernel streams them
through memory). `plait.planner.plan.eager` predicts the same for a Llama block; the test
compares them on the Hugging Face layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# the compute-bound kernels (their time is the GEMM and attention model's), not memory traffic
COMPUTE_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten._scaled_dot_product_")


@dataclass
class Traffic:
    """Bytes read and written, and kernels, of the memory-bound operators per phase."""

    bytes: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    kernels: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.traffic, self.phase = Traffic(), "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if (func.is_view or "view" in name or name.startswith(COMPUTE_OPS)
                or name.startswith(("aten.detach", "aten.empty", "aten.ones_like"))):
            return out
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor))
        self.traffic.bytes[self.phase] += moved
        self.traffic.kernels[self.phase] += 1
        return out


def memory_traffic(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
                   ) -> Traffic:
    """The memory-bound traffic of `forward(x)` and of its backward from a gradient of ones
    (the seed itself not counted)."""
    counter = _Counter()
    with counter:
        y = forward(x)
        counter.phase = "backward"
        y.backward(torch.ones_like(y))
    return counter.traffic
