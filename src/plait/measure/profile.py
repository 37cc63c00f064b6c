"""`plait profile`: measure this machine and write a calibration file.

Two modes. On `ranks` local gloo ranks (CPU; every rank runs the same items in the same order,
the slowest rank's time counts), or on one device in one process (`local`: a CUDA GPU, or the
CPU), where one device cannot move data to a peer and stand-ins play the movers.
1. GEMM time on a grid of (M, N, K) per dtype -> `params.gemm_measured`, which the cost model
   interpolates instead of its tile model.
2. Decomposition: the same GEMMs split 2..64 ways along M and along K, pieces run one after
   another -> the measured decomposition loss (kept for plots and checks).
3. Transfers (ranks only): all-gather time versus bytes through each engine (library
   collectives and the peer-copy engine) -> latency and bandwidth -> `comm_kernel_overhead_s` /
   `sm_link_fraction` and the copy engine's `command_overhead_s` / `bytes_per_s`.
4. Host issue (GPUs): the host time of one eager call that launches a kernel, issued in a loop
   faster than the device drains it -> `host_call_s` (what the cost model charges per host
   call of a decomposed schedule's step, `plait.cost.host`). A CPU runs its ops in the
   issuing thread: nothing to measure there (the presets' 0).
5. Contention: a GEMM and a transfer at the same time, per engine and size -> the GEMM's and the
   transfer's slowdown -> `gemm_slowdown_sm_comm`, `gemm_slowdown_dma`,
   `sm_comm_slowdown_under_compute`, `dma_slowdown_under_compute`. On one GPU the transfers are
   stand-ins: copy-engine copies from pinned host memory (`dma`, about one link's speed) and
   device to device (`d2d`, kept as a measurement only), and an SM copy kernel (`sm`, which
   takes every compute unit it can, so it bounds a collective kernel's interference from
   above); on one CPU, a copier thread (`dma`).
Every measured item is reported to the parent as it completes and saved in a partial file, so an
interrupted profile resumes where it stopped.
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import __version__
from plait.errors import SpecError
from plait.measure.links import fit_latency_bandwidth
from plait.measure.local import gemm_clock, mover
from plait.runtime.context import close_all, runtime_of
from plait.runtime.engines import Handle
from plait.runtime.launch import rank_device, use_device
from plait.runtime.timing import Timer, local_timer, slowest, time_calls
from plait.spec.dtypes import torch_dtype
from plait.spec.hardware import ClusterSpec

DTYPES = ("fp32", "bf16")  # what a profile measures
HOST_ITEM = "host/launch"
HOST_CALLS = 2000  # eager calls timed for the host item
SPLITS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure. `quick` finishes in a few minutes on the 2-core CI machine (and in a
    few minutes on one GPU). `local`: one device in this process, instead of `ranks` ranks."""

    quick: bool = True
    ranks: int = 2
    dtypes: tuple[str, ...] = ("fp32",)
    repeats: int = 5
    local: bool = False
    device: str = "cpu"
    parts: tuple[str, ...] = ("gemm", "split", "host", "transfer", "contention")  # to measure

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def grid(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        if self.gpu:
            sizes = (1024, 4096, 16384) if self.quick else (512, 1024, 2048, 4096, 8192, 16384)
            return sizes, sizes, sizes
        if self.quick:
            return (64, 256, 1024, 4096), (32, 128, 512), (64, 256, 1024)
        return (64, 256, 1024, 4096, 8192), (32, 128, 512, 2048), (64, 256, 1024, 4096)

    @property
    def split_shapes(self) -> tuple[tuple[int, int, int], ...]:
        if self.gpu:  # Llama-3-70B TP=8 pieces: QKV, FC1, a square one, a small one
            return ((8192, 1280, 8192), (8192, 7168, 8192), (2048, 6144, 4096)) + (
                () if self.quick else ((16384, 16384, 16384),))
        return ((4096, 128, 1024), (1024, 512, 256)) if self.quick else \
            ((4096, 128, 1024), (1024, 512, 256), (8192, 512, 1024))

    @property
    def transfer_kb(self) -> tuple[int, ...]:
        return (64, 256, 1024, 4096) if self.quick else (64, 256, 1024, 4096, 16384)

    @property
    def contention_kb(self) -> tuple[int, ...]:
        if self.gpu:
            return (16384, 131072) if self.quick else (4096, 16384, 65536, 262144)
        if self.local:  # one copier thread: sizes that take about as long as the GEMM
            return (4096, 32768)
        return (512, 4096) if self.quick else (256, 1024, 4096, 16384)

    @property
    def movers(self) -> tuple[str, ...]:
        """The transfers measured beside a GEMM (see the module docstring)."""
        if not self.local:
            return ("sm", "dma")
        return ("dma", "d2d", "sm") if self.gpu else ("dma",)

    def items(self) -> list[str]:
        """Every measurement key, in the order they are run."""
        keys = []
        for dt in self.dtypes:
            m_, n_, k_ = self.grid
            keys += [f"gemm/{dt}/{m}/{n}/{k}" for m in m_ for n in n_ for k in k_]
            for m, n, k in self.split_shapes:
                keys += [f"split/{dt}/{m}/{n}/{k}/{ax}/{p}" for ax in "MK" for p in SPLITS]
        if self.gpu:
            keys.append(HOST_ITEM)
        if not self.local:
            keys += [f"transfer/{e}/{kb}" for e in ("sm", "dma", "sm_rs")
                     for kb in self.transfer_kb]
        keys += [f"contention/{e}/{kb}" for e in self.movers for kb in self.contention_kb]
        return [k for k in keys if k.split("/")[0] in self.parts]

    def todo(self, done: Iterable[str]) -> list[str]:
        """The items not in `done`, in order: what a run measures, worked out once by its
        caller and handed to the ranks as it is."""
        skip = set(done)
        return [key for key in self.items() if key not in skip]


def _parsed(keys: Iterable[str]) -> Iterator[tuple[str, str, list[str]]]:
    """(key, kind, fields) of each item."""
    for key in keys:
        kind, *fields = key.split("/")
        yield key, kind, fields


def _gemm(dt: torch.dtype, m: int, n: int, k: int, repeats: int, timer: Timer = time_calls,
          device: str = "cpu") -> float:
    a, w = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
    c = torch.empty(m, n, dtype=dt, device=device)
    return statistics.median(timer(lambda: torch.mm(a, w, out=c), 1, repeats))


def _split(dt: torch.dtype, m: int, n: int, k: int, axis: str, parts: int, repeats: int,
           timer: Timer = time_calls, device: str = "cpu") -> float:
    a, w = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
    c = torch.empty(m, n, dtype=dt, device=device)
    if axis == "M":
        am, cm = a.view(parts, m // parts, k), c.view(parts, m // parts, n)

        def run() -> None:
            for i in range(parts):
                torch.mm(am[i], w, out=cm[i])
    else:
        ak = [a[:, i * (k // parts):(i + 1) * (k // parts)].contiguous() for i in range(parts)]
        wk = [w[i * (k // parts):(i + 1) * (k // parts)] for i in range(parts)]

        def run() -> None:
            torch.mm(ak[0], wk[0], out=c)
            for i in range(1, parts):
                c.addmm_(ak[i], wk[i])
    return statistics.median(timer(run, 1, repeats))


def transfer_fits(measured: dict[str, Any], ranks: int) -> dict[str, dict[str, Any]]:
    """Latency and bandwidth of each engine's transfers (`transfer/<engine>/<kb>` items)."""
    return {e: fit_latency_bandwidth(
        {int(k.split("/")[2]): v for k, v in measured.items()
         if k.startswith(f"transfer/{e}/")}, ranks) for e in ("sm", "dma", "sm_rs")}


def _transfer(engine: str, kb: int) -> Callable[[], None]:
    """One collective through the runtime with an empty GEMM: an all-gather of a `kb` KiB
    shard per rank (`sm`, `dma`), or a reduce-scatter moving the same bytes (`sm_rs`)."""
    from plait import ops

    rt, dev = runtime_of(None), rank_device()
    rows = max(1, kb * 256 // 1024)
    if engine == "sm_rs":  # input of world x rows x 1024 floats: each peer gets rows x 1024
        a0, w0 = torch.empty(rt.world * rows, 0, device=dev), torch.zeros(0, 1024, device=dev)

        def rs() -> None:
            ops.matmul_reduce_scatter(a0, w0, rt, schedule="seq/sm")
        return rs
    x, w1 = torch.randn(rows, 1024, device=dev), torch.empty(1024, 0, device=dev)

    def ag() -> None:
        ops.all_gather_matmul(x, [w1], rt, schedule=f"seq/{engine}", return_gathered=False)
    return ag


def _rank_transfer(engine: str, kb: int) -> Callable[[], Handle]:
    """Start function of an all-gather of a `kb` KiB shard per rank through `engine`."""
    rt, dev = runtime_of(None), rank_device()
    world, rank = rt.world, rt.rank
    x = torch.randn(max(1, kb * 256 // 1024), 1024, device=dev)
    recv = torch.empty(world, *x.shape, device=dev)

    def start() -> Handle:
        if engine == "sm":
            return rt.collective().all_gather(recv, x, "profile")
        peer = rt.peer(x.device)
        peer.begin(x.numel() * x.element_size())
        readers = [q for q in range(world) if q != rank]
        peer.publish(0, 0, x, readers=readers)
        handles = [peer.pull(q, 0, 0, recv[q], "profile") for q in readers]

        class _All:
            def wait(self) -> None:
                for h in handles:
                    h.wait()
                peer.end()
        return _All()
    return start


def _contention(start: Callable[[], Handle], gemm: tuple[int, int, int], dt: torch.dtype,
                device: str, repeats: int, timer: Timer = time_calls,
                across: Callable[[float], float] = lambda x: x) -> dict[str, float]:
    """GEMM alone, transfer alone, and both at once (the transfer issued first). `across`
    combines a time over ranks (the slowest counts)."""
    m, n, k = gemm
    a, w = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
    c = torch.empty(m, n, dtype=dt, device=device)
    clock = gemm_clock(device)
    gemm_alone = statistics.median(timer(lambda: torch.mm(a, w, out=c), 1, repeats))
    comm_alone = statistics.median(timer(lambda: start().wait(), 1, repeats))
    runs: list[tuple[Callable[[], float], float]] = []  # (GEMM time reader, start time)

    def both() -> None:
        t0 = time.perf_counter()
        h = start()
        t1 = time.perf_counter()  # the synchronous part of starting (publishing into shm)
        runs.append((clock(lambda: torch.mm(a, w, out=c)), t1 - t0))
        h.wait()

    both_t = statistics.median(timer(both, 1, repeats))
    timed = runs[1:]  # after the warm-up call
    return {"gemm_alone_s": gemm_alone, "comm_alone_s": comm_alone, "both_s": both_t,
            "gemm_with_comm_s": across(statistics.median(read() for read, _ in timed)),
            "start_s": across(statistics.median(st for _, st in timed))}


# The GEMM beside each transfer: ~1 GFLOP (10-15 ms on a CPU core) / ~1 TFLOP (~1-2 ms on a GPU)
CONTENTION_GEMM = {"cpu": (2048, 256, 1024), "cuda": (8192, 8192, 8192)}


def profile_rank(rank: int, world: int, plan: ProfilePlan, todo: Sequence[str],
                 report: Callable[[Any], None]) -> None:
    """Measure the items `todo` of `plan`; rank 0 reports (key, value) per item. The ranks'
    device: their GPU when the group runs NCCL (under torchrun), else the CPU."""
    rt, dev = runtime_of(None), rank_device()
    rt.verify_shapes = False
    for key, kind, f in _parsed(todo):
        value: float | dict[str, float]
        if kind == "transfer":
            value = min(time_calls(_transfer(f[0], int(f[1])), 2, plan.repeats + 2))
        elif kind == "contention":
            value = _contention(_rank_transfer(f[0], int(f[1])), CONTENTION_GEMM[dev.type],
                                torch_dtype(plan.dtypes[-1]), str(dev), plan.repeats + 2,
                                across=slowest)
        else:
            value = _measure(key, plan, time_calls, str(dev))
        dist.barrier()
        if rank == 0:
            report((key, value))
    close_all()


def profile_local(plan: ProfilePlan, todo: Sequence[str], report: Callable[[Any], None]
                  ) -> None:
    """Measure the items `todo` of a `local` plan on `plan.device`, in this process (its
    current CUDA device, on a GPU, so that events and synchronizations act on it)."""
    use_device(plan.device)
    timer = local_timer(plan.device)
    dt = torch_dtype(plan.dtypes[-1])  # the contention GEMM runs in the last dtype measured
    for key, kind, f in _parsed(todo):
        value: float | dict[str, float]
        if kind == "contention":
            value = _contention(mover(f[0], int(f[1]), plan.device),
                                CONTENTION_GEMM["cuda" if plan.gpu else "cpu"], dt,
                                plan.device, plan.repeats + 2, timer)
        else:
            value = _measure(key, plan, timer, plan.device)
        report((key, value))


def host_call_s(device: str, calls: int = HOST_CALLS) -> float:
    """Host seconds of one eager call that launches a kernel on `device` (a GPU): the median
    over 3 rounds of `calls` in-place adds on a small tensor, timed on the host without
    waiting for the device, which runs each in a few microseconds (faster than they come)."""
    x = torch.zeros(256, device=device)
    rounds = []
    for _ in range(4):  # the first round warms up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize(device)
    return statistics.median(rounds[1:])


def _measure(key: str, plan: ProfilePlan, timer: Timer, device: str) -> float:
    """A GEMM (`gemm/...`), split GEMM (`split/...`) or host issue (`host/launch`) item."""
    if key == HOST_ITEM:
        return host_call_s(device)
    kind, dt, *f = key.split("/")
    m, n, k = int(f[0]), int(f[1]), int(f[2])
    if kind == "gemm":
        return _gemm(torch_dtype(dt), m, n, k, plan.repeats, timer, device)
    return _split(torch_dtype(dt), m, n, k, f[3], int(f[4]), plan.repeats, timer, device)


def read_partial(path: Path) -> dict[str, Any]:
    """The items an interrupted run measured, as it saved them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise SpecError("resume", f"{path} is not a saved profile: {type(exc).__name__}",
                        "delete it, or run with --restart") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SpecError("resume", f"{path} holds a {type(data).__name__}, not saved items",
                        "delete it, or run with --restart")
    return data


def profile_plan(quick: bool, ranks: int, local: bool, device: str, dtypes: str, repeats: int,
          under_torchrun: bool) -> ProfilePlan:
    """What to measure, and where, from the options (bad ones: a `SpecError` naming them).
    Under torchrun: its ranks and their devices (GPUs with NCCL, else CPUs with gloo)."""
    from plait.runtime.launch import init_from_env

    if ranks < 1:
        raise SpecError("ranks", f"{ranks} ranks", "use 1 or more")
    if repeats < 1:
        raise SpecError("repeats", f"{repeats} timed repeats", "use 1 or more")
    names = tuple(d.strip() for d in dtypes.split(","))
    for d in names:
        if d not in DTYPES:
            raise SpecError("dtypes", f"{d!r} is not measurable", f"use {', '.join(DTYPES)}")
    if under_torchrun:
        device, ranks = init_from_env().type, dist.get_world_size()
    elif device == "auto":
        device = "cuda" if local and torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (local or under_torchrun):
        raise SpecError("device", f"{device} needs --local, or torchrun for several GPUs "
                        "(started ranks run on CPU gloo)",
                        "add --local, or run under torchrun --nproc-per-node N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError("device", f"{device}: no CUDA device here",
                        "use --device cpu, or run on a machine with a GPU")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SpecError("device", f"{device!r} is not a device", "use cpu, cuda or cuda:N")
    return ProfilePlan(quick=quick, ranks=ranks, dtypes=names, repeats=repeats, local=local,
                       device=device)


def command_line(plan: ProfilePlan, under_torchrun: bool) -> str:
    """The command that made a profile, as its calibration records it."""
    command = "plait " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if \
        sys.argv[0].endswith(("plait", "__main__.py")) else "plait profile"
    return f"torchrun --nproc-per-node {plan.ranks} -m {command}" if under_torchrun else command


def calibration_from(measured: dict[str, Any], plan: ProfilePlan, base: ClusterSpec,
                     command: str) -> dict[str, Any]:
    """The calibration document (format v1) derived from the measured items."""
    gemm = [[k.split("/")[1], *(int(x) for x in k.split("/")[2:5]), v]
            for k, v in measured.items() if k.startswith("gemm/")]
    params: dict[str, Any] = {"gemm_measured": gemm}
    if HOST_ITEM in measured:
        params["host_call_s"] = measured[HOST_ITEM]
    gpu: dict[str, Any] = {}
    fits = {}
    if not plan.local:  # links are measured between ranks only
        fits = transfer_fits(measured, plan.ranks)
        link_params, dma = _link_params(measured, plan, base, fits)
        params.update(link_params)
        gpu = {"dma": dma}
    rates = {k.removeprefix("contention/"): _rates_of(v) for k, v in measured.items()
             if k.startswith("contention/")}
    for engine, gemm_key, comm_key in (
            ("sm", "gemm_slowdown_sm_comm", "sm_comm_slowdown_under_compute"),
            ("dma", "gemm_slowdown_dma", "dma_slowdown_under_compute")):
        runs = [r for k, r in rates.items() if k.startswith(f"{engine}/")]
        if runs:
            g = [r["gemm_rate"] for r in runs if r["gemm_rate"] is not None]
            params[gemm_key] = min(0.95, max(0.0, 1.0 - statistics.median(g)))
        exact = [c for r in runs if (c := r["comm_rate"]) is not None]
        bounds = [c for r in runs if (c := r.get("comm_rate_at_least")) is not None]
        # Measured rates when there are any; a bound is never averaged with them. With bounds
        # alone, the bound stands for the rate (on a CPU core the transfer and the GEMM share,
        # that is close: the validation's error grows when the preset's small value is kept).
        rated = exact or bounds
        if rated:
            params[comm_key] = min(0.95, max(0.0, 1.0 - statistics.median(rated)))
    return {
        "plait_calibration": 1,
        "meta": {"device": _device_name(plan.device), "hardware_base": base.name,
                 "mode": "one device (local)" if plan.local else
                 f"{plan.ranks} {plan.device} ranks",
                 "ranks": 1 if plan.local else plan.ranks, "quick": plan.quick,
                 "date": time.strftime("%Y-%m-%d"), "command": command,
                 "versions": {"plait": __version__, "torch": str(torch.__version__),
                              "python": platform.python_version()}},
        "params": params,
        "gpu": gpu,
        "measurements": {"transfer_fits": fits, "contention_rates": rates, "items": measured},
    }


def _rates_of(v: dict[str, float]) -> dict[str, float | None]:
    """One contention measurement's rates as the calibration uses them: the GEMM's, and the
    transfer's when the measurement tells it (it outlasted the GEMM, so its rate beside
    compute is measured); a transfer that finished beside the GEMM only bounds its rate from
    below (`comm_rate_at_least`), and a tiny one (under a fifth of the GEMM) not even that."""
    g, c, exact = contention_rates(v)
    informative = v["comm_alone_s"] - v.get("start_s", 0.0) >= 0.2 * v["gemm_with_comm_s"]
    return {"gemm_rate": g, "comm_rate": c if informative and exact else None,
            "comm_rate_at_least": c if informative and not exact else None}


def contention_rates(v: dict[str, float]) -> tuple[float, float, bool]:
    """(GEMM rate, transfer rate) while both run, relative to alone, from one measurement.

    The GEMM's rate is its time alone over its time beside the transfer. Starting the transfer
    may take synchronous time first (`start_s`: the peer-copy engine publishes into shared
    memory), which both measurements contain and which is taken out. The transfer ran beside the
    GEMM for the GEMM's duration, then alone: if it finished after the GEMM, its rate under
    compute r solves comm_alone = r * gemm_with + (both - gemm_with); if it finished first,
    only r >= comm_alone / gemm_with is known, and that bound is taken.
    """
    gemm_rate = v["gemm_alone_s"] / v["gemm_with_comm_s"]
    start = v.get("start_s", 0.0)  # done before the GEMM begins, in both measurements
    comm = max(v["comm_alone_s"] - start, 1e-9)
    tail = max(0.0, v["both_s"] - start - v["gemm_with_comm_s"])
    # The transfer outlasted the GEMM (its rate is measured), or it finished beside it (a
    # lower bound on its rate is known).
    exact = tail > 0.25 * comm
    comm_rate = (comm - tail if exact else comm) / v["gemm_with_comm_s"]
    return min(gemm_rate, 1.0), min(max(comm_rate, 0.05), 1.0), exact  # 0.05: the floor


def _link_params(measured: dict[str, Any], plan: ProfilePlan, base: ClusterSpec,
                 fits: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float]]:
    """From the transfer fits between ranks: the collective-kernel (and copy-engine link)
    parameters, and the copy engine's rate and per-command overhead."""
    link, lat = base.topology.link_bytes_per_s, base.topology.latency_s
    rs_ratio = [measured[f"transfer/sm_rs/{kb}"] / measured[f"transfer/sm/{kb}"]
                for kb in plan.transfer_kb
                if f"transfer/sm_rs/{kb}" in measured and f"transfer/sm/{kb}" in measured]
    params = {
        "sm_reduce_slowdown": max(0.0, statistics.median(rs_ratio) - 1) if rs_ratio else 0.1,
        "comm_kernel_overhead_s": max(fits["sm"]["latency_s"] - lat, 0.0),
        "sm_link_fraction": min(fits["sm"]["bytes_per_s"], link) / link,
    }
    fit = fits["dma"]
    dma = {"bytes_per_s": fit["bytes_per_s"],
           "command_overhead_s": max(fit["latency_s"] - lat, 0.0)}
    if fit["bytes_per_s"] > link * base.params.dma_link_fraction:  # not link-bound here
        params["dma_link_fraction"] = 1.0
        dma["bytes_per_s"] = min(fit["bytes_per_s"], link)
    return params, dma


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + " (CPU)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} (CPU)"
