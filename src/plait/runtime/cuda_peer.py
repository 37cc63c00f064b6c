"""The peer-copy (DMA) engine on CUDA: symmetric memory and copies on a side stream.

Same interface and protocol as the CPU `PeerCopyEngine`: `begin` (size the buffer, make reuse
safe), `publish` (write a block into our buffer, signal the peers that read it), `pull` (on the
copy stream: wait for the owner's signal, copy out of its buffer), `end` (barrier so buffers can be
reused). `copy_` between device buffers on a stream that runs no kernels is carried out by the
copy engines, so these transfers take no SMs. Guarded: imported only when a CUDA tensor asks for
the DMA engine; CPU-only CI never loads it.

Signal channels, as PyTorch's own fused ops keep them: channel 0 is the closing barrier's, block
`slot` is published on channel `slot + 1`. The device-side waits never time out (timeout 0, as
PyTorch passes): a signal kernel that times out traps and takes the CUDA context with it, so a
rank late by a checkpoint save or a first-step compile would kill the job. A rank that never
comes is caught on the host, by the first call's check (`Runtime.check_same`) and the group's
own timeout.

Buffer reuse is ordered across streams: `end` records an event after its barrier (every peer
has read our buffer then), and the next call's stream waits for it before it overwrites the
buffer or signals, whatever stream either call ran on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plait.errors import InfeasibleError, SpecError
from plait.runtime.engines import EventHandle

if TYPE_CHECKING:
    from torch._C._distributed_c10d import _SymmetricMemory

BARRIER_CHANNEL = 0  # the closing barrier's; block `slot` signals on channel `slot + 1`
NO_DEVICE_TIMEOUT = 0  # device-side waits spin until signalled: they never trap


class CudaPeerCopyEngine:
    """`PeerEngine` on CUDA. `cuda` and `symm_mem` are `torch.cuda` and PyTorch's symmetric
    memory, or stand-ins that record what they are asked (the CPU tests)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, device: torch.device,
                 cuda: Any = None, symm_mem: Any = None) -> None:
        if symm_mem is None:
            import torch.distributed._symmetric_memory as symm_mem
        self.cuda = torch.cuda if cuda is None else cuda
        self.symm_mem = symm_mem
        self.group, self.timeout_s, self.device = group, timeout_s, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.stream = self.cuda.Stream(device=device)
        self.buffer: torch.Tensor | None = None
        self.handle: _SymmetricMemory | None = None
        self.signalled: set[tuple[int, int]] = set()
        self.epoch = 0
        # recorded after the last call's closing barrier (on the stream that call ran on),
        # and whether inside a CUDA-graph capture
        self.reusable: Any = None
        self.reusable_captured = False

    def _current(self) -> Any:
        return self.cuda.current_stream(self.device)

    def channels(self) -> int:
        """Signal channels of the symmetric buffer (one 32-bit flag per rank each)."""
        assert self.handle is not None
        return int(self.handle.signal_pad_size) // (4 * self.world)

    def begin(self, nbytes: int, slots: int = 1) -> None:
        capturing = bool(self.cuda.is_current_stream_capturing())
        if self.buffer is None or self.buffer.numel() < nbytes:
            if capturing:
                raise SpecError("CUDA graph", f"a /dma call needs a symmetric buffer of "
                                f"{nbytes} bytes, which it allocates on its first call (a "
                                "collective rendezvous, not capturable)",
                                "warm up: run the step once with these shapes before capture")
            if self.reusable is not None:  # every peer has read the old buffer
                self.reusable.synchronize()
            self.buffer = self.symm_mem.empty(max(nbytes, 1 << 20), dtype=torch.uint8,
                                              device=self.device)
            self.handle = self.symm_mem.rendezvous(self.buffer, self.group)
        if slots + 1 > self.channels():
            raise InfeasibleError(f"{slots} blocks to publish exceed the {self.channels() - 1} "
                                  "signal channels of the symmetric buffer; use fewer sub-chunks")
        # Inside a capture an event recorded outside it cannot be waited on; capture begins
        # after a device synchronize (torch.cuda.graph), which the last call preceded.
        if self.reusable is not None and (self.reusable_captured or not capturing):
            self._current().wait_event(self.reusable)
        self.signalled.clear()
        self.epoch += 1

    def _view(self, rank: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        assert self.handle is not None
        if offset % like.element_size():
            raise InfeasibleError(f"misaligned symmetric buffer offset {offset}")
        view: torch.Tensor = self.handle.get_buffer(
            rank, tuple(like.shape), like.dtype, storage_offset=offset // like.element_size())
        return view

    def publish(self, slot: int, offset: int, src: torch.Tensor,
                readers: list[int] | None = None) -> None:
        assert self.handle is not None
        if slot + 1 >= self.channels():
            raise InfeasibleError(f"slot {slot} exceeds the signal channels of the symmetric "
                                  "buffer; use fewer chunks")
        self._view(self.rank, offset, src).copy_(src)
        for peer in readers if readers is not None else range(self.world):
            if peer != self.rank:
                self.handle.put_signal(peer, channel=slot + 1, timeout_ms=NO_DEVICE_TIMEOUT)

    def pull(self, peer: int, slot: int, offset: int, dst: torch.Tensor, what: str) -> EventHandle:
        assert self.handle is not None
        self.stream.wait_stream(self._current())
        with self.cuda.stream(self.stream):
            if (peer, slot) not in self.signalled:  # a signal is consumed by its first wait
                self.handle.wait_signal(peer, channel=slot + 1, timeout_ms=NO_DEVICE_TIMEOUT)
                self.signalled.add((peer, slot))
            dst.copy_(self._view(peer, offset, dst))
            ev = self.cuda.Event()
            ev.record(self.stream)
        return EventHandle(ev, self.device)

    def end(self) -> None:
        assert self.handle is not None
        current = self._current()
        current.wait_stream(self.stream)
        self.handle.barrier(channel=BARRIER_CHANNEL, timeout_ms=NO_DEVICE_TIMEOUT)
        self.reusable = self.cuda.Event()
        self.reusable.record(current)
        self.reusable_captured = bool(self.cuda.is_current_stream_capturing())

    def close(self) -> None:
        self.buffer, self.handle, self.reusable = None, None, None
