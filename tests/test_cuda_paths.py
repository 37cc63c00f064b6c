"""plait's CUDA paths, checked on a CPU: each defect found at first contact with a GPU (or by a
reading of the CUDA paths against torch's sources) has a test here that fails without its fix,
the CUDA calls replaced by stand-ins that record what they were asked."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from plait.runtime import launch
from plait.runtime.launch import run_ranks

# -- ranks start so that CUDA works in them ---------------------------------------------------

_POISON = {"on": False}


def _poison_forked_children() -> None:
    """What a parent that initialized CUDA leaves to a child it forks: CUDA cannot be used
    there (torch's `_is_in_bad_fork`)."""
    if _POISON["on"]:
        torch.cuda._is_in_bad_fork = lambda: True


os.register_at_fork(after_in_child=_poison_forked_children)


@pytest.mark.slow
def test_ranks_can_use_cuda_after_their_caller_initialized_it(monkeypatch):
    """A process forked after its parent touched CUDA (even `torch.cuda.is_available()`) cannot
    use CUDA, and Dynamo in it dies even for CPU work. Ranks come from a fork server that
    never touched CUDA, so this parent's state does not reach them."""
    monkeypatch.setitem(_POISON, "on", True)
    assert run_ranks(2, lambda r, w: torch.cuda._is_in_bad_fork(), timeout_s=60) == [False] * 2


@pytest.mark.slow
def test_ranks_take_the_callers_environment_closures_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_TEST_VALUE", "seen")
    monkeypatch.chdir(tmp_path)
    captured = {"k": 3}

    def body(rank: int, world: int) -> tuple[str | None, str, int]:
        return os.environ.get("PLAIT_TEST_VALUE"), os.getcwd(), captured["k"] + rank

    got = run_ranks(2, body, timeout_s=60)
    assert got == [("seen", str(tmp_path), 3), ("seen", str(tmp_path), 4)]


def test_a_function_that_cannot_travel_is_one_clear_error():
    import threading

    from plait.errors import SpecError

    lock = threading.Lock()
    with pytest.raises(SpecError, match="cannot be sent to the ranks"):
        run_ranks(1, lambda r, w: lock.locked())


# -- a group's backend and device --------------------------------------------------------------


def _backend_config(monkeypatch, config: str, cuda: bool) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


@pytest.mark.parametrize(("config", "cuda", "backend", "device"), [
    ("cpu:gloo,cuda:nccl", True, "nccl", "cuda:3"),  # init_process_group() with no backend
    ("cuda:nccl", True, "nccl", "cuda:3"),
    ("nccl", True, "nccl", "cuda:3"),
    ("cpu:gloo,cuda:gloo", True, "gloo", "cpu"),  # gloo on a GPU machine stays on the CPU
    ("cpu:gloo", True, "gloo", "cpu"),
    ("cpu:gloo,cuda:nccl", False, "gloo", "cpu"),
])
def test_a_group_runs_on_the_gpu_whenever_its_cuda_backend_is_nccl(monkeypatch, config, cuda,
                                                                    backend, device):
    """`get_backend()` says "undefined" for a group made without a backend, and
    "cuda:nccl,cpu:gloo" is not "nccl": a GPU job was treated as a CPU one."""
    _backend_config(monkeypatch, config, cuda)
    assert launch.group_backend(None) == backend
    assert launch.group_device(None) == torch.device(device)


def test_a_runtime_and_the_tuner_see_a_gpu_group_from_its_backend_config(monkeypatch):
    from plait.runtime.context import Runtime
    from plait.tuning.tuner import detect_hardware

    _backend_config(monkeypatch, "cpu:gloo,cuda:nccl", True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rt = Runtime(group=None)  # type: ignore[arg-type]
    assert (rt.backend, rt.device) == ("nccl", torch.device("cuda", 3))
    assert detect_hardware(lambda msg: None) == "h200"


# -- CUDA device and synchronization ------------------------------------------------------------


def test_a_local_profile_on_cuda_n_makes_it_the_current_device(monkeypatch):
    """`plait profile --local --device cuda:1` timed device 0: events and synchronizations
    that name no device act on the current one."""
    from plait.measure import profile as prof

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", d)))
    monkeypatch.setattr(prof, "_measure", lambda key, plan, timer, device:
                        calls.append(("measure", device)) or 1e-3)
    plan = prof.ProfilePlan(local=True, device="cuda:1", parts=("gemm",))
    prof.profile_local(plan, plan.todo(())[:1], lambda item: None)
    assert calls == [("set", torch.device("cuda", 1)), ("measure", "cuda:1")]


def test_the_timer_synchronizes_the_device_it_times(monkeypatch):
    from plait.runtime.timing import device_sync

    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    device_sync("cuda:1")()
    device_sync("cpu")()
    assert synced == [torch.device("cuda", 1)]


# -- collectives are waited without blocking the host ---------------------------------------


def test_a_collective_on_a_gpu_is_waited_without_a_host_blocking_timeout():
    """NCCL's `Work.wait(timeout=...)` blocks the host until the collective completes;
    `wait()` makes the stream wait, and the group's own timeout bounds a hang. On a CPU the
    wait blocks anyway and the runtime's own timeout bounds it."""
    from plait.runtime.engines import CollectiveEngine, WorkHandle

    class Work:
        def __init__(self) -> None:
            self.kwargs: list[dict[str, object]] = []

        def wait(self, **kwargs: object) -> bool:
            self.kwargs.append(kwargs)
            return True

    engine = CollectiveEngine.__new__(CollectiveEngine)
    engine.timeout_s = 5.0
    on_gpu = torch.empty(2, device="meta")  # any device but the CPU's
    works = [Work(), Work()]
    engine.handle(works, on_gpu, "ag step 1").wait()  # type: ignore[arg-type]
    assert [w.kwargs for w in works] == [[{}], [{}]]
    cpu = Work()
    engine.handle([cpu], torch.empty(2), "ag step 1").wait()  # type: ignore[list-item]
    assert list(cpu.kwargs[0]) == ["timeout"]

    class Failed:
        def wait(self, **kwargs: object) -> bool:
            raise RuntimeError("timed out after 5 s")

    with pytest.raises(TimeoutError, match="ag step 1: timed out"):
        WorkHandle([Failed()], None, "ag step 1").wait()  # type: ignore[list-item]


# -- FP8 row numbers ------------------------------------------------------------------------


def test_fp8_row_numbers_are_made_on_the_device_and_only_when_asked(monkeypatch):
    """A host list copied to the GPU per FP8 GEMM piece synchronized the stream, even for
    tensor-wise scales, which need no row numbers."""
    from plait.runtime.execute import _block_rows

    def no_host_list(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("row numbers made from a host list")

    coords = [(1, 0), (0, 1), (3, 1)]
    rows = _block_rows(coords, 8, 4, torch.device("cpu"))
    monkeypatch.setattr(torch, "tensor", no_host_list)
    want = [q * 8 + j * 4 + i for q, j in coords for i in range(4)]
    assert rows().tolist() == want


# -- PyTorch's fused ops as auto candidates ---------------------------------------------------


def test_pytorchs_fused_ops_need_no_enable_call_where_torch_deprecated_it(monkeypatch):
    from torch.distributed import _symmetric_memory as symm

    from plait.tuning.tuner import symm_mem_ready

    if getattr(getattr(symm, "enable_symm_mem_for_group", None), "__deprecated__", None):
        assert symm_mem_ready("some-group")  # this torch: the call is deprecated
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", lambda name: None)  # an older one
    monkeypatch.setattr(symm, "is_symm_mem_enabled_for_group", lambda name: name == "on")
    assert symm_mem_ready("on") and not symm_mem_ready("off")


# -- plait doctor -------------------------------------------------------------------------------


class _FakeCuda:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_device_capability(self, i: int = 0) -> tuple[int, int]:
        return (9, 0)

    def can_device_access_peer(self, i: int, j: int) -> bool:
        return True


class _FakeTorch:
    def __init__(self, n: int) -> None:
        self.cuda = _FakeCuda(n)


@pytest.mark.parametrize("offered", [True, False, None])
def test_doctor_asks_the_driver_for_multicast(monkeypatch, offered):
    """Any sm_90 with two GPUs was reported "ok", an H100 PCIe (no NVSwitch) too."""
    from plait.measure import doctor

    monkeypatch.setattr(doctor, "multicast_support", lambda torch_, device: offered)
    (check,) = [c for c in doctor._copy_engine_checks(_FakeTorch(2), True, 2)
                if c.name.startswith("multicast")]
    assert check.status == ("ok" if offered else "warn")
    assert ("offers it" in check.found) == bool(offered)


def test_doctor_says_nccl_p2p_disable_leaves_the_copy_engine_path_alone():
    from plait.measure.doctor import environment_checks

    (check,) = environment_checks({"NCCL_P2P_DISABLE": "1"})
    assert "does not change" in check.means and "symmetric memory" in check.means


# -- bench memory --------------------------------------------------------------------------------


def test_bench_memory_on_gpus_is_each_gpus_own(monkeypatch):
    """GPU ranks (torchrun, one per GPU) each hold their operands on their own GPU: checked
    against that GPU's free memory, not the host's."""
    from plait.errors import SpecError
    from plait.measure import bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (3 * 2**30, 141 * 2**30))
    shape = ("ag", 16384, 4096, 8192, 8, 1, "bf16")  # 1.4 GiB a rank, 11.5 GiB for 8
    bench.check_memory(*shape, gpu=True)  # fits one GPU's 3 GiB
    with pytest.raises(SpecError, match=r"each GPU needs about 1\.4 GiB; this GPU has 1\.0"):
        bench.check_memory(*shape, available=2**30, gpu=True)
    with pytest.raises(SpecError, match=r"8 ranks need about 11\.5 GiB"):
        bench.check_memory(*shape, available=3 * 2**30)


# -- the torch plait runs on ------------------------------------------------------------------


def test_an_older_torch_is_refused_at_import_in_one_line(monkeypatch):
    import importlib

    import plait.runtime

    assert plait.runtime.version_of("2.11.0+cu130") == (2, 11)
    assert plait.runtime.version_of("2.13.0a0+git1234") == (2, 13)
    monkeypatch.setattr(torch, "__version__", "2.10.1+cpu")
    with pytest.raises(ImportError, match=r"torch: plait needs torch >= 2\.11, found "
                       r"2\.10\.1\+cpu\. Fix: pip install 'torch>=2\.11'"):
        importlib.reload(plait.runtime)
    monkeypatch.undo()
    importlib.reload(plait.runtime)


def test_the_command_line_says_an_older_torch_in_one_line():
    import subprocess
    import sys

    code = ("import sys, torch; torch.__version__ = '2.10.1'\n"
            "sys.argv = ['plait', 'bench', '--shape', '64x8x16', '--ranks', '1']\n"
            "from plait.cli.main import main; main()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) <= 2, res.stderr  # rich wraps at 80 columns
    assert "Traceback" not in res.stderr and "plait needs torch >= 2.11" in res.stderr


def test_a_cpu_job_on_a_gpu_machine_never_initializes_cuda_to_tune(monkeypatch):
    """`schedule="auto"` inside a checkpoint's forward asked for the GPU's name: CUDA then
    initialized there, which PyTorch's checkpoint refuses."""
    from plait.tuning.tuner import detect_hardware, fingerprint

    def initializes(*args: object) -> str:
        raise AssertionError("CUDA initialized")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", initializes)
    assert fingerprint()["device"].startswith("cpu")
    assert detect_hardware(lambda msg: None) == "cpu"


def test_torchrun_with_more_ranks_than_gpus_is_one_clear_error(monkeypatch):
    """Two NCCL ranks on one GPU fail deep inside NCCL; say so before."""
    from plait.errors import SpecError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SpecError, match="nproc-per-node: 2 ranks on a node with 1 GPU"):
        launch.init_from_env()


# -- a profile's contention on a GPU ------------------------------------------------------------

# `plait profile --local --device cuda` on one H200 (bench/results/gpu_h200/h200.yaml): a copy
# that outlasts the GEMM (128 MiB), one that finishes beside it (16 MiB), and stand-ins too
# short to tell anything (device-to-device and SM copies, 16 and 128 MiB).
_H200_CONTENTION = {
    "contention/dma/16384": (0.001427, 0.0004518, 0.001604, 0.001431, 0.0001143),
    "contention/dma/131072": (0.001431, 0.002529, 0.002546, 0.001435, 0.0001286),
    "contention/d2d/16384": (0.001434, 7.079e-05, 0.001536, 0.001426, 7.688e-05),
    "contention/sm/131072": (0.00145, 0.0001294, 0.001564, 0.00145, 8.115e-05),
}


def test_a_copy_that_finishes_beside_the_gemm_only_bounds_its_slowdown():
    """The H200's first calibration slowed copies beside a GEMM by 40%: a copy that finished
    before the GEMM only bounds its rate from below, and was averaged as if it were measured
    (ground truth: a host-to-device copy hides 96% beside a GEMM)."""
    from plait.measure.profile import ProfilePlan, calibration_from
    from plait.spec.hardware import load_hardware

    names = ("gemm_alone_s", "comm_alone_s", "both_s", "gemm_with_comm_s", "start_s")
    items = {k: dict(zip(names, v, strict=True)) for k, v in _H200_CONTENTION.items()}
    plan = ProfilePlan(local=True, device="cpu", parts=("contention",))
    params = calibration_from(items, plan, load_hardware("h200"), "test")["params"]
    assert params["dma_slowdown_under_compute"] == pytest.approx(0.012, abs=0.005)
    assert "sm_comm_slowdown_under_compute" not in params  # too short to say anything


@pytest.mark.slow
def test_ranks_import_the_callers_modules_from_its_path_as_it_is_at_the_call(monkeypatch,
                                                                            tmp_path):
    """A function travels by reference when its module is importable: the rank imports it
    from the caller's import path as it is now, not as it was when the fork server started."""
    import importlib

    run_ranks(1, lambda r, w: None, timeout_s=60)  # the fork server is up before the path grows
    (tmp_path / "plait_rank_body_module.py").write_text(
        "def body(rank, world):\n    return rank * 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("plait_rank_body_module")
    assert run_ranks(2, module.body, timeout_s=60) == [0, 10]


def test_doctor_fails_a_torch_plait_does_not_run_on(monkeypatch):
    import sys

    from plait.measure import doctor

    monkeypatch.setattr(torch, "__version__", "2.10.1")
    monkeypatch.delitem(sys.modules, "plait.runtime")  # imported afresh, as on that torch
    (check,) = doctor.device_checks(torch)
    assert (check.name, check.status) == ("torch", "fail")
    assert "plait needs torch >= 2.11" in check.means and "pip install" in check.means


# -- several CUDA ranks: the copy engine's protocol, with CUDA and symmetric memory stood in --


class _RecordingCuda:
    """`torch.cuda` as the copy engine uses it: streams and events that log what is asked of
    them, a current stream per device (asked for without a device: an error)."""

    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []
        self.capturing = False
        self.count = 0
        self.cur = self.Stream(device="cuda:1", name="S1")

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def Stream(self, device, name=None):
        cuda = self

        class Stream:
            def __init__(self) -> None:
                self.name, self.device = name or cuda._name("copy"), device

            def wait_stream(self, other) -> None:
                cuda.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, ev) -> None:
                cuda.log.append(("wait_event", self.name, ev.name))

        return Stream()

    def Event(self):
        cuda = self

        class Event:
            name = cuda._name("E")

            def record(self, stream) -> None:
                cuda.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                cuda.log.append(("synchronize", self.name))

        return Event()

    def current_stream(self, device=None):
        assert device is not None, "current_stream without a device: the thread's device"
        return self.cur

    def stream(self, s):
        from contextlib import contextmanager

        @contextmanager
        def on():
            before, self.cur = self.cur, s
            try:
                yield
            finally:
                self.cur = before
        return on()

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


class _FakeSymmMem:
    """Symmetric memory of 2 ranks in host memory; signals and barriers logged with the stream
    they were issued on."""

    def __init__(self, cuda: _RecordingCuda, channels: int = 8) -> None:
        self.cuda, self.channels, self.buffers = cuda, channels, [None, None]

    def empty(self, n, dtype, device):
        self.buffers = [torch.zeros(n, dtype=dtype) for _ in range(2)]
        return self.buffers[0]

    def rendezvous(self, buffer, group):
        self.cuda.log.append(("rendezvous", buffer.numel()))
        symm = self

        class Handle:
            signal_pad_size = 4 * 2 * symm.channels

            def get_buffer(self, rank, shape, dtype, storage_offset):
                flat = symm.buffers[rank].view(dtype)
                n = math.prod(shape)
                return flat[storage_offset:storage_offset + n].view(shape)

            def put_signal(self, peer, channel, timeout_ms):
                symm.cuda.log.append(("put_signal", symm.cuda.cur.name, channel, timeout_ms))

            def wait_signal(self, peer, channel, timeout_ms):
                symm.cuda.log.append(("wait_signal", symm.cuda.cur.name, channel, timeout_ms))

            def barrier(self, channel, timeout_ms):
                symm.cuda.log.append(("barrier", symm.cuda.cur.name, channel, timeout_ms))

        return Handle()


def _cuda_engine(monkeypatch, channels: int = 8):
    from plait.runtime.cuda_peer import CudaPeerCopyEngine

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    cuda = _RecordingCuda()
    engine = CudaPeerCopyEngine(None, 60.0, torch.device("cuda", 1), cuda=cuda,  # type: ignore[arg-type]
                                symm_mem=_FakeSymmMem(cuda, channels))
    return engine, cuda


def _one_call(engine, cuda, stream_name: str, nbytes: int = 64) -> None:
    cuda.cur = cuda.Stream(device="cuda:1", name=stream_name)
    engine.begin(nbytes, slots=2)
    engine.publish(0, 0, torch.ones(4))
    engine.publish(1, 16, torch.ones(4))
    engine.pull(1, 0, 0, torch.empty(4), "block 0")
    engine.pull(1, 1, 16, torch.empty(4), "block 1")
    engine.end()


def test_the_copy_engine_never_lets_a_device_wait_trap(monkeypatch):
    """A signal kernel that times out traps and takes the CUDA context with it: a rank late
    by more than the runtime's 60 s (a checkpoint save, a first-step compile) killed the job.
    Device waits are unbounded (timeout 0, as PyTorch passes); the host bounds a dead peer."""
    engine, cuda = _cuda_engine(monkeypatch)
    _one_call(engine, cuda, "S1")
    timeouts = [e[3] for e in cuda.log if e[0] in ("put_signal", "wait_signal", "barrier")]
    assert timeouts and set(timeouts) == {0}


def test_published_blocks_and_the_closing_barrier_signal_on_channels_of_their_own(
        monkeypatch):
    """The publish of block 0 and the closing barrier both used channel 0 (PyTorch keeps 0
    for the barrier, 1.. for published data)."""
    engine, cuda = _cuda_engine(monkeypatch)
    _one_call(engine, cuda, "S1")
    barriers = {e[2] for e in cuda.log if e[0] == "barrier"}
    signals = {e[2] for e in cuda.log if e[0] in ("put_signal", "wait_signal")}
    assert barriers == {0} and signals == {1, 2}
    with pytest.raises(Exception, match="signal channels"):  # 8 channels: 0 and 7 blocks
        engine.begin(64, slots=8)


def test_a_call_on_another_stream_waits_for_the_last_calls_barrier_before_it_overwrites(
        monkeypatch):
    """The next call overwrote the symmetric buffer and signalled its peers ordered only
    after work on its own stream: from another stream (a strand's, a user's side stream) a
    slow peer could read the wrong call's data. Now the closing barrier is followed by an
    event, and the next call's stream waits for it before it writes or signals."""
    engine, cuda = _cuda_engine(monkeypatch)
    _one_call(engine, cuda, "S1")
    mark = len(cuda.log)
    _one_call(engine, cuda, "S2")
    first, second = cuda.log[:mark], cuda.log[mark:]
    barrier_at = first.index(("barrier", "S1", 0, 0))
    recorded = [e for e in first[barrier_at:] if e[0] == "record" and e[2] == "S1"]
    assert recorded, first  # an event after the barrier, on the barrier's stream
    waits = [i for i, e in enumerate(second) if e == ("wait_event", "S2", recorded[0][1])]
    signals = [i for i, e in enumerate(second) if e[0] == "put_signal"]
    assert waits and signals and waits[0] < signals[0], second
    # the copy stream takes the order on from the caller's stream
    assert ("wait_stream", engine.stream.name, "S2") in second


def test_a_grown_buffer_waits_for_every_peer_to_finish_with_the_old_one(monkeypatch):
    engine, cuda = _cuda_engine(monkeypatch)
    _one_call(engine, cuda, "S1")
    mark = len(cuda.log)
    _one_call(engine, cuda, "S1", nbytes=4 << 20)  # past the first 1 MiB buffer
    later = cuda.log[mark:]
    syncs = [i for i, e in enumerate(later) if e[0] == "synchronize"]
    grown = [i for i, e in enumerate(later) if e[0] == "rendezvous"]
    assert syncs and grown and syncs[0] < grown[0]


def test_cuda_graph_capture_before_warm_up_is_one_clear_error(monkeypatch):
    """A first call inside a CUDA-graph capture (the buffer's rendezvous, a host exchange)
    failed obscurely; PyTorch says "warm up before capture", and so does plait. A warmed-up
    call captures, without waiting on an event recorded before the capture."""
    from plait.errors import SpecError

    engine, cuda = _cuda_engine(monkeypatch)
    cuda.capturing = True
    with pytest.raises(SpecError, match="warm up"):
        engine.begin(64)
    cuda.capturing = False
    _one_call(engine, cuda, "S1")
    cuda.capturing = True
    mark = len(cuda.log)
    _one_call(engine, cuda, "S2")
    assert not [e for e in cuda.log[mark:] if e[0] in ("wait_event", "rendezvous")]


def test_the_first_check_of_a_call_inside_a_capture_says_warm_up(monkeypatch):
    from plait.errors import SpecError
    from plait.runtime import context

    rt = context.Runtime.__new__(context.Runtime)
    rt.verify_shapes, rt.verify_every_call, rt._verified = True, False, set()
    rt.group = None  # type: ignore[assignment]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(context, "capturing", lambda: True)
    with pytest.raises(SpecError, match="warm up"):
        rt.check_same("all_gather_matmul", [1, 2, 3], "")


def test_a_runtime_waits_for_a_peer_as_long_as_its_group_does(monkeypatch):
    """The runtime's own 60 s bounded host waits that the group allows 10 minutes (NCCL)."""
    from datetime import timedelta

    from plait.runtime import context, launch

    class Backend:
        options = type("Options", (), {"_timeout": timedelta(minutes=10)})()

    class Group:
        def _get_backend(self, device):
            return Backend()

    monkeypatch.setattr(launch, "group_device", lambda group=None: torch.device("cpu"))
    assert launch.group_timeout_s(Group()) == 600.0  # type: ignore[arg-type]
    assert context.Runtime(Group()).timeout_s == 600.0  # type: ignore[arg-type]
    assert context.Runtime(Group(), timeout_s=3).timeout_s == 3  # type: ignore[arg-type]


# -- OVERLAP_F_B on CUDA: strands' streams, device and timing ------------------------------


def _action(device: str, fs: int, bs: int):
    from types import SimpleNamespace

    return SimpleNamespace(device=torch.device(device), fs=fs, bs=bs)


def test_overlap_f_b_on_cuda_uses_twins_only_where_the_strands_have_streams_of_their_own():
    """Both strands' kernels on one CUDA stream while each issues collectives on its own
    communicator, in host orders that differ between ranks, wait on each other across ranks
    (a deadlock). Such an action runs its strands in ordered turns instead, and says so."""
    from plait.pipelining.overlap import Overlap, _twins

    twins = {"tp": "tp-twin"}
    own = Overlap(twins=twins, streams={0: object(), 3: object()})
    assert _twins(own, _action("cuda:0", 0, 3)) == (twins, "")
    assert _twins(own, _action("cpu", 0, 3)) == (twins, "")
    shared = _twins(own, _action("cuda:0", 3, 3))  # both halves on one stage's stream
    none = _twins(Overlap(twins=twins), _action("cuda:0", 0, 3))  # streams=False
    for got in (shared, none):
        assert got[0] == {} and "ordered turns" in got[1]


def test_overlap_f_b_gives_cuda_stages_a_stream_each_by_default(monkeypatch):
    import plait.pipelining.overlap as ov

    asked: list[object] = []
    monkeypatch.setattr(ov, "stream_per_stage", lambda s: asked.append(s) or {})
    monkeypatch.setattr(ov, "_pair_groups", lambda s: {})

    class Schedule:
        _stages = ()
        fwd_recv_ops = bwd_recv_ops = backward_counter = _n_microbatches = None
        _maybe_compute_loss = _maybe_get_loss = None

        def register_custom_function(self, action, fn) -> None:
            pass

    sched = Schedule()
    ov.overlap_f_b(sched, measure=0)
    ov.overlap_f_b(sched, measure=0, streams=False)
    assert asked == [sched]


def test_the_backward_strand_runs_on_the_callers_device_and_stream(monkeypatch):
    """A new thread starts on cuda:0 and its default stream: every rank's backward strand
    ran on device 0, and a stage's stream waited for the thread's default stream, not the
    step's."""
    import threading
    from contextlib import contextmanager

    from plait.pipelining.stages import callers_stream

    seen: dict[str, list[object]] = {"device": [], "stream": []}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"S@{device}")

    @contextmanager
    def enter(kind, value):
        seen[kind].append((threading.current_thread().name, value))
        yield

    monkeypatch.setattr(torch.cuda, "device", lambda d: enter("device", d))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: enter("stream", s))
    on_it = callers_stream(torch.device("cuda", 2))  # taken on the caller's thread

    def strand() -> None:
        with on_it():
            pass

    t = threading.Thread(target=strand, name="backward")
    t.start()
    t.join()
    assert seen == {"device": [("backward", torch.device("cuda", 2))],
                    "stream": [("backward", "S@cuda:2")]}
    assert callers_stream(torch.device("cpu"))().__enter__() is None


def test_units_timed_for_a_plan_wait_for_the_devices_work(monkeypatch):
    """`plan=True` timed each unit by its kernel launches on a GPU (the host does not wait
    for the device): units are now timed with the device synchronized at their boundaries
    and around their waits."""
    import time

    import plait.pipelining.overlap as ov
    from plait.runtime import strands

    queued = {"s": 0.0}  # device work launched and not yet done

    def sync() -> None:
        time.sleep(queued["s"])
        queued["s"] = 0.0

    with strands.units("F", sync=sync) as u, u.unit("ag_mm#0", "tp"):
        queued["s"] = 0.05  # a 50 ms kernel, launched
        with strands.idle():
            queued["s"] += 0.02  # its communication, waited on the device
    unit = u.ran[0]
    assert unit.compute_s >= 0.05 and unit.wait_s >= 0.02

    asked: list[object] = []
    monkeypatch.setattr(ov, "device_sync", lambda d: asked.append(d) or sync)
    monkeypatch.setattr(ov, "_plan", lambda f, b, stages: "plan")

    class Act:
        device, key, fs, bs = torch.device("cuda", 1), (0, 3), 0, 3
        f_stage = b_stage = None

        def forward(self) -> None:
            assert strands._here().units.sync is sync

        backward = forward

        def record(self, *a, **k):
            return None

    overlap = ov.Overlap()
    ov._time_units(overlap, Act(), None)  # type: ignore[arg-type]
    assert asked == [torch.device("cuda", 1)] and overlap.plans[(0, 3)] == "plan"
