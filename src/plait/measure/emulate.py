"""`plait bench --emulate-link`: finer-grain schedules on one device against an emulated link
(see `plait.runtime.emulated`), measured next to the simulator's prediction for a cluster whose
link is the measured host-to-device copy."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from plait.runtime import execute
from plait.runtime.emulated import EmulatedGroup, EmulatedLinkEngine, emulated_group
from plait.runtime.timing import time_calls
from plait.schedule.schedule import Schedule
from plait.sim.pair import simulate_pair
from plait.spec.dtypes import torch_dtype
from plait.spec.hardware import ClusterSpec, DmaSpec, Topology
from plait.workload.operators import Axis, OverlapPair

SCHEDULES = tuple(Schedule.parse(s) for s in (
    "seq/dma", "p2p/dma/M", "fine/dma/c1/g1/M", "fine/dma/c2/g1/M", "fine/dma/c4/g1/M",
    "fine/dma/c8/g1/M", "fine/dma/c2/peer/M", "fine/dma/c4/peer/M"))


def _timer(device: torch.device, fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median seconds of `fn` on this one device."""
    return statistics.median(time_calls(fn, warmup, repeats, device=device, ranks=False))


def emulate(m: int, n: int, k: int, ranks: int, device: torch.device, base: ClusterSpec,
            warmup: int = 2, repeats: int = 5, schedules: tuple[Schedule, ...] = SCHEDULES
            ) -> dict[str, Any]:
    dtype_name = "bf16" if device.type == "cuda" else "fp32"
    dt = torch_dtype(dtype_name)
    a = torch.randn(m // ranks, k, dtype=dt, device=device)
    w = torch.randn(k, n, dtype=dt, device=device)
    full = torch.randn(m, k, dtype=dt, device=device)

    groups: dict[tuple[int, int, int], EmulatedGroup] = {}  # made once, outside the timing

    def group(key: tuple[int, int, int], shard: torch.Tensor) -> EmulatedGroup:
        if key not in groups:
            groups[key] = emulated_group(key[0], shard, key[1])[0]
        return groups[key]

    def run(s: Schedule, weight: torch.Tensor, shard: torch.Tensor = a, world: int = ranks
            ) -> None:
        rt = group((world, s.chunks, shard.shape[0]), shard)
        execute.all_gather_matmul(rt, shard, [weight], s, Axis.M, False, "emulated")

    # The link, through the executor with an empty GEMM: every virtual peer's shard (its
    # bandwidth), and a small piece of one shard on two ranks (one copy).
    shard_bytes = a.numel() * a.element_size()
    w0 = torch.empty(k, 0, dtype=dt, device=device)
    seq_dma = Schedule.parse("seq/dma")
    link_all = _timer(device, lambda: run(seq_dma, w0), warmup, repeats)
    small = a[: max(1, a.shape[0] // 64)].contiguous()
    link_small = _timer(device, lambda: run(seq_dma, w0, small, 2), warmup, repeats)
    moved = shard_bytes * (ranks - 1)
    small_bytes = small.numel() * small.element_size()
    bw = max(moved - small_bytes, 1) / max(link_all - link_small, 1e-9)
    copy_s = copy_overhead(device, warmup, repeats)
    # What the small call took beyond its one copy is the call's own: the host's work before
    # its first copy is issued and after its last completes, once per call however many
    # copies it makes (the copies themselves pipeline on the link's stream).
    call_s = max(link_small - small_bytes / bw - copy_s, 0.0)
    gemm = _timer(device, lambda: full @ w, warmup, repeats)
    measured = {str(s): _timer(device, functools.partial(run, s, w), warmup, repeats)
                for s in schedules}
    for rt in groups.values():
        rt.engine.close()

    predicted = predict(m, n, k, ranks, dtype_name, base, bw, copy_s, call_s, schedules)
    return {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(),
            "shape": [m, n, k], "ranks": ranks, "gemm_s": gemm, "link_s": link_all,
            "link_bytes_per_s": bw, "copy_overhead_s": copy_s, "call_overhead_s": call_s,
            "measured_s": measured, "predicted_s": predicted}


def emulated_cluster(base: ClusterSpec, ranks: int, link_bytes_per_s: float,
                     copy_overhead_s: float) -> ClusterSpec:
    """`base` with `ranks` GPUs joined by the emulated link: one copy engine at the link's
    bandwidth, each copy command costing `copy_overhead_s`."""
    return base.model_copy(update={
        "name": f"{base.name}+emulated-link", "gpus_per_node": ranks,
        "topology": Topology(kind="switched", link_bytes_per_s=link_bytes_per_s, latency_s=0.0),
        "gpu": base.gpu.model_copy(update={"dma": DmaSpec(
            engines=1, bytes_per_s=link_bytes_per_s, command_overhead_s=copy_overhead_s)}),
        "params": base.params.model_copy(update={"dma_link_fraction": 1.0})})


def predict(m: int, n: int, k: int, ranks: int, dtype: str, base: ClusterSpec,
            link_bytes_per_s: float, copy_overhead_s: float, call_overhead_s: float,
            schedules: tuple[Schedule, ...] = SCHEDULES) -> dict[str, float]:
    """The simulator's time of each schedule on the emulated link, plus the measured fixed
    cost of one call (timed alone, each call pays it once)."""
    cluster = emulated_cluster(base, ranks, link_bytes_per_s, copy_overhead_s)
    pair = OverlapPair.build("ag", m, n, k, ranks, dtype=dtype, name="emulated")
    return {str(s): simulate_pair(pair, s, cluster).time_s + call_overhead_s
            for s in schedules}


# The copy probe: one copy of PROBE_BYTES, then COPIES copies of 1/COPIES each: 8 MiB, about
# 150 us on a 55 GB/s link, several times what the host takes to queue one (a probe whose
# copies are shorter than that measures the host, not the copy engine).
COPIES = 8
PROBE_BYTES = 64 << 20


def copy_overhead(device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds each copy command adds beyond its bytes on the emulated link: the same bytes
    as one copy and as `COPIES` copies queued back to back (each long enough that the host
    queues them faster than the link drains them), the difference over the extra copies."""
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    engine = EmulatedLinkEngine([host], device, timeout_s=600.0)
    dst = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)

    def copies(count: int) -> None:
        size = PROBE_BYTES // count
        handles = [engine.pull(1, 0, i * size, dst[i * size:(i + 1) * size], "copy probe")
                   for i in range(count)]
        for h in handles:
            h.wait()
        engine.end()

    one = _timer(device, functools.partial(copies, 1), warmup, repeats)
    many = _timer(device, functools.partial(copies, COPIES), warmup, repeats)
    engine.close()
    return max((many - one) / (COPIES - 1), 0.0)
