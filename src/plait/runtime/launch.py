"""Start N local ranks on CPU with gloo (tests, `plait bench`), with a hard timeout; or join the
ranks torchrun started (`init_from_env`).

Each rank is a forked process with one intra-op thread (one core per rank), a gloo process group
whose collectives time out after `timeout_s`, and its result or exception sent back to the
parent. A rank that hangs or dies is reported as an error naming the rank; the others are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, Store

from plait.errors import InfeasibleError, SpecError


def init_from_env(timeout_s: float = 300.0) -> torch.device:
    """Join the process group torchrun describes in the environment (NCCL on GPUs, one per
    local rank; gloo on CPUs) unless already joined; return this rank's device."""
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return rank_device()


def leave_group(store: Store | None = None, timeout_s: float = 300.0) -> None:
    """Every rank reaches this point, then the process group is torn down. Without waiting, a
    rank that finishes first closes its gloo connections while a slower peer is still using
    them (still completing the connection mesh of `init_process_group`, or reading the last
    collective's data): the peer fails with "Connection closed by peer", or aborts at exit.
    Call it once at the end of every rank's work (run_ranks' ranks do, and the torchrun paths).

    With `store` the ranks meet through it, which works even when a collective of this group
    timed out (its connections can no longer be trusted); otherwise through a barrier."""
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1 and store is not None:
        if store.add("plait/leaving", 1) == world:
            store.set("plait/left", "1")
        store.wait(["plait/left"], timedelta(seconds=timeout_s))
    elif world > 1:
        dist.barrier()
    dist.destroy_process_group()


def run_main(main: Callable[[], None]) -> None:
    """Run a torchrun script's `main`: bad input (`SpecError`, `InfeasibleError`) is one line
    on stderr and exit status 2, never a traceback per rank. Rank 0 prints its error at once;
    another rank waits a few seconds first, time for torchrun to stop it when rank 0 failed
    too (the usual case: every rank reads the same input), so the line appears once, and a
    rank's own error still appears when rank 0 had none."""
    try:
        main()
    except (SpecError, InfeasibleError) as exc:
        rank = int(os.environ.get("RANK", "0"))
        if rank:
            time.sleep(5.0)
        print(f"error: {'' if rank == 0 else f'rank {rank}: '}{exc}", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None


def rank_device() -> torch.device:
    """The device this rank's tensors live on: its GPU when the group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and what happened."""


def _remove_orphaned_rendezvous() -> None:
    """Remove the rendezvous folders of `run_ranks` parents that were killed (their ranks died
    with them, `_die_with_parent`; the folder stayed)."""
    import glob

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "plait-ranks-*-*")):
        pid = os.path.basename(folder).split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            continue


def _die_with_parent() -> None:
    """Linux: this rank is killed when the process that started it dies (a killed parent
    leaves no orphaned ranks running on). Elsewhere nothing changes."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _child(rank: int, world: int, store: str, timeout_s: float, fn: Callable[..., Any],
           args: tuple[Any, ...], queue: Any, with_report: bool) -> None:
    try:
        _die_with_parent()
        torch.set_num_threads(1)
        meeting = FileStore(store, world)
        dist.init_process_group("gloo", store=meeting, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        kwargs = {"report": lambda msg: queue.put((rank, None, msg))} if with_report else {}
        try:
            result = fn(rank, world, *args, **kwargs)
        except BaseException:
            dist.destroy_process_group()  # the others may never arrive: no barrier
            raise
        leave_group(meeting, timeout_s)
        # Plain pickle, by value: torch's queue pickler would pass tensors as shared-memory
        # handles that die with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # report everything, including assertion failures
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
              collective_timeout_s: float | None = None,
              progress: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` forked gloo ranks; return their results by rank.

    Forked, so closures work. With `progress`, `fn` also gets `report=`, and whatever a rank
    reports reaches `progress(rank, message)` in the parent while the ranks run. Raises
    `RankError` if a rank raises, dies, or the whole run exceeds `timeout_s`.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    # Rendezvous through a fresh file, not a TCP port: a port found free can be taken by
    # another process before the ranks bind it.
    _remove_orphaned_rendezvous()
    store_dir = tempfile.mkdtemp(prefix=f"plait-ranks-{os.getpid()}-")
    store = os.path.join(store_dir, "store")
    ctimeout = collective_timeout_s or max(5.0, timeout_s / 2)
    procs = [ctx.Process(target=_child, args=(r, world, store, ctimeout, fn, args, queue,
                                                 progress is not None),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            if errors:  # the others may wait on the failed rank: give them a moment only
                deadline = min(deadline, time.monotonic() + 3.0)
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    break
                raise RankError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                f"within {timeout_s:.0f} s")
            try:
                rank, ok, value = queue.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead and not errors:
                    raise RankError(f"rank {dead[0]} died with exit code "
                                    f"{procs[dead[0]].exitcode}") from None
                continue
            if ok is None:
                if progress is not None:
                    progress(rank, value)
            elif ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
        if errors:
            raise RankError("\n".join(errors))
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
