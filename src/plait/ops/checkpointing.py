"""Selective activation checkpointing with plait's ops: their outputs saved, so a
recomputed forward does not communicate again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def sac_save_ops() -> tuple[Any, ...]:
    """plait's communicating ops, for a selective activation checkpointing save list (as
    torchtitan's op-level SAC names PyTorch's collectives): their outputs are kept from the
    forward, so the backward does not run their communication again."""
    return (torch.ops.plait.all_gather_matmul.default,
            torch.ops.plait.matmul_reduce_scatter.default,
            torch.ops.plait.all_to_all_matmul.default,
            torch.ops.plait.matmul_all_to_all.default)


def sac_policy(save: Sequence[Any] = ()) -> Callable[..., Any]:
    """A policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`: plait's ops
    (and `save`) are saved, everything else recomputed::

        checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, plait.ops.sac_policy()))
    """
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {*sac_save_ops(), *save}

    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op in keep
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return policy
