"""Start N local ranks with gloo (tests, `plait bench`), with a hard timeout; or join the
ranks torchrun started (`init_from_env`).

Each rank is a process with one intra-op thread (one core per rank), a gloo process group
whose collectives time out after `timeout_s`, and its result or exception sent back to the
parent. A rank that hangs or dies is reported as an error naming the rank; the others are killed.

Ranks are forked from a fork server (`multiprocessing`'s "forkserver"), a fresh interpreter that
imported torch and never touched CUDA, not from the caller: a process forked after its parent
initialized CUDA (as much as `torch.cuda.is_available()` does) cannot use CUDA, and even CPU-only
ranks then die inside Dynamo, which asks for the CUDA RNG state. The function and its arguments
travel by value (cloudpickle), so closures and lambdas still work, and the ranks see the
caller's environment, working directory and import path as they were at the call.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, Store

from plait.errors import InfeasibleError, SpecError


def init_from_env(timeout_s: float = 300.0) -> torch.device:
    """Join the process group torchrun describes in the environment (NCCL on GPUs, one per
    local rank; gloo on CPUs) unless already joined; return this rank's device."""
    cuda = torch.cuda.is_available()
    if cuda:
        local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if ranks > gpus:
            raise SpecError("nproc-per-node", f"{ranks} ranks on a node with {gpus} GPU(s): "
                            "NCCL needs a GPU of its own for each rank",
                            f"start at most {gpus} ranks per node, or hide the GPUs "
                            "(CUDA_VISIBLE_DEVICES=) to run the ranks on CPUs with gloo")
        torch.cuda.set_device(local)
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


def _backends(group: dist.ProcessGroup | None) -> dict[str, str]:
    """The group's backend by device type ("cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda":
    "nccl"}; a bare "nccl" -> {"*": "nccl"})."""
    get_config = getattr(dist, "get_backend_config", None)
    config = str(get_config(group) if get_config is not None else dist.get_backend(group))
    out = {}
    for item in config.split(","):
        device, _, name = item.strip().rpartition(":")
        out[device or "*"] = name.lower()
    return out


def _gpu_backend(backends: dict[str, str]) -> str | None:
    """The group's CUDA backend ("nccl") where it has one other than gloo and this process
    sees a GPU; else None."""
    cuda = backends.get("cuda", backends.get("*"))
    if cuda not in (None, "gloo", "undefined") and torch.cuda.is_available():
        return cuda
    return None


def group_backend(group: dist.ProcessGroup | None = None) -> str:
    """The backend that runs `group`'s collectives on this rank's tensors: its GPU backend
    (`_gpu_backend`), else its CPU backend. A group from `init_process_group()` without a
    backend reports "undefined" (`get_backend`) and is "cpu:gloo,cuda:nccl" on a GPU machine:
    NCCL here."""
    backends = _backends(group)
    return _gpu_backend(backends) or backends.get("cpu", backends.get("*", "gloo"))


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where `group`'s collectives take their tensors on this rank: its current GPU when the
    group communicates with a GPU backend, else the CPU."""
    if _gpu_backend(_backends(group)) is not None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float:
    """`group`'s own collective timeout in seconds (`init_process_group`'s or `new_group`'s
    `timeout`); where the backend does not say, PyTorch's default for it (NCCL 10 minutes,
    others 30)."""
    try:
        pg = group or dist.group.WORLD
        assert pg is not None
        options = pg._get_backend(group_device(pg)).options
        return float(options._timeout.total_seconds())
    except Exception:  # a backend without options, or no group at all
        gpu = _gpu_backend(_backends(group)) if dist.is_initialized() else None
        return 600.0 if gpu is not None else 1800.0


def rank_device() -> torch.device:
    """The device this rank's tensors live on: its GPU when the world group runs on a GPU
    backend (NCCL), else the CPU."""
    if dist.is_available() and dist.is_initialized():
        return group_device()
    return torch.device("cpu")


def use_device(device: torch.device | str) -> None:
    """Make `device` this process's current CUDA device when it is a GPU (`cuda:N`), so that
    the streams, events and synchronizations that name no device act on it."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        torch.cuda.set_device(d)


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and what happened."""


# A rank runs the caller's main module first, as every non-fork start method does: a script
# without a main guard calls run_ranks again there, and the rank dies before it reports.
_STARTUP_HINT = (" (a script that calls run_ranks must guard its top-level code with "
                 "`if __name__ == \"__main__\":`)")


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
    """This rank ends when the process that called `run_ranks` dies (a killed caller leaves no
    ranks running on). The fork server, the rank's own parent, outlives the caller as long as
    any rank holds its lifeline, so the rank watches the caller itself: its sentinel, which
    becomes readable when the caller is gone."""
    caller = mp.parent_process()
    if caller is None:
        return

    def watch() -> None:
        mp.connection.wait([caller.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="plait-caller-watch", daemon=True).start()


# Imported once by the fork server, so that each rank forked from it starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "plait.runtime.launch", "plait.ops"]


def _context() -> Any:
    """The fork server's context, its preloads set before it first starts."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(rank: int, world: int, store: str, timeout_s: float, environ: dict[str, str],
           payload: bytes, queue: Any, with_report: bool) -> None:
    """A rank. `multiprocessing` gives it the caller's working directory and import path as
    they are at the start; the caller's environment comes in `environ`."""
    try:
        _die_with_parent()
        os.environ.clear()
        os.environ.update(environ)
        fn, args = pickle.loads(payload)
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
        # By value, not as shared-memory handles (torch's queue pickler) that die with this
        # process.
        queue.put((rank, True, _dumps(result)))
    except BaseException as exc:  # report everything, including assertion failures
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, and modules of a `ModuleType` subclass (`torch.ops`) by name, as cloudpickle
    sends plain modules."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf).dump(value)
    return buf.getvalue()


def _payload(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    try:
        return _dumps((fn, args))
    except Exception as exc:
        raise SpecError("run_ranks", f"{getattr(fn, '__qualname__', fn)!r} or its arguments "
                        f"cannot be sent to the ranks ({type(exc).__name__}: {exc})",
                        "pass values that pickle (tensors, numbers, plain objects), and "
                        "create process groups, locks and open files inside the function"
                        ) from None


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
              collective_timeout_s: float | None = None,
              progress: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return their results by rank.

    `fn` may be a closure or a lambda (it travels by value). With `progress`, `fn` also gets
    `report=`, and whatever a rank reports reaches `progress(rank, message)` in the parent
    while the ranks run. Raises `RankError` if a rank raises, dies, or the whole run exceeds
    `timeout_s`.
    """
    payload = _payload(fn, args)
    ctx = _context()
    queue = ctx.Queue()
    # Rendezvous through a fresh file, not a TCP port: a port found free can be taken by
    # another process before the ranks bind it.
    _remove_orphaned_rendezvous()
    store_dir = tempfile.mkdtemp(prefix=f"plait-ranks-{os.getpid()}-")
    store = os.path.join(store_dir, "store")
    ctimeout = collective_timeout_s or max(5.0, timeout_s / 2)
    procs = [ctx.Process(target=_child, args=(r, world, store, ctimeout, dict(os.environ),
                                                 payload, queue, progress is not None),
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
                    code = procs[dead[0]].exitcode
                    raise RankError(f"rank {dead[0]} died with exit code {code}"
                                    f"{_STARTUP_HINT if code == 1 else ''}") from None
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
