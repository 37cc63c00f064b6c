"""Per-process-group runtime state: engines, and the record of what actually ran."""

from __future__ import annotations

import weakref
import zlib
from array import array
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from plait import tracing
from plait.errors import SpecError
from plait.runtime import strands
from plait.runtime.engines import CollectiveEngine, PeerCopyEngine, PeerEngine
from plait.runtime.launch import group_backend, group_device, group_timeout_s
from plait.schedule.schedule import Engine


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call of an overlapped op: which schedule ran, on which engine, on what."""

    op: str
    schedule: str
    engine: str
    shapes: tuple[tuple[int, ...], ...]
    world: int
    label: str = ""  # which call: e.g. "ag_mm" (forward) or "mm_rs.bwd" (a backward pass)

    def __str__(self) -> str:
        return f"{self.label:10s} {self.op:22s} {self.schedule:18s} {self.engine}"


class CallLog(list[CallRecord]):
    """A group's call records, newest last, bounded: past `KEEP` records the oldest half is
    dropped, so a long training job's log does not grow without end."""

    KEEP = 100_000

    def append(self, record: CallRecord) -> None:
        super().append(record)
        if len(self) > self.KEEP:
            del self[: self.KEEP // 2]


class Group(Protocol):
    """What the executors need of a group: a `Runtime` (a real process group) or an
    `EmulatedGroup` (one device standing in for a group, `plait.runtime.emulated`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def verify_shapes(self) -> bool: ...

    @property
    def records(self) -> list[CallRecord]: ...

    def collective(self) -> CollectiveEngine: ...

    def peer(self, device: torch.device) -> PeerEngine: ...

    def engine_name(self, engine: Engine, device: torch.device) -> str: ...

    def check_same(self, op: str, signature: list[int], describe: str) -> None: ...


@dataclass
class Runtime:
    """Engines and records of one process group; one per group (see `runtime_of`)."""

    group: dist.ProcessGroup
    # how long a host wait gives a peer; 0: the group's own timeout (`group_timeout_s`), so a
    # rank late by a checkpoint save or a first-step compile is waited for as its collectives
    # would be
    timeout_s: float = 0.0
    verify_shapes: bool = True  # check that every rank makes the same call (`check_same`)
    verify_every_call: bool = False  # ... on every call, not only a signature's first
    records: list[CallRecord] = field(default_factory=CallLog)
    _collective: CollectiveEngine | None = None
    _peer: PeerEngine | None = None
    _verified: set[tuple[str, int, int]] = field(default_factory=set)  # (op, length, crc)
    _backend: str | None = None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            self.timeout_s = group_timeout_s(self.group)

    @property
    def backend(self) -> str:
        """The backend of the group's collectives on this rank ("gloo", "nccl", ...; see
        `group_backend`), asked once."""
        if self._backend is None:
            self._backend = group_backend(self.group)
        return self._backend

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def collective(self) -> CollectiveEngine:
        if self._collective is None:
            self._collective = CollectiveEngine(self.group, self.timeout_s)
        return self._collective

    def peer(self, device: torch.device) -> PeerEngine:
        """The copy engine for tensors on `device` (CPU: shared memory and a copier thread;
        CUDA: symmetric memory and a copy stream), created on first use."""
        if device.type != "cpu":
            from plait.runtime.cuda_peer import CudaPeerCopyEngine

            if not isinstance(self._peer, CudaPeerCopyEngine):
                self._peer = CudaPeerCopyEngine(self.group, self.timeout_s, device)
            return self._peer
        if not isinstance(self._peer, PeerCopyEngine):
            self._peer = PeerCopyEngine(self.group, self.timeout_s)
        return self._peer

    def engine_name(self, engine: Engine, device: torch.device) -> str:
        if self.world == 1:
            return "local (group of one rank: no communication)"
        if engine is Engine.SM:
            return f"collective({self.backend})"
        return "peer_copy(cuda symmetric memory)" if device.type == "cuda" else \
            "peer_copy(shm + copier thread)"

    def check_same(self, op: str, signature: list[int], describe: str) -> None:
        """Fail clearly (never hang) when ranks call `op` with different shapes/schedules.

        A signature is checked the first time this rank calls it on the group (and on every
        call with `verify_every_call`): a check is a collective round trip, and on a GPU a
        host synchronization, too dear for every call of a training step. A rank repeating
        a checked call while another makes a new one is not caught here: their collectives
        then mismatch, and fail or time out."""
        if not self.verify_shapes or self.world == 1:
            return
        digest = (op, len(signature), zlib.crc32(array("q", signature).tobytes()))
        if digest in self._verified and not self.verify_every_call:
            return
        if capturing():
            raise SpecError(f"{op} (CUDA graph)", "a call's first check with these shapes is "
                            "a host exchange between ranks, which a CUDA graph cannot capture",
                            "warm up: run the step once with these shapes before capture")
        mine = torch.tensor(signature, dtype=torch.int64)
        with record_function(tracing.check_range(op)):  # `plait analyze` labels it plait's
            self._check_same(op, mine, digest[1:], describe)
        self._verified.add(digest)

    def _check_same(self, op: str, mine: torch.Tensor, digest_: tuple[int, int],
                    describe: str) -> None:
        """One small exchange (the signature's length and checksum); only when ranks differ,
        a second one of the whole signatures, to say how."""
        digest = torch.tensor(digest_, dtype=torch.int64)
        digests = [torch.empty_like(digest) for _ in range(self.world)]
        self._gather(digests, digest)
        if all(torch.equal(d, digests[0]) for d in digests):
            return
        n = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(n) for _ in range(self.world)]
        self._gather(sizes, n)
        width = int(max(int(s) for s in sizes))
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: mine.numel()] = mine
        allsig = [torch.empty_like(padded) for _ in range(self.world)]
        self._gather(allsig, padded)
        for r, sig in enumerate(allsig):
            if not torch.equal(sig, allsig[0]):
                raise SpecError(f"{op} (rank {r})", f"ranks disagree: rank 0 passed "
                                f"{_fmt(allsig[0])}, rank {r} passed {_fmt(sig)} ({describe})",
                                "call the op with the same shapes, dtypes and schedule on "
                                "every rank of the group")

    @property
    def device(self) -> torch.device:
        """Where the group's small exchanges live: this rank's GPU under a GPU backend (NCCL),
        else the CPU."""
        return group_device(self.group)

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (one length on every rank), in group rank order."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))
        return [[int(x) for x in t.cpu()] for t in out]

    def slowest(self, values: list[float]) -> list[float]:
        """Each of `values` as its largest over the group's ranks."""
        x = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._wait(dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return [float(v) for v in x.cpu()]

    def barrier(self) -> None:
        """Every rank of the group here before any goes on (one small collective)."""
        self._wait(dist.barrier(group=self.group, async_op=True))

    def _gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        dev = self.device
        moved = [torch.empty_like(t, device=dev) for t in out]
        self._wait(dist.all_gather(moved, inp.to(dev), group=self.group, async_op=True))
        for o, m in zip(out, moved, strict=True):
            o.copy_(m)

    def _wait(self, work: dist.Work | None) -> None:
        try:
            with strands.idle():
                assert work is not None
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TimeoutError(f"rank {self.rank}: not every rank of the group joined within "
                               f"{self.timeout_s:.0f} s (a peer never arrived, or it is calling "
                               f"a different op): {exc}") from exc

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None


def capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a graph (never
    initializes CUDA to ask)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized()
                and torch.cuda.is_current_stream_capturing())


def _fmt(sig: torch.Tensor) -> str:
    return str([int(x) for x in sig if int(x) != -1])


# A group as plait's ops and layers take it: a process group, its c10d name, a `DeviceMesh` of
# one dimension, `(mesh, dim)`, a `Runtime` of one's own, or None (the world group).
GroupLike = dist.ProcessGroup | Runtime | str | DeviceMesh | tuple[DeviceMesh, int] | None

_RUNTIMES: dict[str, Runtime] = {}  # group name -> runtime (engines hold threads and buffers)
# Runtimes made by hand (their own timeout, say), by the key `group_key` gave them
_OWN_RUNTIMES: weakref.WeakValueDictionary[str, Runtime] = weakref.WeakValueDictionary()


def group_key(group: GroupLike) -> str:
    """The text a custom op names `group` by: a process group's c10d name (the world group's
    for None; a name passes as it is; a `DeviceMesh` gives its group, `(mesh, dim)` that
    dimension's), or, for a `Runtime` of one's own, a key registered for as long as it
    lives."""
    if isinstance(group, Runtime):
        key = f"plait-runtime-{id(group)}"
        _OWN_RUNTIMES[key] = group
        return key
    if isinstance(group, str):
        return group
    return str(_process_group(group).group_name)


def _process_group(group: dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int] | None
                   ) -> dist.ProcessGroup:
    if isinstance(group, tuple):
        mesh, dim = group
        group = mesh.get_group(dim)
    elif group is not None and not isinstance(group, dist.ProcessGroup):  # a DeviceMesh
        if group.ndim != 1:
            raise SpecError("group", f"a {group.ndim}-d DeviceMesh names no single group",
                            "pass (mesh, dim) or mesh[dim_name]")
        group = group.get_group()
    pg = group or dist.group.WORLD
    if pg is None:
        raise SpecError("group", "torch.distributed is not initialized",
                        "call torch.distributed.init_process_group (or run under torchrun)")
    assert isinstance(pg, dist.ProcessGroup)
    return pg


def runtime_of(group: GroupLike) -> Runtime:
    """The runtime of `group`, in any form `GroupLike` names (default: the world group),
    created on first use: the one lookup of plait's ops, layers and tools."""
    if isinstance(group, Runtime):
        return group
    if isinstance(group, str):
        own = _OWN_RUNTIMES.get(group)
        if own is not None:
            return own
        from torch.distributed import distributed_c10d as c10d

        pg = c10d._resolve_process_group(group)  # type: ignore[attr-defined,arg-type]
    else:
        pg = _process_group(group)
    key = pg.group_name
    cached = _RUNTIMES.get(key)
    if cached is not None and cached.group is not pg:
        # A process group re-initialized under the same name: the old runtime's engines
        # belong to a group that no longer exists.
        cached.close()
        cached = None
    if cached is None:
        cached = _RUNTIMES[key] = Runtime(pg)
    return cached


def close_all() -> None:
    """Stop copier threads and unmap buffers (call before destroy_process_group)."""
    for rt in _RUNTIMES.values():
        rt.close()
    _RUNTIMES.clear()
