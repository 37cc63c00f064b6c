"""`schedule="auto"`: the user's own job measures the simulator's candidates and decides.

The first call of a signature on a group (`Signature`: the pair's GEMM on each rank, the
group's size and backend, the device) asks the group whether every rank already holds the
same decision (from this job or the tuning cache): one small all-gather. If so, it runs and
nothing is measured. Otherwise the simulator proposes candidates (`planner.propose`: the
baseline `seq/sm` and its few best, each from another family), rank 0's list is the group's,
and the next calls of the signature run them round-robin: a warm-up call each, then `calls`
timed calls each, every output being that call's real output. Each rank times its own calls
(`runtime.timing.timed`, the device synchronized); the last call combines them with one
all-reduce (the slowest rank per call) and every rank applies the same rule
(`tuning.decide`) to the same numbers: the fastest wins only if it beats the baseline by
more than the measurements' spread. A timed call starts after a barrier of the group, so a
rank that arrives late (its own work before the call) adds nothing to the call's time.

Under co-execution (a strand of `plait.pipelining` or of `plait coexec run`'s fixture, a
strand's filled waits, units being timed) the other strand's work would be timed too: calls
there use a decision already made, and otherwise run the baseline untimed and say so; tuning
happens where calls run alone. Every branch depends only on what every rank sees alike (call
counts, the exchanged values), so all ranks run the same schedule in every call.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

import plait
from plait.errors import SpecError
from plait.runtime import strands
from plait.runtime.context import Runtime, capturing
from plait.runtime.launch import group_device
from plait.runtime.timing import timed
from plait.schedule.schedule import (
    DEFAULT_CANDIDATES,
    FAMILIES,
    MAX_CHUNKS,
    SEQUENTIAL,
    candidate_schedules,
)
from plait.schedule.verdict import PLAIN
from plait.spec.calibration import load_calibration
from plait.spec.hardware import ClusterSpec, load_hardware, preset_of_device
from plait.tuning.cache import TuningCache, default_path
from plait.tuning.decide import (
    CACHED,
    NOT_TUNED,
    ONE_RANK,
    Candidate,
    Decision,
    decide,
)
from plait.tuning.signature import Signature
from plait.workload.operators import OverlapPair

if TYPE_CHECKING:
    from plait.planner.propose import Proposal

T = TypeVar("T")
_MOST = len(FAMILIES) + 2  # candidates a trial can hold: every family, the baseline, PyTorch's
TORCH_FUSED = "torch"  # PyTorch's own fused op (symmetric memory), a candidate on CUDA


@dataclass(frozen=True)
class Settings:
    """How `schedule="auto"` tunes (`configure`)."""

    candidates: int = DEFAULT_CANDIDATES  # overlapped candidates beside the baseline
    warmup: int = 1  # untimed calls of each candidate first
    calls: int = 3  # timed calls of each candidate
    hardware: str | ClusterSpec | None = None  # what the simulator proposes for: a preset,
    #                                            a cluster file; None: the detected device
    calibration: str | None = None  # a `plait profile` calibration file applied to it
    cache: str | Path | bool = True  # True: $PLAIT_TUNING_CACHE or ~/.cache/plait/...;
    #                                  False: none; else the file
    penalty: Callable[[str], float] | None = None  # seconds added to each timed call of a
    # candidate (its schedule's text), as a slower engine or link would add them: how tests
    # and benchmarks steer a decision, injected here rather than slowing the runtime


@dataclass
class _Trial:
    candidates: list[tuple[str, float | None]]  # schedule text, predicted seconds
    times: list[list[float]]
    warmup: int  # untimed calls of each candidate (rank 0's setting: every rank's)
    timed: int  # timed calls of each candidate
    calls: int = 0  # calls made so far


@dataclass
class Tuner:
    """The decisions of this process, and the trials under way, per (group, signature)."""

    settings: Settings = field(default_factory=Settings)
    decisions: dict[str, Decision] = field(default_factory=dict)  # by signature key
    agreed: dict[tuple[str, str], str] = field(default_factory=dict)  # (group, key) -> run
    log: list[tuple[str, Decision]] = field(default_factory=list)  # (group, decision)
    warnings: list[str] = field(default_factory=list)
    measurement_calls: int = 0  # calls that ran a candidate under trial
    last: Decision | None = None  # what the last call ran under (None: a trial, untuned)
    _asked: set[tuple[str, str]] = field(default_factory=set)
    _trials: dict[tuple[str, str], _Trial] = field(default_factory=dict)
    _untuned: set[tuple[str, str]] = field(default_factory=set)
    _cache: TuningCache | None = None
    _cluster: ClusterSpec | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def run(self, rt: Runtime, group: str, sig: Signature, body: Callable[[str], T]) -> T:
        """One call of `sig` on `group`: `body(schedule text)` under the decided schedule,
        or under the trial's next candidate (timed)."""
        gk = (group, sig.key)
        with self._lock:
            chosen = self.agreed.get(gk)
            self.last = self.decisions.get(sig.key) if chosen is not None else None
        if chosen is not None:
            return body(chosen)
        if rt.world == 1:
            self._settle(gk, Decision(sig.key, PLAIN, "one rank: nothing to overlap",
                                      ONE_RANK), save=False)
            return body(PLAIN)
        if capturing():
            raise SpecError("schedule (CUDA graph)", f"auto has not decided {sig.key} yet: "
                            "it measures calls and exchanges the timings between ranks, "
                            "which a CUDA graph cannot capture",
                            "warm up: run the step until plait.tuning.report() shows the "
                            "decision, then capture")
        if gk not in self._asked:
            known = self._agreed_decision(rt, sig)
            self._asked.add(gk)
            if known is not None:
                self._settle(gk, known, save=False)
                return body(known.choice)
        if strands.beside_other_work():
            if gk not in self._untuned:
                self._untuned.add(gk)
                self._record(group, Decision(
                    sig.key, PLAIN, "not tuned: first called beside other work (a strand "
                    "of co-execution or timed units); the baseline ran untimed until the "
                    "signature is called alone", NOT_TUNED))
            return body(PLAIN)
        trial = self._trials.get(gk) or self._start(rt, sig, gk)
        n, i = len(trial.candidates), trial.calls
        schedule = trial.candidates[i % n][0]
        trial.calls += 1
        self.measurement_calls += 1
        if i < n * trial.warmup:
            return body(schedule)
        with strands.filling(None, own=True):  # the call alone (its caller's work after it)
            rt.barrier()  # the group starts the timed call together: no late rank counted
            out, seconds = timed(lambda: body(schedule), rt.device)
        if self.settings.penalty is not None:
            seconds += self.settings.penalty(schedule)
        trial.times[i % n].append(seconds)
        if trial.calls == n * (trial.warmup + trial.timed):
            self._conclude(rt, sig, gk, trial)
        return out

    # --- agreeing ----------------------------------------------------------------------------

    def _agreed_decision(self, rt: Runtime, sig: Signature) -> Decision | None:
        """This signature's decision if every rank of the group holds the same one."""
        self._load()
        known = self.decisions.get(sig.key)
        code = _code(known.choice) if known is not None else -1
        everyone = rt.exchange([int(known is not None), code])
        if all(have for have, _ in everyone) and len({c for _, c in everyone}) == 1:
            return known
        if known is not None:
            self._warn(f"ranks hold different decisions for {sig.key} (this one: "
                       f"{known.choice}, from {known.source}): the group tunes it afresh")
        return None

    def _start(self, rt: Runtime, sig: Signature, gk: tuple[str, str]) -> _Trial:
        """The candidates every rank measures: rank 0's proposal (one all-gather)."""
        mine: list[tuple[str, float | None]] = [(str(p.schedule), p.predicted_s)
                for p in _propose()(sig.pair(), self.cluster(), self.settings.candidates)]
        if _torch_fused_available(rt, sig):
            mine.append((TORCH_FUSED, torch_fused_prediction(sig.pair(), self.cluster())))
        pad = [-1] * (_MOST - len(mine))
        first = rt.exchange([self.settings.warmup, self.settings.calls, len(mine),
                             *(_code(s) for s, _ in mine), *pad,
                             *(-1 if p is None else round(p * 1e12) for _, p in mine), *pad])[0]
        warmup, calls, count = first[:3]
        names = _decode(sig, first[3:3 + count])
        predicted = [None if ps < 0 else ps * 1e-12
                     for ps in first[3 + _MOST:3 + _MOST + count]]
        if names != [s for s, _ in mine] or (warmup, calls) != (self.settings.warmup,
                                                                self.settings.calls):
            self._warn(f"rank {rt.rank} would measure {', '.join(s for s, _ in mine)} "
                       f"({self.settings.warmup} + {self.settings.calls} calls each) for "
                       f"{sig.key} but rank 0 proposed {', '.join(names)} ({warmup} + "
                       f"{calls}; other settings, hardware or calibration?): rank 0's "
                       "candidates are measured")
        trial = _Trial(list(zip(names, predicted, strict=True)), [[] for _ in names], warmup,
                       calls)
        with self._lock:
            self._trials[gk] = trial
        return trial

    def _conclude(self, rt: Runtime, sig: Signature, gk: tuple[str, str], trial: _Trial
                  ) -> None:
        flat = rt.slowest([t for times in trial.times for t in times])
        calls = trial.timed
        cands = [Candidate(name, pred, tuple(flat[j * calls:(j + 1) * calls]))
                 for j, (name, pred) in enumerate(trial.candidates)]
        with self._lock:
            del self._trials[gk]
        self._settle(gk, decide(sig.key, cands), save=True)

    def _settle(self, gk: tuple[str, str], decision: Decision, save: bool) -> None:
        with self._lock:
            self.agreed[gk] = decision.choice
            self.decisions[decision.key] = decision
            self.last = decision
        self._record(gk[0], decision)
        if save:
            self._load()
            assert self._cache is not None
            self._cache.save({decision.key: decision})

    def _record(self, group: str, decision: Decision) -> None:
        with self._lock:
            self.log.append((group, decision))

    # --- settings, cache, hardware -----------------------------------------------------------

    def _load(self) -> None:
        if self._cache is not None:
            return
        c = self.settings.cache
        path = default_path() if c is True else None if c is False else Path(c)
        self._cache = TuningCache(path, fingerprint(), self._warn)
        loaded = self._cache.load()
        with self._lock:
            for key, d in loaded.items():
                self.decisions.setdefault(key, replace(d, source=CACHED))

    def cluster(self) -> ClusterSpec:
        """What the simulator proposes for: the settings' hardware, else the device's."""
        if self._cluster is None:
            hw = self.settings.hardware
            cluster = hw if isinstance(hw, ClusterSpec) else load_hardware(
                hw or detect_hardware(self._warn))
            if self.settings.calibration:
                cluster = load_calibration(self.settings.calibration).apply(cluster)
            self._cluster = cluster
        return self._cluster

    def _warn(self, message: str) -> None:
        with self._lock:
            if message in self.warnings:
                return
            self.warnings.append(message)
        print(f"plait: warning: {message}", file=sys.stderr, flush=True)


def _propose() -> Callable[[OverlapPair, ClusterSpec, int], tuple[Proposal, ...]]:
    """The simulator's proposer, imported on the first "auto" call: a job that runs fixed
    schedules never loads the simulator."""
    from plait.planner.propose import propose

    return propose


def torch_fused_prediction(pair: OverlapPair, cluster: ClusterSpec) -> float | None:
    """The simulator's time of PyTorch's fused op on `pair`: its decomposition, issued by its
    own executor (`planner.explore.tool_run`); None where it has no point (an all-to-all)."""
    from plait.planner.explore import tool_run  # the simulator, on the first "auto" call

    run = tool_run("pytorch", pair, cluster)
    return None if run is None else run.time_s


def _code(schedule: str) -> int:
    """A schedule's text as a number every rank computes alike (an all-gather's payload)."""
    return zlib.crc32(schedule.encode())


def _decode(sig: Signature, codes: list[int]) -> list[str]:
    names = [TORCH_FUSED, str(SEQUENTIAL),
             *(str(s) for s in candidate_schedules(sig.axis, max_chunks=MAX_CHUNKS))]
    by_code = {_code(n): n for n in names}
    return [by_code[c] for c in codes]


def _uses_gpu() -> bool:
    """Whether this process computes on a GPU: it has initialized CUDA (a job's tensors are on
    the device by the time it tunes). A CPU job on a GPU machine never touches CUDA here: it
    may be inside a checkpoint's forward, where initializing a device is an error."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def fingerprint() -> dict[str, str]:
    """What decisions depend on beyond their signature: the machine and the versions."""
    if _uses_gpu():
        device, count = torch.cuda.get_device_name(), torch.cuda.device_count()
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    else:
        device, count, nccl = f"cpu {platform.machine()}", os.cpu_count() or 1, "none"
    return {"device": device, "devices": str(count), "torch": torch.__version__,
            "nccl": nccl, "plait": plait.__version__}


def detect_hardware(warn: Callable[[str], None]) -> str:
    """The hardware preset of this rank's device (`cpu` without a GPU)."""
    if not _uses_gpu() or (dist.is_initialized() and group_device().type != "cuda"):
        return "cpu"
    name = torch.cuda.get_device_name()
    preset = preset_of_device(name)
    if preset is not None:
        return preset
    warn(f"no hardware preset for {name}: candidates are proposed as for h100 (pass "
         "hardware= or a calibration to plait.tuning.configure)")
    return "h100"


def _torch_fused_available(rt: Runtime, sig: Signature) -> bool:
    """PyTorch's fused op is a candidate where it can run: CUDA, an all-gather of rows or a
    reduce-scatter, and symmetric memory for the group (`symm_mem_ready`)."""
    if rt.device.type != "cuda" or sig.kind.value not in ("ag", "rs") or sig.axis.value != "M":
        return False
    return symm_mem_ready(rt.group.group_name)


def symm_mem_ready(group_name: str) -> bool:
    """Whether PyTorch's symmetric-memory ops run on the group as it is: always where this
    torch deprecated `enable_symm_mem_for_group` (it then sets every group up on first use;
    2.11 and later do), else only once that was called for the group."""
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError:
        return False
    enable = getattr(symm, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return True
    try:
        return bool(symm.is_symm_mem_enabled_for_group(group_name))  # type: ignore[arg-type]
    except (AttributeError, RuntimeError):
        return False


_TUNER = Tuner()


def tuner() -> Tuner:
    """This process's tuner."""
    return _TUNER


def configure(**changes: Any) -> Settings:
    """Change how `schedule="auto"` tunes (fields of `Settings`); decisions made so far are
    dropped (they were made under the old settings) and the cache is read again."""
    global _TUNER
    try:
        settings = replace(_TUNER.settings, **changes)
    except TypeError as exc:
        raise SpecError("configure", str(exc), f"use fields of Settings: "
                        f"{', '.join(Settings.__dataclass_fields__)}") from None
    for name, low in (("candidates", 0), ("warmup", 0), ("calls", 1)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpecError(name, f"{value!r}", f"use an integer >= {low}")
    _TUNER = Tuner(settings)
    if settings.hardware is not None or settings.calibration is not None:
        _TUNER.cluster()  # a bad preset or file fails here, in one line, not mid-job
    return settings
