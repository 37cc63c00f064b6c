"""`plait doctor`: what in this environment decides whether compute and communication can
overlap, as a short checklist.

Each check says what it found, whether that lets overlap happen (`ok`), may stop or slow it
(`warn`), stops it (`fail`), or could not be checked here and why (`not checked`: on a machine
without a GPU, every device check). The environment is read, never changed.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "not checked"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    found: str
    means: str  # what the finding does to overlap, and the fix where there is one

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# Environment variables that change whether streams overlap, each: (value that hurts, status,
# what it means).
ENVIRONMENT: dict[str, tuple[str, Status, str]] = {
    "CUDA_LAUNCH_BLOCKING": ("1", "fail", "every kernel launch waits for the previous one: "
                             "nothing overlaps. Fix: unset it (debugging only)"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "warn", "one hardware queue for all streams: a "
                                    "communication kernel queued behind a GEMM waits for it "
                                    "(Megatron-LM sets it for its own ordering, "
                                    "NVIDIA/Megatron-LM#1468). Fix: unset it, or leave it to a "
                                    "stack that relies on it"),
    "TORCH_NCCL_ENABLE_TIMING": ("1", "warn", "NCCL kernels are timed with CUDA events, which "
                                 "adds synchronization around them (pytorch/pytorch#143890). "
                                 "Fix: unset it outside profiling"),
    "NCCL_P2P_DISABLE": ("1", "warn", "NCCL's collectives (the /sm engine) stop using "
                         "NVLink/PCIe peer transfers and go through host memory. plait's "
                         "copy-engine (/dma) transfers use symmetric memory (driver peer "
                         "mappings), which this variable does not change. Fix: unset it "
                         "unless the machine needs it"),
    "NCCL_NVLS_ENABLE": ("0", "warn", "NVLink SHARP (switch reduction) off: all-reduces take "
                         "the ring, slower on NVSwitch machines"),
}


def environment_checks(env: Mapping[str, str]) -> list[Check]:
    """A row for each variable set to a value that stops or slows overlap; one row saying so
    when none is."""
    out = [Check(name, status, f"={env[name]}", means)
           for name, (bad, status, means) in ENVIRONMENT.items()
           if env.get(name, "").strip() == bad]
    if not out:
        out.append(Check("environment", "ok", "nothing that serializes streams",
                         f"checked: {', '.join(ENVIRONMENT)}"))
    policy = env.get("NCCL_CTA_POLICY", "").strip()
    if policy:
        zero = policy.upper() in ("2", "ZERO")
        out.append(Check("NCCL_CTA_POLICY", "ok", f"={policy}", (
            "NCCL's copy-engine (zero-CTA) collectives asked for: NCCL >= 2.28 takes them for "
            "all-gathers and all-to-alls on buffers registered as symmetric windows, and runs "
            "SM kernels otherwise; `plait analyze --expect-copy-engines` names the calls that "
            "did") if zero else "NCCL's CTA policy set: collectives run with fewer SMs"))
    return out


def _driver() -> str | None:
    proc = Path("/proc/driver/nvidia/version")
    try:
        return proc.read_text().splitlines()[0].strip() if proc.exists() else None
    except OSError:
        return None


def device_checks(torch: Any) -> list[Check]:
    """What the installed torch and the visible GPUs allow."""
    import torch.distributed as dist

    version = torch.__version__
    built = (f"CUDA {torch.version.cuda}" if torch.version.cuda
             else f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None)
             else "CPU only")
    from plait.errors import UnsupportedTorch

    try:
        import plait.runtime  # noqa: F401 (it refuses a torch plait does not run on)
    except UnsupportedTorch as exc:
        return [Check("torch", "fail", f"{version} ({built})", f"{exc.problem}. Fix: {exc.fix}")]
    out = [Check("torch", "ok" if built != "CPU only" else "warn", f"{version} ({built})",
                 "GPU engines available" if built != "CPU only" else
                 "a CPU build: gloo and plait's shared-memory copier only")]
    out.append(Check("gloo", "ok" if dist.is_gloo_available() else "fail",
                     "available" if dist.is_gloo_available() else "missing",
                     "CPU ranks" if dist.is_gloo_available() else
                     "CPU ranks (tests, plait bench) need it"))
    return out + _gpu_checks(torch)


def _gpu_checks(torch: Any) -> list[Check]:
    """The GPUs, NCCL, the driver, symmetric memory, peer access and multicast."""
    import torch.distributed as dist

    out = []
    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 0
    no_gpu = "no CUDA device here"
    if not cuda:
        out.append(Check("GPUs", "not checked", "none visible",
                         "the checks below need one: run it on a GPU node"))
    else:
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        cap = torch.cuda.get_device_capability(0)
        out.append(Check("GPUs", "ok", f"{n} x {', '.join(names)} (sm_{cap[0]}{cap[1]})",
                         "plait's presets: plait presets"))
    nccl = dist.is_nccl_available()
    if not nccl:
        out.append(Check("NCCL", "not checked" if not cuda else "fail", "not in this build",
                         "the /sm engine on GPUs"))
    else:
        ver = torch.cuda.nccl.version()
        text = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
        out.append(Check("NCCL", "ok", text, "the /sm engine's collectives"))
    driver = _driver()
    out.append(Check("driver", "ok" if driver else "not checked", driver or no_gpu,
                     "copy engines and symmetric memory rely on it"))
    return out + _copy_engine_checks(torch, cuda, n)


def _copy_engine_checks(torch: Any, cuda: bool, n: int) -> list[Check]:
    """What plait's copy-engine path and switch multicast need."""
    out = []
    no_gpu = "no CUDA device here"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401 (present or not)

        symm = True
    except ImportError:
        symm = False
    if not symm:
        out.append(Check("symmetric memory", "fail" if cuda else "not checked",
                         "torch.distributed._symmetric_memory missing",
                         "plait's copy-engine (/dma) path and PyTorch's async TP need it: "
                         "torch >= 2.5"))
    else:
        out.append(Check("symmetric memory", "ok" if cuda else "not checked",
                         "in this torch" + ("" if cuda else f"; {no_gpu}"),
                         "plait's /dma path on GPUs, PyTorch's fused ops"))
    if n >= 2:
        blocked = [(i, j) for i in range(n) for j in range(n)
                   if i != j and not torch.cuda.can_device_access_peer(i, j)]
        out.append(Check("peer access", "fail" if blocked else "ok",
                         f"blocked between {blocked[:4]}" if blocked else f"all {n} GPUs",
                         "copy engines move data GPU to GPU only with peer access; "
                         "without it /dma transfers go through the host" if blocked else
                         "copy engines can move data between every pair of GPUs"))
    else:
        out.append(Check("peer access", "not checked", f"{n} GPU(s): needs two",
                         "copy engines moving data GPU to GPU"))
    if cuda:
        cap = torch.cuda.get_device_capability(0)
        multicast = multicast_support(torch, 0) if n >= 2 else False
        found = (f"sm_{cap[0]}{cap[1]}, {n} GPUs: " + (
            "not asked (this torch cannot ask)" if multicast is None else
            "the driver offers it" if multicast else "the driver does not offer it")
            if n >= 2 else f"{n} GPU: needs two")
        out.append(Check("multicast (NVLS)", "ok" if multicast else "warn", found,
                         "switch multicast (NVSwitch) speeds all-reduces and multimem "
                         "all-gathers" if multicast else
                         "no switch multicast (no NVSwitch, as on H100 PCIe, or one GPU): "
                         "all-reduces take the ring"))
    else:
        out.append(Check("multicast (NVLS)", "not checked", no_gpu,
                         "switch multicast for all-reduce, multimem all-gather"))
    return out


def multicast_support(torch: Any, device: int) -> bool | None:
    """Whether the driver offers switch multicast on `device` (what PyTorch's symmetric
    memory asks before its multimem paths); None where this torch cannot ask."""
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError:
        return None
    try:
        return bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, device))
    except (AttributeError, RuntimeError):
        return None


def tuning_cache_check() -> Check:
    """Where `schedule="auto"` keeps its decisions, and how many hold on this machine."""
    from plait.tuning.cache import ENV, TuningCache, default_path
    from plait.tuning.tuner import fingerprint

    path = default_path()
    if path is None:
        return Check("tuning cache", "ok", "off", f"${ENV}=off: schedule=\"auto\" keeps its "
                     "decisions for the job only and measures in every job")
    warned: list[str] = []
    decisions = TuningCache(path, fingerprint(), warned.append).load()
    if warned:
        return Check("tuning cache", "warn", str(path), warned[0])
    return Check("tuning cache", "ok", f"{path}: {len(decisions)} decisions for this machine",
                 "schedule=\"auto\" starts tuned for these signatures (fill it with "
                 "`plait tune`)" if decisions else
                 "schedule=\"auto\" measures each signature once, then keeps it here")


def run_checks(env: Mapping[str, str]) -> dict[str, Any]:
    """Every check, with the machine it ran on."""
    import torch

    from plait import __version__

    return {"plait_version": __version__, "python": platform.python_version(),
            "machine": platform.machine(), "environment_checked": list(ENVIRONMENT),
            "checks": [c.to_dict() for c in (*device_checks(torch),
                                             *environment_checks(env),
                                             tuning_cache_check())]}
