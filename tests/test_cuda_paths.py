"""plait's CUDA paths, checked on a CPU: each defect found at first contact with a GPU (or by a
reading of the CUDA paths against torch's sources) has a test here that fails without its fix,
the CUDA calls replaced by stand-ins that record what they were asked."""

from __future__ import annotations

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
