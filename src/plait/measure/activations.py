"""What a forward keeps for its backward, measured: the bytes of every tensor storage the
forward creates that is still alive when it returns (saved by autograd, cached by selective
activation checkpointing, or an input a checkpoint holds), the output and the parameters left
out. `plait.planner.plan.memory.saved_bytes` predicts the same quantity.

Each storage a dispatched operator creates is recorded through a `TorchDispatchMode` and
checked afterwards with a weak reference, so views and tensors saved twice count once and
nothing is kept alive by the measurement itself. `saved_tensor_bytes` counts the same thing
through `torch.autograd.graph.saved_tensors_hooks` (the unique storages autograd packs, less
the parameters and the inputs): both agree when no checkpoint is involved.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Created(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = _storages(tree_leaves((args, kwargs)))  # a view's storage is not new
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in inputs:
                    self.storages.setdefault(ref, storage.nbytes())
        return out


def _storages(tensors: Iterable[Any]) -> set[StorageWeakRef]:
    return {StorageWeakRef(t.untyped_storage())
            for t in tensors
            if isinstance(t, torch.Tensor) and t.layout == torch.strided}


def retained_bytes(forward: Callable[[torch.Tensor], Any], x: torch.Tensor,
                   params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes `forward(x)` leaves alive for the backward: the storages it creates that outlive
    it, plus `x`'s own if something still holds it once the caller lets it go (a checkpoint
    does). `x` must not be a leaf (autograd holds leaves for their gradient): pass
    `leaf.clone()`. The output and `params` are not counted."""
    mode = _Created()
    with mode:
        out = forward(x)
    x_ref = StorageWeakRef(x.untyped_storage())
    x_bytes = x.untyped_storage().nbytes()
    del x
    gc.collect()
    skip = _storages(tree_leaves(out)) | _storages(params)
    kept = sum(n for ref, n in mode.storages.items() if not ref.expired() and ref not in skip)
    if not x_ref.expired() and x_ref not in skip and x_ref not in mode.storages:
        kept += x_bytes
    del out
    return kept


def saved_tensor_bytes(forward: Callable[[torch.Tensor], Any], x: torch.Tensor,
                       params: Iterable[torch.Tensor] = (),
                       shared: Iterable[torch.Tensor] = ()) -> int:
    """The unique storages autograd saves during `forward(x)` (saved_tensors_hooks), less
    `params`, `x` and `shared` (inputs saved by many layers, such as rotary tables)."""
    seen: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            ref = StorageWeakRef(t.untyped_storage())
            seen.setdefault(ref, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    skip = _storages([*params, x, *shared])
    del out
    return sum(n for ref, n in seen.items() if ref not in skip)
