"""The two communication engines behind one interface.

- `CollectiveEngine`: torch.distributed collectives and P2P (NCCL/RCCL on GPU, gloo on CPU),
  issued asynchronously; the backend runs them on its own stream (GPU) or threads (gloo).
- `PeerCopyEngine`, the DMA path: every rank exposes a symmetric buffer its peers can read;
  data moves by plain copies out of peer memory, after the owner published it (a flag). On CUDA
  the buffer is a `torch.distributed._symmetric_memory` allocation and copies run on a side stream,
  which uses the copy engines and no SMs; on CPU the buffer is POSIX shared memory
  (`plait.runtime.shm`) and a copier thread stands in for the DMA engine. The compute thread never
  spins: it only waits on a handle, just before the consumer of the data.

Every handle's `wait()` has a timeout and says which peer did not arrive.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from plait import tracing
from plait.errors import InfeasibleError
from plait.runtime import strands
from plait.runtime.shm import HEADER_SLOTS, ShmSymmetricBuffer, wait_until


class Handle(Protocol):
    def wait(self) -> None: ...


class PeerEngine(Protocol):
    """A copy engine between the ranks of a group: every rank publishes blocks into its own
    symmetric buffer and pulls its peers' blocks out of theirs. A call is
    `begin` (buffer sized, safe to overwrite), `publish`/`pull` per block, `end` (our pulls are
    done: peers may reuse their buffers); `close` frees threads and buffers. Implemented by
    `PeerCopyEngine` (CPU), `CudaPeerCopyEngine` and `EmulatedLinkEngine`."""

    def begin(self, nbytes: int, slots: int = 1) -> None: ...

    def publish(self, slot: int, offset: int, src: torch.Tensor,
                readers: list[int] | None = None) -> None: ...

    def pull(self, peer: int, slot: int, offset: int, dst: torch.Tensor, what: str
             ) -> Handle: ...

    def end(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class WorkHandle:
    """Handles of torch.distributed async work.

    On a GPU waited without a timeout: NCCL's `wait()` only makes the current stream wait for
    the collective (the host goes on issuing), while `wait(timeout=...)` blocks the host thread
    until the collective completes; the process group's own timeout (NCCL's watchdog) bounds
    one that never completes. On a CPU the wait blocks the host anyway, and `timeout_s`, the
    runtime's own (shorter than the group's, as tests set it), bounds it."""

    works: list[dist.Work]
    timeout_s: float | None  # None: on a GPU (see above)
    what: str

    def wait(self) -> None:
        with strands.idle():  # another strand may compute meanwhile
            for w in self.works:
                try:
                    if self.timeout_s is None:
                        w.wait()
                    else:
                        w.wait(timeout=timedelta(seconds=self.timeout_s))
                except RuntimeError as exc:
                    within = "" if self.timeout_s is None else \
                        f" not complete within {self.timeout_s:.0f} s (a peer never arrived)"
                    raise TimeoutError(f"{self.what}:{within} {exc}") from exc
        self.works = []


# torch >= 2.13 names the tensor collectives *_single; older releases *_tensor.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveEngine:
    """Collective kernels / library P2P, asynchronous."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)

    def handle(self, works: list[dist.Work], on: torch.Tensor, what: str) -> WorkHandle:
        """The handle of `works` moving `on`'s kind of tensor: on a GPU never waited with a
        host-blocking timeout (`WorkHandle`)."""
        return WorkHandle(works, None if on.device.type != "cpu" else self.timeout_s, what)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """`out` is (P, *inp.shape) or (P * inp.shape[0], ...)."""
        if out.dim() == inp.dim() + 1:
            out = out.flatten(0, 1)
        w = all_gather_tensor(_moved(out), _moved(inp), group=self.group, async_op=True)
        return self.handle([w], inp, what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Row chunk q of `inp` goes to rank q; `out`'s chunk q comes from rank q."""
        w = dist.all_to_all_single(_moved(out), _moved(inp), group=self.group, async_op=True)
        return self.handle([w], inp, what)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        w = reduce_scatter_tensor(out, inp, group=self.group, async_op=True)
        return self.handle([w], inp, what)

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                 what: str) -> Handle:
        ops = [dist.P2POp(dist.isend, _moved(send), self._global(dst), self.group),
               dist.P2POp(dist.irecv, _moved(recv), self._global(src), self.group)]
        return self.handle(list(dist.batch_isend_irecv(ops)), send, what)


_BYTES_ONLY = (torch.float8_e4m3fn, torch.float8_e5m2)  # moved as bytes: backends (gloo)
# need not know FP8 to move it, only to reduce it


def _moved(t: torch.Tensor) -> torch.Tensor:
    """`t` as the bytes a collective moves when the backend needs not know its type."""
    return t.view(torch.uint8) if t.dtype in _BYTES_ONLY else t


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@dataclass
class EventHandle:
    """A copy issued on a side CUDA stream: waiting makes the current stream wait for it (the
    host does not block)."""

    event: torch.cuda.Event
    device: torch.device  # whose current stream waits (not the thread's current device)

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


@dataclass
class CopyJob:
    ready: Callable[[], bool]
    copy: Callable[[], None]
    what: str
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # the submitting thread's inference mode (thread-local in torch): the copier runs the copy
    # under the same one, so inference tensors of a `torch.inference_mode()` caller can be
    # written to
    inference: bool = field(default_factory=torch.is_inference_mode_enabled)


@dataclass
class CopyHandle:
    job: CopyJob
    timeout_s: float

    def wait(self) -> None:
        with strands.idle():
            done = self.job.done.wait(self.timeout_s * 1.5)
        if not done:
            raise TimeoutError(f"{self.job.what} did not complete within {self.timeout_s:.0f} s")
        if self.job.error is not None:
            raise self.job.error


class Copier:
    """One thread executing copy jobs in order: the CPU stand-in for a DMA engine queue."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.jobs: queue.Queue[CopyJob | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="plait-copier", daemon=True)
        self.thread.start()

    def submit(self, job: CopyJob) -> CopyHandle:
        self.jobs.put(job)
        return CopyHandle(job, self.timeout_s)

    def _run(self) -> None:
        torch.set_num_threads(1)
        while (job := self.jobs.get()) is not None:
            try:
                wait_until(job.ready, self.timeout_s, f"{job.what}: peer publishing its data")
                with (torch.inference_mode(job.inference),
                      record_function(tracing.copy_range(job.what))):  # `plait analyze` reads it
                    job.copy()
            except BaseException as exc:
                job.error = exc
            job.done.set()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class PeerCopyEngine:
    """Pull copies from peers' symmetric buffers (CPU: shared memory + copier thread).

    The buffer has two halves used by alternate calls, so a call starts without waiting for
    the peers to finish reading the previous one: only the call before that, which used the
    same half (a peer cannot publish call e + 2 before everyone finished reading call e)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.buffer: ShmSymmetricBuffer | None = None
        self.copier = Copier(timeout_s)
        self.epoch = 0

    def _half(self) -> int:
        """Byte offset of this call's half of the data area."""
        assert self.buffer is not None
        return (self.epoch % 2) * (self.buffer.nbytes // 2)

    def begin(self, nbytes: int, slots: int = 1) -> None:
        """Start a call that publishes up to `nbytes` in `slots` flagged blocks."""
        if slots > HEADER_SLOTS:
            raise InfeasibleError(f"{slots} blocks to publish exceed the copy engine's "
                                  f"{HEADER_SLOTS} flags: use fewer sub-chunks (ranks x chunks "
                                  f"<= {HEADER_SLOTS})")
        if self.buffer is None or self.buffer.nbytes // 2 < nbytes:
            if self.buffer is not None:  # every peer must be done with both halves
                self.buffer.wait_peers_done(self.epoch, self.timeout_s)
                self.buffer.close()
            self.buffer = ShmSymmetricBuffer(self.group, 2 * max(nbytes, 1 << 20),
                                             self.timeout_s)
            self.epoch = 0
        elif self.epoch >= 1:  # our half is about to be overwritten: peers read it last call
            self.buffer.wait_peers_done(self.epoch - 1, self.timeout_s)  # but one
        self.epoch += 1

    def publish(self, slot: int, offset: int, src: torch.Tensor,
                readers: list[int] | None = None) -> None:
        """Write `src` into our buffer at byte `offset` and flag `slot` for this epoch.

        `readers` (the peers that will pull it) matters on CUDA, where a signal goes to each;
        here an epoch flag serves every reader."""
        assert self.buffer is not None
        self.buffer.data(self.rank, self._half() + offset, tuple(src.shape),
                         src.dtype).copy_(src)
        self.buffer.publish(slot, self.epoch)

    def pull(self, peer: int, slot: int, offset: int, dst: torch.Tensor, what: str) -> Handle:
        """Copy from `peer`'s buffer at byte `offset` into `dst` once it published `slot`."""
        buf, epoch = self.buffer, self.epoch
        assert buf is not None
        src = buf.data(peer, self._half() + offset, tuple(dst.shape), dst.dtype)
        return self.copier.submit(CopyJob(lambda: buf.published(peer, slot) >= epoch,
                                           functools.partial(copy_into, dst, src), what))

    def end(self) -> None:
        """All our pulls of this call are done: peers may reuse their buffers."""
        assert self.buffer is not None
        self.buffer.finish_reading(self.epoch)

    def close(self) -> None:
        self.copier.close()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
