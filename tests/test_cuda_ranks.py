"""Several CUDA ranks for real: 2 and 4 processes sharing one GPU (symmetric memory may map one
device from several processes with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1; a gloo group
carries the host side). The copy-engine transport (`CudaPeerCopyEngine`) moves every `/dma`
schedule's data between the processes, exact against the plain reference; the defects a
reading found in it are checked where they would show (`bash bench/gpu_check.sh` runs this
module). NCCL refuses two ranks on one device, so the `/sm` schedules run on a single GPU only
where gloo moves CUDA tensors; they are left to a machine with a GPU per rank."""

from __future__ import annotations

import os

import pytest
import torch

from plait.runtime.launch import run_ranks
from tests import runtime_cases as cases
from tests.runtime_cases import _err, _rand

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA (several processes on one GPU)"),
]

DMA = [s for s in cases.AG_SCHEDULES if "/dma" in s]


@pytest.fixture(autouse=True)
def _overlapping_devices(monkeypatch):
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")


def _on_gpu() -> torch.device:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    return dev


def _every_dma_schedule(rank, world):
    """Each /dma schedule of AG->GEMM, GEMM->RS and both all-to-all pairs, twice (the buffer
    reused), then a larger call (the buffer grown); errors against the CPU reference, and the
    engine that ran."""
    from plait.runtime.context import runtime_of

    dev = _on_gpu()
    errs: dict[str, float] = {}
    for i, s in enumerate(DMA):
        for repeat in range(2):
            seed = 100 * i + repeat
            e, _, ran = cases.all_gather_matmul_case(rank, world, seed, torch.float32, s,
                                                     0, 2, False, device=dev)
            errs |= {f"ag {s} {repeat} {k}": v for k, v in e.items()}
            assert ran == (s, "peer_copy(cuda symmetric memory)"), ran
            e, _ = cases.matmul_reduce_scatter_case(rank, world, seed, torch.float32, s, 0,
                                                    device=dev)
            errs |= {f"rs {s} {repeat} {k}": v for k, v in e.items()}
        for combine in (False, True):
            e, _ = cases.exchange_ops_case(rank, world, 7 * i, s, combine, device=dev)
            errs |= {f"a2a {combine} {k}": v for k, v in e.items()}
    # a larger call than the first 1 MiB buffer: grown, every peer done with the old one
    a = _rand((world * 1024, 512), 5, torch.float32)
    w = _rand((512, 64), 6, torch.float32)
    from plait import ops

    _, (y,) = ops.all_gather_matmul(a.chunk(world)[rank].to(dev), [w.to(dev)],
                                    schedule="fine/dma/c2/g1/M")
    errs["grown"] = _err(y, a @ w)
    runtime_of(None).close()
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_every_dma_schedule_between_processes_on_one_gpu_is_exact(world):
    for rank, errs in enumerate(run_ranks(world, _every_dma_schedule, timeout_s=400)):
        bad = {k: v for k, v in errs.items() if not v <= 2e-4}
        assert not bad, f"rank {rank}: {bad}"


def _alternating_streams(rank, world, delay_cycles):
    """Consecutive calls on two streams, rank 1 delayed on the device before each: without
    the order across streams (fix 2) the next call overwrote the buffer a slow peer was
    still reading."""
    from plait import ops

    dev = _on_gpu()
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    w = _rand((64, 32), 1, torch.float32).to(dev)
    outs, refs = [], []
    for i in range(8):
        a = _rand((world * 64, 64), 10 + i, torch.float32)
        s = streams[i % 2]
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            if rank == 1:
                torch.cuda._sleep(delay_cycles)
            _, (y,) = ops.all_gather_matmul(a.chunk(world)[rank].to(dev), [w],
                                            schedule="fine/dma/c2/g1/M")
            outs.append(y)
        refs.append(a @ w.cpu())
    torch.cuda.synchronize(dev)
    return max(_err(y, r) for y, r in zip(outs, refs, strict=True))


def test_calls_on_alternating_streams_with_a_slow_rank_read_their_own_data():
    for err in run_ranks(2, _alternating_streams, 50_000_000, timeout_s=300):
        assert err <= 2e-4


def _late_rank(rank, world, late_s):
    """A warmed-up call with rank 1 late on the host by more than the runtime's timeout:
    device waits never trap (fix 3), so the call completes once it arrives, and the CUDA
    context lives on. Then a first call with rank 1 late: a clean error on every rank."""
    import time

    from plait import ops
    from plait.runtime.context import Runtime

    dev = _on_gpu()
    import torch.distributed as dist

    rt = Runtime(dist.group.WORLD, timeout_s=late_s / 2)
    a = _rand((world * 64, 64), 3, torch.float32)
    w = _rand((64, 32), 4, torch.float32)
    ops.all_gather_matmul(a.chunk(world)[rank].to(dev), [w.to(dev)], group=rt,
                          schedule="fine/dma/c2/g1/M")  # warm-up: buffer and first check
    if rank == 1:
        time.sleep(late_s)
    _, (y,) = ops.all_gather_matmul(a.chunk(world)[rank].to(dev), [w.to(dev)], group=rt,
                                    schedule="fine/dma/c2/g1/M")
    steady = _err(y, a @ w)
    if rank == 1:
        time.sleep(late_s)
    try:
        ops.all_gather_matmul(a[:, :32].chunk(world)[rank].to(dev), [w[:32].to(dev)], group=rt,
                              schedule="fine/dma/c2/g1/M")  # a new signature: checked first
        first = "completed"
    except Exception as exc:  # what a late rank meets is the result
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
    alive = float(torch.ones(4, device=dev).sum()) == 4.0
    return steady, first, alive


def test_a_late_rank_is_waited_for_in_steady_state_and_a_clean_error_at_first_use():
    results = run_ranks(2, _late_rank, 12.0, timeout_s=300)
    for rank, (steady, _first, alive) in enumerate(results):
        assert steady <= 2e-4 and alive, (rank, steady, alive)
    assert "not every rank" in results[0][1] or "Timeout" in results[0][1], results[0][1]


def _no_host_sync_and_capture(rank, world):
    """A warmed-up call makes no host synchronization; one captured in a CUDA graph replays
    exactly, or capture is refused in one line (fix 8)."""
    from plait import ops
    from plait.errors import SpecError

    dev = _on_gpu()
    w = _rand((64, 32), 1, torch.float32).to(dev)
    a = _rand((world * 64, 64), 2, torch.float32)
    x = a.chunk(world)[rank].to(dev)
    with torch.no_grad():
        for _ in range(2):
            ops.all_gather_matmul(x, [w], schedule="fine/dma/c2/g1/M")
        torch.cuda.synchronize(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, (y,) = ops.all_gather_matmul(x, [w], schedule="fine/dma/c2/g1/M")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        synced = _err(y, a @ w.cpu())
        cold = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cold):
                ops.all_gather_matmul(x[:, :32].contiguous(), [w[:32]],
                                      schedule="fine/dma/c2/g1/M")
            refused = ""
        except SpecError as exc:
            refused = str(exc)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                _, (static,) = ops.all_gather_matmul(x, [w], schedule="fine/dma/c2/g1/M")
            x.copy_(x * 2)
            graph.replay()
            torch.cuda.synchronize(dev)
            captured = f"replayed, error {_err(static, 2 * a @ w.cpu()):.1e}"
        except Exception as exc:  # reported as found
            captured = f"refused: {type(exc).__name__}: {exc}".splitlines()[0]
    return synced, refused, captured


def test_a_steady_call_syncs_nothing_and_a_cold_capture_says_warm_up():
    for synced, refused, captured in run_ranks(2, _no_host_sync_and_capture, timeout_s=300):
        assert synced <= 2e-4
        assert "warm up" in refused, refused
        print("CUDA graph of a /dma call:", captured)
        assert captured.startswith(("replayed", "refused")), captured


def _overlap_f_b_on_cuda(rank, world, schedule, profile_dir):
    """2 ranks on the one GPU, each a DualPipeV pipeline of 2 stages (its own NCCL group of
    one rank), the stages' plait layers TP over both ranks (gloo + the copy engine): the
    default OVERLAP_F_B (a stream per stage, twins) against PyTorch's order; the kernels of
    each strand on its stage's stream, from a profiler trace."""
    import json

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from plait.nn import ColumnParallelLinear, RowParallelLinear
    from plait.pipelining import overlap_f_b
    from plait.runtime.context import close_all

    dev = _on_gpu()
    H, FFN, T, MB = 64, 128, 32, 4
    tp = dist.group.WORLD
    own = dist.new_group([rank], backend="nccl", use_local_synchronization=True)

    class Dense(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.fc1 = ColumnParallelLinear(H, FFN, tp, schedule=schedule, device=dev)
            self.fc2 = RowParallelLinear(FFN, H, tp, schedule=schedule, device=dev)
            with torch.no_grad():
                self.fc1.weight.copy_(torch.randn(FFN, H, generator=g).chunk(world, 0)[rank])
                self.fc2.weight.copy_(torch.randn(H, FFN, generator=g).chunk(world, 1)[rank])

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    def step(overlapped, trace):
        blocks = [Dense(s) for s in range(2)]
        pipe = [PipelineStage(b, s, 2, dev, group=own) for s, b in enumerate(blocks)]
        sched = ScheduleDualPipeV(pipe, n_microbatches=MB,
                                  loss_fn=lambda out, y: (out - y).square().sum())
        ran = overlap_f_b(sched, measure=0) if overlapped else None
        g = torch.Generator().manual_seed(9)
        xs = torch.randn(MB * T, H, generator=g).chunk(world)[rank].to(dev)
        ys = torch.randn(MB * T, H, generator=g).chunk(world)[rank].to(dev)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for stream in ran.streams.values() if ran is not None else ():
                with torch.cuda.stream(stream):  # a marker kernel names each stage's stream
                    torch.cuda._sleep(1000)
            sched.step(xs, target=ys)
            torch.cuda.synchronize(dev)
        if trace is not None:
            prof.export_chrome_trace(trace)
        return [p.grad.cpu() for b in blocks for p in b.parameters()], ran

    plain, _ = step(False, None)
    trace = os.path.join(profile_dir, f"rank{rank}.json")
    grads, ran = step(True, trace)
    with open(trace) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]

    def streams_of(word):
        return {int(e["args"]["stream"]) for e in kernels if word in e["name"].lower()}

    close_all()
    return ([float((a - b).abs().max()) for a, b in zip(grads, plain, strict=True)],
            [r.overlapped for r in ran.records], sorted(streams_of("gemm")),
            sorted(streams_of("spin")))


@pytest.mark.parametrize("schedule", ["fine/dma/c2/g1/M", "seq/dma"])
def test_overlap_f_b_between_two_cuda_ranks_runs_on_the_stage_streams(schedule, tmp_path):
    for rank, (diffs, overlapped, gemm, stages) in enumerate(
            run_ranks(2, _overlap_f_b_on_cuda, schedule, str(tmp_path), timeout_s=400)):
        assert max(diffs) <= 1e-4, (rank, diffs)
        assert overlapped and all(overlapped), (rank, overlapped)
        # every GEMM on a stage's stream, and each stage's stream ran some
        assert len(stages) == 2 and set(gemm) == set(stages), (rank, gemm, stages)
