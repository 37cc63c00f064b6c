"""Stages as PyTorch's pipelining takes them: `TensorParallelStage` (DTensor-sharded blocks as a
stage of plain tensors) and `stream_per_stage` (each CUDA stage on a stream of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from plait.errors import SpecError


class TensorParallelStage(torch.nn.Module):
    """A pipeline stage of tensor-parallel modules, as `PipelineStage` takes it: plain
    tensors in and out. Modules parallelized the torchtitan way (`plait.parallel.llama_plan`,
    `llama_block_plan`) pass their activations on as `DTensor`s sharded along the sequence,
    which a stage cannot send; this wrapper takes each floating-point tensor argument as this
    rank's sequence shard (`Shard(seq_dim)` on `mesh`) and hands back each `DTensor` output
    as this rank's shard, in storage of its own (the schedule detaches stage outputs in
    place). Other arguments (token ids) pass as they are.

    `seq_dim`: where the sequence lies in the activations; by default read from each input
    (the dimension before the hidden one: batched `(batch, sequence, hidden)` and flattened
    `(tokens, hidden)` alike), as plait's styles read it (`plait.parallel.llama_plan`), so the
    stage and the plan agree by construction. A `seq_dim` given that would shard an input's
    last dimension (the hidden one) is refused in one line naming the `seq_dim` to pass."""

    def __init__(self, module: torch.nn.Module, mesh: Any, seq_dim: int | None = None) -> None:
        super().__init__()
        self.module, self.mesh, self.seq_dim = module, mesh, seq_dim

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_map

        return tree_map(self._local, self.module(*tree_map(self._sharded, args),
                                                 **tree_map(self._sharded, kwargs)))

    def _sharded(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and \
                x.is_floating_point():
            if self.seq_dim is not None and self.seq_dim % x.dim() == x.dim() - 1:
                raise SpecError("seq_dim", f"{self.seq_dim} is the hidden dimension of the "
                                f"stage's input {tuple(x.shape)}", "pass seq_dim=0 for "
                                "flattened tokens (tokens, hidden), or none (read from the "
                                "activations)")
            from plait.parallel import seq_dim_of

            return DTensor.from_local(x, self.mesh, [Shard(seq_dim_of(x, self.seq_dim))],
                                      run_check=False)
        return x

    def _local(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return x.to_local().clone() if isinstance(x, DTensor) else x


def stream_per_stage(schedule: Any) -> dict[int, Any]:
    """Run each CUDA stage's forward and backward on a stream of its own; returns them by
    stage (none for CPU stages). Autograd runs each backward op on the stream its forward op
    ran on, so a stream set in the backward thread would do nothing: instead every forward of
    a stage (in every action, overlapped or not) runs on the stage's stream, and its backward
    follows it there. The stream first waits for the caller's (the received inputs, the
    schedule's work so far), the caller waits for it after (the sends, the loss), both by
    events, and the tensors handed back are recorded on the caller's stream, so the caching
    allocator does not reuse them early. The caller's stream is the current stream of the
    thread that runs the stage (`callers_stream` puts the backward strand's thread on the
    step's)."""

    streams: dict[int, Any] = {}
    for stage in schedule._stages:
        if torch.device(stage.device).type != "cuda":
            continue
        stream = streams[stage.stage_index] = torch.cuda.Stream(device=stage.device)
        stage.forward_one_chunk = _on_stream(stage.forward_one_chunk, stream,
                                             lambda mb, out: out)
        stage.backward_one_chunk = _on_stream(stage.backward_one_chunk, stream,
                                              lambda mb, out, st=stage: st.bwd_cache.get(mb))
    return streams


def _on_stream(run: Any, stream: Any, handed: Any) -> Any:
    """`run(mb, ...)` on `stream`, ordered after the caller's stream and before it by
    events; the tensors `handed(mb, out)` gives back are recorded on the caller's stream."""
    from torch.utils._pytree import tree_leaves

    def on_stream(mb: int, *args: Any, **kwargs: Any) -> Any:
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out = run(mb, *args, **kwargs)
        caller.wait_stream(stream)
        for t in tree_leaves(handed(mb, out)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)
        return out

    return on_stream


def callers_stream(device: torch.device) -> Callable[[], AbstractContextManager[None]]:
    """Taken on the calling thread: a context that puts another thread (the backward strand)
    on this thread's CUDA device and current stream. A new thread starts on device 0 and its
    default stream, whatever device and stream the step runs on. Nothing on a CPU."""
    if device.type != "cuda":
        return nullcontext
    caller = torch.cuda.current_stream(device)

    @contextmanager
    def on_it() -> Iterator[None]:
        with torch.cuda.device(device), torch.cuda.stream(caller):
            yield

    return on_it
