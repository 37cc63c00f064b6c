"""Symmetric memory on a CPU host: one POSIX shared-memory segment per rank, mapped by all.

Every rank creates a segment with an unguessable name (mode 0600, private to the user), the names
are exchanged through the process group, every rank maps every peer's segment, and after a
barrier each creator unlinks its name. From then on nothing is left in /dev/shm whatever happens
to the processes: the memory lives only as long as some rank maps it. Between creation and that
barrier Python's resource tracker, a separate process, unlinks the segment if its rank dies; the
creator alone registers it there (peers map it without Python's SharedMemory, so the name is
registered and unregistered once, also when every rank shares one tracker under spawn). If the
whole job, tracker included, is killed in that window, the name carries the creator's pid and
the next buffer made on the host unlinks segments whose creator is gone.

Layout of a segment: a header of int64 flags, then the data area.
    header[0]      the last epoch (call number) this rank finished reading from its peers
    header[1 + s]  the epoch in which slot s of the data area was last published
"""

from __future__ import annotations

import _posixshmem
import contextlib
import functools
import glob
import mmap
import os
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from plait.runtime import strands

HEADER_SLOTS = 4096
_NAME_BYTES = 64  # a segment name on the wire: plait_<pid>_<32 hex digits>, zero-padded
_HEADER_BYTES = 8 * (1 + HEADER_SLOTS)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Sleep-poll (2 us doubling to 1 ms) until `predicate()`; TimeoutError names `what`."""
    if predicate():
        return
    deadline = time.monotonic() + timeout_s
    delay = 2e-6
    with strands.idle():  # another strand may compute meanwhile
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


class _Mapped:
    """A peer's segment mapped without Python's SharedMemory (which would register the name
    with this process's resource tracker: only its creator may)."""

    def __init__(self, name: str) -> None:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    def close(self) -> None:
        self.buf.release()
        self._map.close()


def _unlink_orphans() -> None:
    """Unlink the segments whose creating process is gone (a whole job killed while setting
    up its buffers, resource tracker included)."""
    for path in glob.glob("/dev/shm/plait_*_*"):
        pid = os.path.basename(path).split("_")[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            _posixshmem.shm_unlink("/" + os.path.basename(path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _exchange_names(group: dist.ProcessGroup, name: str, world: int, timeout_s: float
                    ) -> list[str]:
    """Every rank's segment name, waiting at most `timeout_s`. Names differ in length (the
    creators' pids), so each travels zero-padded to `_NAME_BYTES`: every rank sends the same
    size, as an all-gather requires."""
    raw = name.encode()
    if len(raw) > _NAME_BYTES:
        raise ValueError(f"segment name {name!r} longer than {_NAME_BYTES} bytes")
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    with strands.idle():
        dist.all_gather(out, mine, group=group, async_op=True).wait(
            timeout=timedelta(seconds=timeout_s))
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in out]


class ShmSymmetricBuffer:
    """Every rank's segment, mapped; `local()` / `peer(rank)` views of the data area."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, timeout_s: float = 60.0) -> None:
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.nbytes = nbytes
        _unlink_orphans()
        name = f"plait_{os.getpid()}_{secrets.token_hex(16)}"
        own = shared_memory.SharedMemory(name=name, create=True, size=_HEADER_BYTES + nbytes)
        self.name, self.mode = name, os.fstat(own._fd).st_mode & 0o777  # type: ignore[attr-defined]
        self._segments: list[shared_memory.SharedMemory | _Mapped] = []
        try:
            names = _exchange_names(group, name, self.world, timeout_s)
            for r, n in enumerate(names):
                self._segments.append(own if r == self.rank else _Mapped(n))
            with strands.idle():
                dist.barrier(group=group, async_op=True).wait(
                    timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise TimeoutError(f"rank {self.rank}: setting up symmetric memory needs every rank "
                               f"of the group; a peer did not join within {timeout_s:.0f} s: "
                               f"{exc}") from exc
        finally:
            own.unlink()  # mapped everywhere (or failed): the name is no longer needed
        self._headers = [np.ndarray((1 + HEADER_SLOTS,), np.int64, buffer=s.buf)
                         for s in self._segments]
        self._headers[self.rank][:] = 0

    def data(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype
             ) -> torch.Tensor:
        """A tensor view of `rank`'s data area at byte `offset`."""
        n = int(np.prod(shape)) if shape else 1
        if n == 0:  # nothing to map (an empty block)
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._segments[rank].buf, dtype=dtype, count=n,
                                offset=_HEADER_BYTES + offset).view(shape)

    def publish(self, slot: int, epoch: int) -> None:
        """Mark own slot as holding epoch `epoch`'s data (after the data was written)."""
        self._headers[self.rank][1 + slot] = epoch

    def published(self, rank: int, slot: int) -> int:
        return int(self._headers[rank][1 + slot])

    def finish_reading(self, epoch: int) -> None:
        self._headers[self.rank][0] = epoch

    def wait_peers_done(self, epoch: int, timeout_s: float) -> None:
        """Block until every peer finished reading from us in `epoch` (buffer reuse is safe)."""
        for r in range(self.world):
            if r != self.rank:
                wait_until(functools.partial(self._reached, r, epoch), timeout_s,
                           f"rank {r} finishing call {epoch}")

    def _reached(self, rank: int, epoch: int) -> bool:
        return int(self._headers[rank][0]) >= epoch

    def close(self) -> None:
        self._headers = []
        for s in self._segments:
            with contextlib.suppress(BufferError):  # a view still exists: unmapped at exit
                s.close()
        self._segments = []
