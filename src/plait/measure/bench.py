"""`plait bench`: run every schedule of one pair for real and compare with the simulator.

Each rank builds the same random operands, then for every schedule runs `warmup` calls and times
`repeats` calls; the time of a call is the slowest rank's (all ranks start together after a
barrier). Alongside: the GEMM alone, the collective alone (their max is the ideal bound, their sum
the sequential bound), and the simulator's prediction for the same pair on a hardware profile
(`cpu` by default). One extra call per schedule runs under torch.profiler for the trace.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import ops
from plait.errors import InfeasibleError, SpecError
from plait.runtime.context import Runtime, close_all, runtime_of
from plait.runtime.engines import all_gather_tensor, reduce_scatter_tensor
from plait.runtime.launch import rank_device
from plait.runtime.timing import time_calls
from plait.schedule.schedule import SEQUENTIAL, Schedule, ScheduleLike, candidate_schedules
from plait.sim.pair import check_feasible, simulate_pair
from plait.spec.dtypes import DTYPE_BYTES, torch_dtype
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import OverlapPair, PairKind


@dataclass(frozen=True)
class BenchSpec:
    op: PairKind  # ag: all_gather_matmul, rs: matmul_reduce_scatter, a2a: all_to_all_matmul,
    #               mm_a2a: matmul_all_to_all
    m: int
    n: int
    k: int
    ranks: int
    dtype: str = "fp32"
    warmup: int = 2
    repeats: int = 5
    schedules: tuple[Schedule, ...] = ()
    trace: str | None = None
    experts: int = 1  # a2a / mm_a2a: local experts per rank (the M rows split among them)

    def __post_init__(self) -> None:  # the kind given as its text ("ag") is the kind
        object.__setattr__(self, "op", PairKind(self.op))

    def pair(self) -> OverlapPair:
        return OverlapPair.build(self.op, self.m, self.n, self.k, self.ranks,
                                 experts=self.experts, dtype=self.dtype, name="bench")


def feasible_schedules(spec: BenchSpec) -> list[Schedule]:
    """Every schedule of the design space that fits the shape (max 8 sub-chunks)."""
    pair, out = spec.pair(), []
    for s in candidate_schedules(pair.axis, max_chunks=8):
        try:
            check_feasible(pair, s)
        except InfeasibleError:
            continue
        out.append(s)
    return out


def bench_spec(op: str, shape: str, world: int, experts: int, dtype: str, warmup: int,
               repeats: int, schedules: str, trace: str | None, gpu: bool = False
               ) -> BenchSpec:
    """The run, every option checked before a rank starts: one clear line, not every rank's
    traceback. `gpu`: the ranks run on GPUs, one each (torchrun on a GPU machine)."""
    m, n, k = parse_shape(shape)
    try:
        kind = PairKind(op)
    except ValueError:
        raise SpecError("op", f"{op!r} is not a pair kind",
                        f"use {', '.join(PairKind)}") from None
    if experts != 1 and not kind.experts:
        raise SpecError("experts", f"{op} has no experts",
                        f"use --op {' or '.join(k for k in PairKind if k.experts)}")
    if experts < 1:
        raise SpecError("experts", f"{experts} experts", "use 1 or more")
    if m % (world * experts):
        raise SpecError("shape" if experts == 1 else "experts",
                        f"M={m} rows do not split over {world} ranks"
                        + (f" x {experts} experts" if experts > 1 else ""),
                        f"use M a multiple of {world * experts}")
    spec = BenchSpec(kind, m, n, k, world, dtype, warmup, repeats, (), trace, experts)
    names = feasible_schedules(spec) if schedules == "all" else \
        [Schedule.parse(x) for x in schedules.split(",")]
    for name in names:
        try:
            check_feasible(spec.pair(), name)
        except InfeasibleError as exc:
            raise SpecError("schedules", str(exc), "drop it, or choose chunks that split "
                            f"M={m} into {world} ranks x chunks") from None
    if SEQUENTIAL not in names:
        names.insert(0, SEQUENTIAL)
    check_memory(op, m, n, k, world, experts, dtype, gpu=gpu)
    return BenchSpec(kind, m, n, k, world, dtype, warmup, repeats, tuple(names), trace, experts)


BENCH_DTYPES = ("fp32", "bf16", "fp16")  # what the CPU and GPU ranks compute in


def check_run(ranks: int, warmup: int, repeats: int, timeout: float, dtype: str) -> None:
    """The run options, each named when it cannot work."""
    if ranks < 1:
        raise SpecError("ranks", f"{ranks} ranks", "use 1 or more")
    if warmup < 0:
        raise SpecError("warmup", f"{warmup} calls", "use 0 or more")
    if repeats < 1:
        raise SpecError("repeats", f"{repeats} timed calls", "use 1 or more")
    if not (math.isfinite(timeout) and timeout > 0):
        raise SpecError("timeout", f"{timeout} s", "use a positive number of seconds")
    if dtype not in BENCH_DTYPES:
        raise SpecError("dtype", f"{dtype!r} cannot be benchmarked",
                        f"use one of {', '.join(BENCH_DTYPES)}")


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SpecError("shape", f"cannot read {text!r}",
                        "write MxNxK, e.g. 4096x256x2048") from None
    if min(m, n, k) <= 0:
        raise SpecError("shape", f"{text!r} has a non-positive size", "use positive sizes")
    return m, n, k


def check_memory(op: str, m: int, n: int, k: int, world: int, experts: int, dtype: str,
                 available: int | None = None, gpu: bool = False) -> None:
    """Refuse a run whose operands would not fit the free memory they live in: every rank
    holds its input (and a gathered copy), the weight and the outputs of the calls timed. CPU
    ranks share this machine's memory; GPU ranks (torchrun, one per GPU) each their GPU's."""
    per_rank = (4 * m * k + experts * k * n + 3 * m * n) * DTYPE_BYTES[dtype]
    need = per_rank if gpu else world * per_rank
    where = "each GPU needs" if gpu else f"{world} ranks need"
    if available is None:
        available = free_memory(gpu)
    if need > available:
        raise SpecError("shape", f"{op} {m}x{n}x{k}: {where} about {need / 2**30:,.1f} GiB; "
                        f"{'this GPU' if gpu else 'this machine'} has "
                        f"{available / 2**30:,.1f} GiB free",
                        "choose a smaller shape (or fewer ranks)")


def free_memory(gpu: bool) -> int:
    """Free bytes where a rank's operands live: this rank's GPU (torchrun's LOCAL_RANK), or
    the host."""
    if gpu:
        local = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        return int(torch.cuda.mem_get_info(local)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bench_under_torchrun(spec: BenchSpec) -> dict[str, Any] | None:
    """`bench_rank` on torchrun's ranks (NCCL and a GPU each where there are GPUs, else
    gloo); rank 0's measurements, None on the other ranks."""
    from plait.runtime.launch import init_from_env, leave_group

    init_from_env()
    rank = dist.get_rank()
    out = bench_rank(rank, dist.get_world_size(), spec)
    leave_group()
    return out if rank == 0 else None


def bench_rank(rank: int, world: int, spec: BenchSpec,
               report: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Body run on every rank; rank 0's return value holds the measurements."""
    torch.manual_seed(1234 + rank)
    rt = runtime_of(None)
    rt.verify_shapes = False  # shapes are identical by construction; keep the check off the clock
    run, calls = _workload(spec, world, rt)

    def step(msg: str) -> None:
        if report is not None and rank == 0:
            report(msg)

    with torch.no_grad():
        times, engines = _round_robin(calls, spec, rt, step)
        trace = _trace(spec, run, rank) if spec.trace else None
    close_all()
    results = {s: {"median_s": statistics.median(times[s]), "min_s": min(times[s]),
                   "times_s": times[s], "engine": engines[s]}
               for s in map(str, spec.schedules)}
    engine_t = {e: statistics.median(times[f"transfer:{e}"]) for e in ("sm", "dma")}
    return {"gemm_s": statistics.median(times["gemm"]),
            "collective_s": statistics.median(times["collective"]),
            "comm_sm_s": engine_t["sm"], "comm_dma_s": engine_t["dma"],
            "schedules": results, "trace": trace}


def _workload(spec: BenchSpec, world: int, rt: Runtime
              ) -> tuple[Callable[[Schedule], None], dict[str, Callable[[], Any]]]:
    """The pair's operands on this rank, how to run one schedule, and every call measured:
    the GEMM alone (with E experts, each on its share of the rows), the library collective
    alone, each engine's transfer alone (the op with an empty GEMM), and every schedule."""
    dt, dev = torch_dtype(spec.dtype), rank_device()
    lead = () if spec.experts == 1 else (spec.experts,)  # (E, K, N): E local experts
    w = torch.randn(*lead, spec.k, spec.n, dtype=dt, device=dev)
    comm: Callable[[], Any]
    if spec.op.direction == "in":  # the input's rows come in
        rows_in = spec.m // world if spec.op == "ag" else spec.m
        x = torch.randn(rows_in, spec.k, dtype=dt, device=dev)
        x_full = torch.randn(spec.m, spec.k, dtype=dt, device=dev) if spec.op == "ag" else x
        gathered = torch.empty(spec.m, spec.k, dtype=dt, device=dev)
        w0 = torch.empty(*lead, spec.k, 0, dtype=dt, device=dev)  # no GEMM: the transfer alone

        def run(s: ScheduleLike, comm_only: bool = False) -> None:
            if spec.op == "ag":
                ops.all_gather_matmul(x, [w0 if comm_only else w], rt, schedule=s,
                                      return_gathered=False)
            else:  # every rank sends M/P rows to each rank, then its expert GEMM
                ops.all_to_all_matmul(x, w0 if comm_only else w, rt, schedule=s,
                                      return_received=False)

        comm = (functools.partial(all_gather_tensor, gathered, x) if spec.op == "ag"
                else functools.partial(dist.all_to_all_single, gathered, x))
    else:  # "rs", "mm_a2a": the product's rows go out
        x = x_full = torch.randn(spec.m, spec.k, dtype=dt, device=dev)
        y_full = torch.randn(spec.m, spec.n, dtype=dt, device=dev)
        y_out = torch.empty(spec.m // world if spec.op == "rs" else spec.m, spec.n, dtype=dt,
                            device=dev)
        x0 = torch.empty(spec.m, 0, dtype=dt, device=dev)
        w0 = torch.zeros(*lead, 0, spec.n, dtype=dt, device=dev)
        call = ops.matmul_reduce_scatter if spec.op == "rs" else ops.matmul_all_to_all

        def run(s: ScheduleLike, comm_only: bool = False) -> None:
            call(x0 if comm_only else x, w0 if comm_only else w, rt, schedule=s)

        comm = (functools.partial(reduce_scatter_tensor, y_out, y_full) if spec.op == "rs"
                else functools.partial(dist.all_to_all_single, y_out, y_full))
    rows = x_full.view(spec.experts, -1, x_full.shape[1]) if lead else x_full
    calls: dict[str, Callable[[], Any]] = {
        "gemm": functools.partial(torch.bmm, rows, w) if lead else functools.partial(
            torch.mm, rows, w), "collective": comm,
        **{f"transfer:{e}": functools.partial(run, f"seq/{e}", True) for e in ("sm", "dma")},
        **{str(s): functools.partial(run, s) for s in spec.schedules}}
    return run, calls


def _round_robin(calls: dict[str, Callable[[], Any]], spec: BenchSpec, rt: Runtime,
                 step: Callable[[str], None]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Every call warmed up (and the engine each schedule really used recorded), then timed in
    one round-robin: repeat r of each, then r + 1, so that the drift of a shared host
    (frequency, neighbours) hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    engines: dict[str, str] = {}
    schedules = {str(s) for s in spec.schedules}
    for name, fn in calls.items():
        for _ in range(spec.warmup):
            fn()
        if name in schedules:
            fn()
            engines[name] = rt.records[-1].engine
    for rep in range(spec.repeats):
        for name, fn in calls.items():
            times[name] += time_calls(fn, 0, 1)
        step(f"repeat {rep + 1}")
    rt.records.clear()
    return times, engines


def _trace(spec: BenchSpec, run: Callable[[Schedule], None], rank: int) -> str | None:
    """A torch.profiler trace of one call of every schedule, each inside `bench:<schedule>`,
    every thread followed (the copier's copies too); rank 0 writes it."""
    from torch.profiler import profile, record_function

    from plait.tracing import every_thread

    assert spec.trace is not None
    with profile(experimental_config=every_thread()) as prof:
        for s in spec.schedules:
            dist.barrier()
            with record_function(f"bench:{s}"):
                run(s)
    if rank != 0:
        return None
    Path(spec.trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(spec.trace)
    return spec.trace


@dataclass
class BenchRow:
    schedule: str
    engine: str
    measured_s: float
    predicted_s: float
    speedup: float  # over the measured sequential schedule
    saving_achieved: float  # (seq - t) / (seq - ideal): fraction of the ideal saving realized
    spread: float = 0.0  # (slowest - fastest) / median of its timed calls: the noise


@dataclass
class BenchResult:
    spec: BenchSpec
    hardware: str
    gemm_s: float
    comm_s: float  # the faster engine's transfer alone
    comm_by_engine_s: dict[str, float]
    predicted_gemm_s: float
    predicted_comm_s: float
    rows: list[BenchRow] = field(default_factory=list)
    trace: str | None = None

    @property
    def ideal_s(self) -> float:
        return max(self.gemm_s, self.comm_s)

    def to_dict(self) -> dict[str, Any]:
        spec = {**asdict(self.spec), "schedules": [str(s) for s in self.spec.schedules]}
        return {"spec": spec, "hardware_profile": self.hardware,
                "gemm_s": self.gemm_s, "comm_s": self.comm_s,
                "comm_by_engine_s": self.comm_by_engine_s, "ideal_s": self.ideal_s,
                "predicted_gemm_s": self.predicted_gemm_s,
                "predicted_comm_s": self.predicted_comm_s,
                "rows": [asdict(r) for r in self.rows], "trace": self.trace,
                "contradictions": contradictions(self)}


def contradictions(res: BenchResult) -> list[str]:
    """What the measurements cannot say, in words: a schedule measured faster than the ideal
    bound (its components were timed under other load), and an order of the fastest schedules
    smaller than the noise of their timed calls."""
    out = []
    below = [r.schedule for r in res.rows if r.measured_s < res.ideal_s * 0.95]
    if below:
        out.append(f"{', '.join(below)} measured below the ideal bound "
                   f"({res.ideal_s * 1e3:.2f} ms, the longer of GEMM and transfer alone): the "
                   "components ran under other load, so the saving figures overstate")
    fastest = sorted(res.rows, key=lambda r: r.measured_s)[:2]
    if len(fastest) == 2:
        gap = fastest[1].measured_s / fastest[0].measured_s - 1
        noise = max(r.spread for r in fastest)
        if noise > gap:
            out.append(f"the two fastest ({fastest[0].schedule}, {fastest[1].schedule}) are "
                       f"{gap:.0%} apart but their calls spread by {noise:.0%}: their order is "
                       "within the noise (more --repeats)")
    return out


def summarize(spec: BenchSpec, measured: dict[str, Any], cluster: ClusterSpec) -> BenchResult:
    """Join rank 0's measurements with the simulator's predictions."""
    pair = spec.pair()
    runs = {str(s): simulate_pair(pair, s, cluster) for s in spec.schedules}
    any_run = next(iter(runs.values()))
    by_engine = {"library collective": measured["collective_s"],
                 "sm (runtime)": measured["comm_sm_s"], "dma (runtime)": measured["comm_dma_s"]}
    res = BenchResult(spec, cluster.name, measured["gemm_s"], min(by_engine.values()),
                      by_engine, any_run.gemm_whole_s, any_run.comm_whole_s,
                      trace=measured["trace"])
    seq = measured["schedules"]["seq/sm"]["median_s"]
    for s in map(str, spec.schedules):
        m = measured["schedules"][s]
        t = m["median_s"]
        room = seq - res.ideal_s
        times = m.get("times_s") or [t]
        res.rows.append(BenchRow(s, m["engine"], t, runs[s].time_s, seq / t,
                                 (seq - t) / room if room > 0 else 0.0,
                                 (max(times) - min(times)) / t if t > 0 else 0.0))
    return res
