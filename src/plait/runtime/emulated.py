"""One device standing in for a group: the other ranks are virtual, their shards live in host
memory, and the "link" is a host-to-device copy (on a GPU: pinned memory copied on a side
stream by the copy engines, at roughly one GPU-GPU link's speed). The finer-grain schedules then
run on real hardware with a single device, through the same executor as the real group
(`plait.runtime.execute`), so the simulator's predictions can be checked without a second GPU.

Only the peer-copy (DMA) schedules of the all-gather side run here: there are no collective
kernels between virtual ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from plait.errors import InfeasibleError
from plait.runtime.context import CallLog, CallRecord
from plait.runtime.engines import CollectiveEngine, Copier, CopyJob, EventHandle, Handle, copy_into
from plait.schedule.schedule import Engine


class EmulatedLinkEngine:
    """Pulls a virtual peer's block out of host memory: a side stream (CUDA) or a copier thread
    (CPU) does the copy; the compute side waits on the returned handle only."""

    def __init__(self, host_shards: list[torch.Tensor], device: torch.device,
                 timeout_s: float) -> None:
        self.host = [s.contiguous().view(torch.uint8).view(-1) for s in host_shards]
        self.device = device
        if device.type == "cuda":
            self.host = [h.pin_memory() for h in self.host]
            self.stream = torch.cuda.Stream(device=device)
        else:
            self.copier = Copier(timeout_s)
        self.timeout_s = timeout_s

    def begin(self, nbytes: int, slots: int = 1) -> None:
        """Virtual peers never overwrite their shards: nothing to wait for."""

    def publish(self, slot: int, offset: int, src: torch.Tensor,
                readers: list[int] | None = None) -> None:
        """Our own shard is already on the device: nothing to publish."""

    def pull(self, peer: int, slot: int, offset: int, dst: torch.Tensor, what: str) -> Handle:
        n = dst.numel() * dst.element_size()
        src = self.host[peer - 1][offset:offset + n].view(dst.dtype).view(dst.shape)
        if self.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            return EventHandle(ev, self.device)
        job = CopyJob(lambda: True, functools.partial(copy_into, dst, src), what)
        return self.copier.submit(job)

    def end(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        if self.device.type != "cuda":
            self.copier.close()


@dataclass
class EmulatedGroup:
    """What the executor needs of a runtime: rank 0 of `world` ranks, ranks 1.. virtual."""

    world: int
    engine: EmulatedLinkEngine
    rank: int = 0
    verify_shapes: bool = False
    records: list[CallRecord] = field(default_factory=CallLog)

    def peer(self, device: torch.device) -> EmulatedLinkEngine:
        return self.engine

    def collective(self) -> CollectiveEngine:
        raise InfeasibleError("an emulated link has no collective kernels between virtual "
                              "ranks: use the /dma schedules")

    def engine_name(self, engine: Engine, device: torch.device) -> str:
        return "emulated link: host-to-device copies (copy engines)" if device.type == "cuda" \
            else "emulated link: host copies (copier thread)"

    def check_same(self, op: str, signature: list[int], describe: str) -> None:
        """One real rank: nothing to compare."""


def emulated_group(world: int, a_shard: torch.Tensor, chunks: int, seed: int = 0,
                   timeout_s: float = 60.0) -> tuple[EmulatedGroup, list[torch.Tensor]]:
    """A group of `world` with virtual peers holding random shards like `a_shard` (rows split
    in `chunks` blocks, block-major as the peer-copy protocol publishes them). Returns the group
    and the virtual peers' shards (for references)."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(a_shard.shape, generator=g, dtype=torch.float64).to(a_shard.dtype)
              for _ in range(world - 1)]
    engine = EmulatedLinkEngine(shards, a_shard.device, timeout_s)
    return EmulatedGroup(world, engine), shards
