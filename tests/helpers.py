"""Test helpers: a body run on forked gloo ranks that says which rank failed and why, and seeds
that are the same in every process."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from plait.runtime.launch import run_ranks


def on_every_rank(world: int, body: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run `body(rank, world, *args)` on `world` ranks and require every rank to pass: return
    True. A rank that raises is named by `run_ranks` with its traceback; a rank that returns
    anything else is named here with what it returned."""
    results = run_ranks(world, body, *args, **kwargs)
    failed = {rank: got for rank, got in enumerate(results) if got is not True}
    assert not failed, "; ".join(f"rank {rank} of {world} returned {got!r}, not True"
                                 for rank, got in failed.items())


def seed_of(*parts: object) -> int:
    """A seed in 0..999 from the test's parameters, the same in every process (unlike `hash`
    of a string, which Python randomizes per process), so a failure reproduces."""
    return zlib.crc32(repr(parts).encode()) % 1000


def gloo_pipelining_skip() -> Any:
    """Skip on torch < 2.13, where PyTorch's own pipelining fails over gloo (its P2P at the
    stages' first step: "Pair is not connected", PyTorch's default schedule as much as
    plait's OVERLAP_F_B): an upstream defect of those releases; OVERLAP_F_B on them is checked
    on NCCL (bench/gpu_check.sh)."""
    import pytest
    import torch

    from plait.runtime import version_of

    return pytest.mark.skipif(version_of(torch.__version__) < (2, 13),
                              reason="torch < 2.13: PyTorch's pipelining P2P fails over gloo "
                              "(upstream; its default schedule too)")


def step_and_stage_grads(schedule: Any, first: bool, ids: Any, target: Any,
                         stages: dict[int, Any]) -> dict[str, Any]:
    """One pipelined step (the inputs fed on the ranks holding the first stage), then every
    parameter gradient of this rank's stages by "<stage>.<name>", whole (a DTensor's
    gathered)."""
    if first:
        schedule.step(ids, target=target)
    else:
        schedule.step()
    return {f"{s}.{n}": (q.grad.full_tensor() if hasattr(q.grad, "full_tensor")
                         else q.grad).clone()
            for s, m in stages.items() for n, q in m.named_parameters() if q.grad is not None}
