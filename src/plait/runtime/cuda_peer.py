"""The peer-copy (DMA) engine on CUDA: symmetric memory and copies on a side stream.

Same interface and protocol as the CPU `PeerCopyEngine`: `begin` (size the buffer, make reuse
safe), `publish` (write a block into our buffer, signal the peers that read it), `pull` (on the
copy stream: wait for the owner's signal, copy out of its buffer), `end` (barrier so buffers can be
reused). `copy_` between device buffers on a stream that runs no kernels is carried out by the
copy engines, so these transfers take no SMs. Guarded: imported only when a CUDA tensor asks for
the DMA engine; CPU-only CI never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.errors import InfeasibleError
from plait.runtime.engines import EventHandle

if TYPE_CHECKING:
    from torch._C._distributed_c10d import _SymmetricMemory


class CudaPeerCopyEngine:
    """`PeerEngine` on CUDA."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group, self.timeout_s, self.device = group, timeout_s, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device=device)
        self.buffer: torch.Tensor | None = None
        self.handle: _SymmetricMemory | None = None
        self.signalled: set[tuple[int, int]] = set()
        self.epoch = 0

    def begin(self, nbytes: int, slots: int = 1) -> None:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = self.symm_mem.empty(max(nbytes, 1 << 20), dtype=torch.uint8,
                                              device=self.device)
            self.handle = self.symm_mem.rendezvous(self.buffer, self.group)
        assert self.handle is not None
        if slots > self.handle.signal_pad_size // (4 * self.world):
            raise InfeasibleError(f"{slots} blocks to publish exceed the signal channels of "
                                  "the symmetric buffer; use fewer sub-chunks")
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
        if slot >= self.handle.signal_pad_size // (4 * self.world):
            raise InfeasibleError(f"slot {slot} exceeds the signal channels of the symmetric "
                                  "buffer; use fewer chunks")
        self._view(self.rank, offset, src).copy_(src)
        for peer in readers if readers is not None else range(self.world):
            if peer != self.rank:
                self.handle.put_signal(peer, channel=slot, timeout_ms=int(self.timeout_s * 1e3))

    def pull(self, peer: int, slot: int, offset: int, dst: torch.Tensor, what: str) -> EventHandle:
        assert self.handle is not None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if (peer, slot) not in self.signalled:  # a signal is consumed by its first wait
                self.handle.wait_signal(peer, channel=slot, timeout_ms=int(self.timeout_s * 1e3))
                self.signalled.add((peer, slot))
            dst.copy_(self._view(peer, offset, dst))
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return EventHandle(ev)

    def end(self) -> None:
        assert self.handle is not None
        torch.cuda.current_stream().wait_stream(self.stream)
        self.handle.barrier(channel=0, timeout_ms=int(self.timeout_s * 1e3))

    def close(self) -> None:
        self.buffer, self.handle = None, None
