"""Reading a torch.profiler (Kineto) Chrome trace into what the exposure analysis needs.

A trace is one rank's `prof.export_chrome_trace(...)` (JSON, optionally gzipped). From it:
- **communication**: on GPUs, the kernels a rule of `analyze.rules` names (NCCL/RCCL, symmetric
  memory, userbuffers, expert-parallel dispatch/combine, the user's `--comm-kernel` patterns)
  and peer-to-peer memcopies; a kernel's kind and sizes come from Kineto's NCCL annotation
  (`Collective name`, message sizes, group size, dtype), else from the `c10d::*` call that
  launched it (an all-to-all run as NCCL send/recv is an all-to-all), else from its name. On
  CPUs, gloo's work on its own threads (`gloo:*`), matched in order to the `c10d::*` calls that
  issued it, and the copies of plait's CPU copy engine (`plait:copy *`, on its copier thread);
- **compute**: every other GPU kernel (GPU traces), or every `aten::*` operator that is not part
  of a transfer (CPU traces);
- **memory**: local memory copies and memsets (GPU traces): busy, but neither compute nor
  communication;
- **GEMMs**: compute whose operator is a matmul, with its (M, N, K) from the recorded input shapes
  (`record_shapes=True`), so a collective can be paired with the GEMM beside it;
- **steps**: `ProfilerStep#N` annotations. A GPU kernel belongs to the step its launch (the
  runtime call with its correlation id) ran in; without one, the step its start lies in.
- **plait's own work**: the runtime's cross-rank shape check (`plait:check *`) is labelled
  `plait: shape check`, never offered as a user's collective to schedule.

A trace with GPU kernels is analyzed on its GPUs (the CPU side only launches them).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plait import tracing
from plait.analyze import rules
from plait.analyze.rules import CommRule
from plait.errors import SpecError
from plait.spec.dtypes import from_kineto, kineto_bytes
from plait.workload.operators import CollectiveKind

_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
          "aten::matmul", "aten::linear"}
_RUNTIME = ("cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver")
# event categories of accelerators plait does not read (their traces are not CPU traces)
_OTHER_DEVICES = re.compile(r"mtia|xpu|hpu|npu|privateuse1|mps|tpu", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Comm:
    """One transfer as it ran: [start, end) in microseconds on `track`."""

    start: float
    end: float
    track: str
    name: str
    kind: CollectiveKind | None  # None: a collective plait has no model of (broadcast, ...)
    group: int  # ranks in its process group (0: unknown)
    elems: int  # elements of the full tensor plait's cost model counts (0: unknown)
    nbytes: float  # their bytes (0: unknown)
    dtype: str | None  # plait's name (bf16, fp32, ...) or None when unknown
    label: str = ""  # what it is, readably: plait's kind, "broadcast", "plait: shape check", ...
    rule: str = rules.ANNOTATED  # the rule that made it communication
    step: int | None = None  # the ProfilerStep it belongs to (None: outside every step)
    launched: float | None = None  # when the CPU launched it (GPU traces)
    # Of its duration, the time spent waiting for the last rank to arrive: this rank's time in
    # the call minus the shortest any rank spent in it (None: other ranks' traces not given).
    wait: float | None = None
    named_only: bool = False  # its kind comes from its kernel name alone (no metadata, no call)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def key(self) -> tuple[str, int, int]:
        """What identifies the same call on every rank, with its order among such calls (an
        all-to-all's size is left out: with uneven splits it differs from rank to rank)."""
        return (self.label, self.group, 0 if self.kind is CollectiveKind.A2A else self.elems)

    @property
    def plaits_own(self) -> bool:
        return self.rule == rules.PLAIT_CHECK


@dataclass(frozen=True, slots=True)
class Kernel:
    """One compute (or memory) interval; `gemm` is (m, n, k, count) for a matmul of known
    shape."""

    start: float
    end: float
    track: str
    name: str
    gemm: tuple[int, int, int, int] | None = None
    dtype: str | None = None
    # operands that are transposed views (A (m, k) stored as (k, m); B (k, n) as (n, k)):
    # which dimension of the stored tensor its rows are, so which one a gather filled
    transposed: tuple[bool, bool] = (False, False)
    step: int | None = None
    launched: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class DeviceTrace:
    """Everything one device (a GPU, or a CPU process) did in the trace, in start order."""

    device: str
    pid: object  # the trace's process id of the device's events (to add tracks beside them)
    comms: tuple[Comm, ...]
    compute: tuple[Kernel, ...]
    steps: tuple[int, ...]  # the ProfilerStep numbers its events belong to (empty: none)
    # record_function ranges on this device's timeline: (name, start, end); on GPUs the ranges
    # Kineto projects onto the kernels they launched (gpu_user_annotation)
    regions: tuple[tuple[str, float, float], ...] = ()
    memory: tuple[Kernel, ...] = ()  # local memcopies and memsets


@dataclass(frozen=True, slots=True)
class Step:
    number: int
    start: float  # of its ProfilerStep range on the CPU
    end: float


@dataclass(frozen=True, slots=True)
class RankTrace:
    path: str
    rank: int | None
    world: int | None
    gpu_name: str | None  # as the trace's deviceProperties give it
    devices: tuple[DeviceTrace, ...]
    backend: str | None = None
    steps: tuple[Step, ...] = ()
    digest: str = ""  # of the file's content: the same trace passed twice is told apart
    span: tuple[float, float] = (0.0, 0.0)  # first and last event, microseconds
    written_by_plait: bool = False  # plait analyze --trace wrote it (the user's trace, marked)
    unreadable: int = 0  # complete events skipped: times missing, not numbers, or not finite
    odd_shapes: int = 0  # operators whose recorded shapes are not lists of sizes (strings)

    @property
    def step_numbers(self) -> tuple[int, ...]:
        return tuple(s.number for s in self.steps)


class PlaitOutput(SpecError):
    """The file is something plait analyze wrote (a JSON result, an annotated trace)."""


def load_trace(path: str | Path) -> tuple[Any, list[Any]]:
    """The JSON document of a Chrome trace (.json or .json.gz) and its event list (the same
    list object inside it)."""
    doc, events, _ = _load(Path(path))
    return doc, events


def _load(p: Path) -> tuple[Any, list[Any], str]:
    if not p.is_file():
        raise SpecError("trace", f"file {str(p)!r} does not exist",
                        "pass the JSON that torch.profiler's export_chrome_trace wrote")
    try:
        raw = _read_bounded(p)
    except EOFError as exc:  # the compressed stream stops before its end
        raise SpecError("trace", f"{p} is truncated: the compressed file ends before its "
                        "end-of-stream marker (a copy or an export that did not finish)",
                        f"copy or export it again, or analyze the other traces without it "
                        f"(move {p.name} out of the folder)") from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise SpecError("trace", f"{p} is not a (gzipped) JSON trace: "
                        f"{type(exc).__name__}: {str(exc)[:200]}",
                        "pass the JSON that torch.profiler's export_chrome_trace wrote") from exc
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise SpecError("trace", f"{p} is not a (gzipped) JSON trace: "
                        f"{type(exc).__name__}: {str(exc)[:200]}",
                        "pass the JSON that torch.profiler's export_chrome_trace wrote") from exc
    if isinstance(doc, dict) and "plait_version" in doc:
        raise PlaitOutput("trace", f"{p} is plait analyze's own JSON result, not a trace",
                          "pass the traces torch.profiler wrote")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise SpecError("trace", f"{p} has no traceEvents list",
                        "pass a Chrome trace: a JSON object with a traceEvents array")
    return doc, events, hashlib.sha1(raw).hexdigest()


MAX_TRACE_BYTES = 1 << 30  # uncompressed: larger traces are refused, not read into memory


def _read_bounded(p: Path) -> bytes:
    """The file's bytes (decompressed for .gz), refusing more than `MAX_TRACE_BYTES`."""
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as f:
        raw = f.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise SpecError("trace", f"{p} holds over {MAX_TRACE_BYTES >> 20} MiB of JSON "
                        "(uncompressed)", "profile fewer steps, or fewer ranks per file")
    return raw


def written_by_plait(doc: Any) -> bool:
    """Whether a trace document is one plait analyze wrote (`--trace`)."""
    return isinstance(doc, dict) and isinstance(doc.get("plait"), dict)


def _number(v: object) -> int:
    """An integer field of a trace event (a group size, a message size); 0 when it is not a
    finite number."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        return 0
    try:
        x = float(v)
    except ValueError:
        return 0
    return int(x) if math.isfinite(x) and x >= 0 else 0


# Kineto's clock: microseconds since the epoch (about 1.8e15 in 2026) or since the trace began.
# A time beyond 1e18 us (31,700 years) is no clock's: sums over such spans overflow to inf.
MAX_TRACE_US = 1e18


def _usable(e: object) -> bool:
    """A complete event ("X") with times a clock can give: finite, the duration
    non-negative, both within `MAX_TRACE_US`."""
    if not (isinstance(e, dict) and e.get("ph") == "X"):
        return False
    ts, dur = e.get("ts"), e.get("dur")
    return (isinstance(ts, int | float) and isinstance(dur, int | float)
            and not isinstance(ts, bool) and abs(ts) <= MAX_TRACE_US
            and 0 <= dur <= MAX_TRACE_US)


def _clean(e: dict[str, Any]) -> dict[str, Any]:
    """An event with fields of the types the reader relies on: args a mapping (else none),
    name and category text, process and thread ids scalars."""
    if (isinstance(e.get("args", {}), dict) and isinstance(e.get("name", ""), str)
            and isinstance(e.get("cat", ""), str) and all(
                type(e.get(k, 0)) in (int, str) for k in ("pid", "tid"))):
        return e  # the common case: nothing to change
    out = dict(e)
    if not isinstance(out.get("args", {}), dict):
        out["args"] = {}
    for key in ("name", "cat"):
        if key in out and not isinstance(out[key], str):
            out[key] = str(out[key])
    for key in ("pid", "tid"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int | str)):
            out[key] = str(out[key])
    return out


def read_trace(path: str | Path, extra: Sequence[CommRule] = ()) -> RankTrace:
    """Read one rank's torch.profiler Chrome trace (.json or .json.gz); `extra`: rules that
    make more kernels communication (tried before the built-in ones)."""
    p = Path(path)
    doc, events, digest = _load(p)
    info = doc.get("distributedInfo", {}) if isinstance(doc, dict) else {}
    info = info if isinstance(info, dict) else {}
    spans = [_clean(e) for e in events if _usable(e)]
    unreadable = sum(isinstance(e, dict) and e.get("ph") == "X" for e in events) - len(spans)
    steps = _steps(spans)
    spans = _mark_plait_pieces(spans)
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        _refuse_other_accelerators(p, spans)
    world = _number(info.get("world_size")) or None
    ctx = _Context(spans, steps)
    devices = (_gpu_devices(gpu, spans, ctx, (*extra, *rules.BUILT_IN)) if gpu
               else _cpu_devices(spans, ctx, world))
    props = doc.get("deviceProperties") if isinstance(doc, dict) else None
    gpu_name = props[0].get("name") if isinstance(props, list) and props and isinstance(
        props[0], dict) else None
    rank = info.get("rank")
    backend = info.get("backend")
    every = [_interval(e) for e in spans]
    return RankTrace(str(p), rank if isinstance(rank, int) else None, world,
                     str(gpu_name) if gpu_name is not None else None, tuple(devices),
                     str(backend) if backend is not None else None, steps, digest,
                     (min(s for s, _ in every), max(e for _, e in every)) if every else (0, 0),
                     written_by_plait(doc), unreadable,
                     sum(e.get("cat") == "cpu_op" and _odd_dims(e["args"].get("Input Dims"))
                         for e in spans))


def _refuse_other_accelerators(p: Path, spans: list[dict[str, Any]]) -> None:
    cats = sorted({str(e.get("cat")) for e in spans
                   if _OTHER_DEVICES.search(str(e.get("cat", "")))})
    if cats:
        raise SpecError("trace", f"{p} is a trace of an accelerator plait does not read "
                        f"(event categories {', '.join(cats[:4])})",
                        "plait analyze reads CUDA/ROCm traces (kernel and gpu_memcpy events) "
                        "and CPU traces (gloo)")


def _steps(spans: list[dict[str, Any]]) -> tuple[Step, ...]:
    """The trace's ProfilerStep ranges on the CPU, in order (the first range of each number)."""
    found: dict[int, Step] = {}
    for e in spans:
        name = str(e.get("name", ""))
        if name.startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation":
            n = _number(name[len("ProfilerStep#"):])
            if name[len("ProfilerStep#"):].isdigit() and n not in found:
                found[n] = Step(n, *_interval(e))
    return tuple(sorted(found.values(), key=lambda s: s.start))


class _Context:
    """Lookups every device reader needs: a time's step, a GPU event's launch (by correlation
    id), the communication call or plait check range around a CPU time on a thread."""

    def __init__(self, spans: list[dict[str, Any]], steps: tuple[Step, ...]) -> None:
        self._starts = [s.start for s in steps]
        self._steps = steps
        self.launches = {e["args"]["correlation"]: e for e in spans
                         if e.get("cat") in _RUNTIME
                         and isinstance(e["args"].get("correlation"), int | str)}
        self.calls = _Enclosing(e for e in spans if e.get("cat") == "cpu_op" and _is_call(
            str(e.get("name", ""))))
        self.checks = _Enclosing(e for e in spans if e.get("cat") == "user_annotation"
                                 and tracing.is_check(str(e.get("name", ""))))

    def call_of(self, launch: dict[str, Any] | None) -> dict[str, Any] | None:
        """The communication call around a GPU event's launch: Kineto's record of the call's
        parameters when it has one, else the c10d call; None without a launch or a call."""
        if launch is None:
            return None
        around = self.calls.around(launch.get("pid"), launch.get("tid"), float(launch["ts"]))
        return next((c for c in around if "Collective name" in c.get("args", {})),
                    next((c for c in around if c.get("name") != "record_param_comms"), None))

    def step_at(self, t: float) -> int | None:
        i = bisect_right(self._starts, t) - 1
        return self._steps[i].number if i >= 0 and t < self._steps[i].end else None


def _is_call(name: str) -> bool:
    """A CPU operator that issues a collective: c10d's, or Kineto's record of its parameters."""
    return name.startswith(("c10d::", "nccl:")) or name == "record_param_comms"


class _Enclosing:
    """The innermost of some CPU ranges that holds a given time on a given thread."""

    def __init__(self, events: Any) -> None:
        self._by: dict[tuple[object, object], tuple[list[float], list[dict[str, Any]]]] = {}
        lists: dict[tuple[object, object], list[dict[str, Any]]] = {}
        for e in events:
            lists.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        for key, es in lists.items():
            es.sort(key=_ts)
            self._by[key] = ([float(e["ts"]) for e in es], es)

    def around(self, pid: object, tid: object, t: float) -> list[dict[str, Any]]:
        """The ranges holding `t`, innermost first (nested ranges: the innermost starts last;
        a few levels are looked at)."""
        starts, es = self._by.get((pid, tid), ([], []))
        i = bisect_right(starts, t) - 1
        return [es[j] for j in range(i, max(-1, i - 8), -1) if _interval(es[j])[1] >= t]

    def at(self, pid: object, tid: object, t: float) -> dict[str, Any] | None:
        found = self.around(pid, tid, t)
        return found[0] if found else None


def _mark_plait_pieces(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`spans`, the operators run inside a GEMM piece of one of plait's schedules
    (`plait:<call>:gemm.<piece>`) marked `"plait": True`: their GEMMs are not offered as pairs
    again. A whole GEMM (`plait:<call>:gemm`, a sequential schedule) is."""
    pieces: dict[object, list[tuple[float, float]]] = {}
    for e in spans:
        name = str(e.get("name", ""))
        if tracing.is_gemm_piece(name):
            pieces.setdefault((e.get("pid"), e.get("tid")), []).append(
                _interval(e))
    if not pieces:
        return spans
    for ranges in pieces.values():
        ranges.sort()
    return [e | {"plait": True} if e.get("cat") == "cpu_op" and _inside(
        float(e["ts"]), pieces.get((e.get("pid"), e.get("tid")), [])) else e for e in spans]


def _gpu_devices(gpu: list[dict[str, Any]], spans: list[dict[str, Any]], ctx: _Context,
                 comm_rules: tuple[CommRule, ...]) -> list[DeviceTrace]:
    ops = {e["args"]["External id"]: e for e in spans
           if e.get("cat") == "cpu_op" and isinstance(e["args"].get("External id"), int | str)}
    by_device: dict[object, tuple[list[Comm], list[Kernel], list[Kernel]]] = {}
    for e in gpu:
        args = e.get("args", {})
        comms, compute, memory = by_device.setdefault(e.get("pid"), ([], [], []))
        start, end = _interval(e)
        track = f"stream {args.get('stream', e.get('tid'))}"
        name = str(e.get("name", ""))
        corr = args.get("correlation")
        launch = ctx.launches.get(corr) if isinstance(corr, int | str) else None
        launched = float(launch["ts"]) if launch is not None else None
        step = ctx.step_at(launched if launched is not None else start)
        if e["cat"] != "kernel":
            if "ptop" in name.lower():  # a peer copy (copy engine or NVLink), not a local one
                comms.append(_peer_copy(e, launch, ctx, step))
            else:
                memory.append(Kernel(start, end, track, name, step=step, launched=launched))
            continue
        coll = args.get("Collective name")
        rule = rules.ANNOTATED if coll is not None else rules.matching_rule(name, comm_rules)
        if rule is not None:
            comms.append(_gpu_comm(e, rule, str(coll) if coll is not None else None, launch,
                                   ctx, step))
            continue
        ext = args.get("External id")
        op = ops.get(ext) if isinstance(ext, int | str) else None
        compute.append(_compute(start, end, track, name, op, step, launched))
    return [DeviceTrace(f"gpu {pid}", pid, tuple(sorted(_like_siblings(c), key=_start)),
                        tuple(sorted(g, key=_start)), _step_numbers(c, g),
                        _regions(spans, pid, "gpu_user_annotation"),
                        tuple(sorted(m, key=_start)))
            for pid, (c, g, m) in sorted(by_device.items(), key=lambda x: str(x[0]))]


def _gpu_comm(e: dict[str, Any], rule: str, coll: str | None, launch: dict[str, Any] | None,
              ctx: _Context, step: int | None) -> Comm:
    """A communication kernel. Its kind and sizes: Kineto's NCCL annotation; else the c10d call
    that launched it (found around its launch on the launching thread); else its name."""
    args = e.get("args", {})
    name = str(e.get("name", ""))
    start, end = _interval(e)
    track = f"stream {args.get('stream', e.get('tid'))}"
    launched = float(launch["ts"]) if launch is not None else None
    call = ctx.call_of(launch)
    if launch is not None and ctx.checks.at(launch.get("pid"), launch.get("tid"),
                                            float(launch["ts"])):
        rule = rules.PLAIT_CHECK
    if coll is None and call is not None:
        cargs = call.get("args", {})
        coll = str(cargs.get("Collective name") or call.get("name", ""))
        args = {**cargs, **{k: v for k, v in args.items() if k not in cargs}}
        if "In msg nelems" not in cargs:  # a c10d call: its tensors' shapes
            dims = _listed(cargs.get("Input Dims"))
            types = _listed(cargs.get("Input type")) or [None]
            outs = _numel(dims[0]) if dims else 0
            ins = _numel(dims[1]) if len(dims) > 1 and dims[1] else outs
            args |= {"In msg nelems": ins, "Out msg nelems": outs, "dtype": types[0]}
    kind = rules.kind_of(coll or name)
    if kind is None and coll is not None:
        kind = rules.kind_of(name)
    c = _comm(start, end, track, name, kind, _number(args.get("Group size")),
              _number(args.get("In msg nelems")), _number(args.get("Out msg nelems")),
              args.get("dtype"), rule=rule, step=step, launched=launched,
              label_from=coll or name)
    return replace(c, named_only=True) if coll is None else c


def _peer_copy(e: dict[str, Any], launch: dict[str, Any] | None, ctx: _Context,
               step: int | None) -> Comm:
    """A peer-to-peer memory copy: copy-engine (or NVLink) traffic, communication. Launched
    inside a collective's call (NCCL's zero-CTA copy-engine collectives, a library's
    copy-engine all-gather) it is that collective, "by copy engine"; else a plain p2p copy."""
    args = e.get("args", {})
    start, end = _interval(e)
    launched = float(launch["ts"]) if launch is not None else None
    call = ctx.call_of(launch)
    kind, group, label = CollectiveKind.P2P, 2, "p2p"
    if call is not None:
        cargs = call.get("args", {})
        coll = str(cargs.get("Collective name") or call.get("name", ""))
        known = rules.kind_of(coll)
        kind = known or CollectiveKind.P2P
        group = _number(cargs.get("Group size")) or 2
        label = f"{rules.label_of(coll, known)} {rules.BY_COPY_ENGINE}"
    return Comm(start, end, f"stream {args.get('stream', e.get('tid'))}", str(e.get("name", "")),
                kind, group, 0, float(_number(args.get("bytes"))), None, label,
                rules.PEER_MEMCPY, step, launched)


def _like_siblings(comms: list[Comm]) -> list[Comm]:
    """Kernels of one name whose kind only their name gave take the kind their siblings' NCCL
    metadata or launching call gave (the most common), so one kernel is not labelled two ways
    (a send/recv kernel read as `p2p` beside the same kernel known to run an all-reduce)."""
    known: dict[str, Counter[tuple[CollectiveKind | None, str]]] = {}
    for c in comms:
        if not c.named_only and c.rule != rules.PLAIT_CHECK:
            known.setdefault(c.name, Counter())[c.kind, c.label] += 1
    out = []
    for c in comms:
        if c.named_only and c.name in known:
            (kind, label), _ = known[c.name].most_common(1)[0]
            c = replace(c, kind=kind, label=label, named_only=False)
        out.append(c)
    return out


def _step_numbers(*events: Sequence[Comm | Kernel]) -> tuple[int, ...]:
    return tuple(sorted({x.step for es in events for x in es if x.step is not None}))


def _regions(spans: list[dict[str, Any]], pid: object, cat: str
             ) -> tuple[tuple[str, float, float], ...]:
    return tuple(sorted((str(e.get("name", "")), *_interval(e))
                        for e in spans if e.get("cat") == cat and e.get("pid") == pid))


def _cpu_devices(spans: list[dict[str, Any]], ctx: _Context, world: int | None
                 ) -> list[DeviceTrace]:
    out = []
    for pid in sorted({e.get("pid") for e in spans}, key=str):
        mine = [e for e in spans if e.get("pid") == pid]
        work = sorted((e for e in mine if str(e.get("name", "")).startswith("gloo:")), key=_ts)
        calls = sorted((e for e in mine if e.get("cat") == "cpu_op"
                        and str(e.get("name", "")).startswith("c10d::")), key=_ts)
        # gloo runs its work in the order it was issued: the k-th piece of work is the k-th call
        if len(calls) != len(work):
            calls = work
        comms = [_gloo_comm(w, c, world, ctx) for w, c in zip(work, calls, strict=True)]
        # plait's peer-copy engine on CPU: its copier thread's copies (recorded when the
        # profiler follows every thread)
        copies = [e for e in mine if tracing.is_copy(str(e.get("name", "")))]
        comms += [Comm(*_interval(e), f"thread {e.get('tid')}", str(e["name"]), CollectiveKind.P2P,
                       int(world or 0), 0, 0.0, None, "p2p", "plait copy engine",
                       ctx.step_at(float(e["ts"]))) for e in copies]
        busy: dict[object, list[tuple[float, float]]] = {}
        for e in sorted(work + copies, key=_ts):
            busy.setdefault(e.get("tid"), []).append(_interval(e))
        compute = [_compute(*_interval(e), f"thread {e.get('tid')}", str(e["name"]), e,
                            ctx.step_at(float(e["ts"])), None)
                   for e in mine if e.get("cat") == "cpu_op"
                   and str(e.get("name", "")).startswith("aten::")
                   and not _inside(float(e["ts"]), busy.get(e.get("tid"), []))]
        if comms or compute:
            out.append(DeviceTrace(f"cpu {pid}", pid, tuple(sorted(comms, key=_start)),
                                   tuple(sorted(compute, key=_start)),
                                   _step_numbers(comms, compute),
                                   _regions(mine, pid, "user_annotation")))
    return out


def _gloo_comm(work: dict[str, Any], call: dict[str, Any], world: int | None, ctx: _Context
               ) -> Comm:
    start, end = _interval(work)
    args = call.get("args")
    args = args if isinstance(args, dict) else {}
    dims = _listed(args.get("Input Dims"))
    kind = rules.kind_of(str(call["name"]))
    types = _listed(args.get("Input type")) or [None]
    if call is work:  # no c10d call to read: gloo's own input is all we know
        n = _numel(dims[0]) if dims else 0
        ins = outs = n
    else:  # c10d::_allgather_base_(output, input), _reduce_scatter_base_(output, input), ...
        outs = _numel(dims[0]) if len(dims) > 0 else 0
        ins = _numel(dims[1]) if len(dims) > 1 and dims[1] else outs
    own = ctx.checks.at(call.get("pid"), call.get("tid"), float(call["ts"])) is not None
    return _comm(start, end, f"thread {work.get('tid')}", str(call["name"]), kind,
                 int(world or 0), ins, outs, types[0],
                 rule=rules.PLAIT_CHECK if own else "gloo", step=ctx.step_at(float(call["ts"])))


def _comm(start: float, end: float, track: str, name: str, kind: CollectiveKind | None,
          group: int, ins: int, outs: int, dtype: object, *, rule: str,
          step: int | None, launched: float | None = None, label_from: str | None = None
          ) -> Comm:
    """The full tensor plait's cost model counts: the gathered output of an all-gather, the
    input of the others. `dtype` as the trace records it."""
    elems = outs if kind is CollectiveKind.AG else ins
    label = (rules.PLAIT_CHECK if rule == rules.PLAIT_CHECK
             else rules.label_of(label_from or name, kind))
    return Comm(start, end, track, name, kind, group, elems,
                float(elems * kineto_bytes(dtype)), from_kineto(dtype), label, rule, step,
                launched)


def _compute(start: float, end: float, track: str, name: str, op: dict[str, Any] | None,
             step: int | None, launched: float | None) -> Kernel:
    if op is None or op.get("name") not in _GEMMS or op.get("plait"):
        return Kernel(start, end, track, name, step=step, launched=launched)
    args = op.get("args", {})
    types = [t for t in _listed(args.get("Input type")) if t]
    strides = [x for x in _listed(args.get("Input Strides")) if _sizes(x) and len(x) >= 2]
    if op["name"] in ("aten::addmm", "aten::baddbmm"):
        strides = strides[-2:]
    flags = tuple(len(x) == 2 and x[0] == 1 and x[1] > 1 for x in strides[:2])
    dims = _listed(args.get("Input Dims"))
    return Kernel(start, end, track, name, _gemm_dims(op["name"], dims),
                  from_kineto(types[0]) if types else None,
                  flags if op["name"] in ("aten::mm", "aten::addmm") and len(flags) == 2
                  else (False, False), step, launched)


def _gemm_dims(op: str, dims: list[Any]) -> tuple[int, int, int, int] | None:
    """(m, n, k, count) of a matmul operator from its recorded input shapes."""
    shapes = [d for d in dims if _sizes(d) and len(d) >= 2]
    if op in ("aten::addmm", "aten::baddbmm"):
        shapes = shapes[-2:]  # bias / accumulator first
    if len(shapes) < 2:
        return None
    a, b = shapes[0], shapes[1]
    if op in ("aten::bmm", "aten::baddbmm") and len(a) == 3 and len(b) == 3:
        return a[1], b[2], a[2], a[0]
    if op == "aten::linear":  # x[..., K] @ W[N, K]^T
        return math.prod(a[:-1]), b[0], a[-1], 1
    return math.prod(a[:-1]), b[-1], a[-1], 1


def _sizes(d: object) -> bool:
    """A recorded shape or strides: a list of integers (traces also hold strings there)."""
    return isinstance(d, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                       for x in d)


def _odd_dims(dims: object) -> bool:
    """Recorded input shapes that are not what the profiler writes (a list with, per input, a
    list of sizes or a tensor list's lists of sizes): strings, or a bare string."""
    if dims is None:
        return False
    if not isinstance(dims, list):
        return True
    return not all(isinstance(d, list) and (_sizes(d) or all(_sizes(x) for x in d))
                   for d in dims)


def _listed(value: object) -> list[Any]:
    """A recorded list (of shapes, of types), or none where the trace holds something else."""
    return value if isinstance(value, list) else []


def _numel(dims: object) -> int:
    """Elements of a recorded tensor shape (a list of sizes), or of a tensor list's shapes."""
    if not isinstance(dims, list) or not dims:
        return 0
    if all(isinstance(x, list) for x in dims):
        return sum(_numel(x) for x in dims)
    return math.prod(dims) if all(isinstance(x, int) for x in dims) else 0


def _inside(t: float, spans: list[tuple[float, float]]) -> bool:
    """Whether time `t` lies in one of `spans` (sorted by start, not overlapping)."""
    i = bisect_right(spans, (t, math.inf)) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def _interval(e: dict[str, Any]) -> tuple[float, float]:
    """[start, end) of a complete event, in microseconds."""
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _ts(e: dict[str, Any]) -> float:
    return float(e["ts"])


def _start(x: Comm | Kernel) -> float:
    return x.start


def read_paths(paths: Sequence[Path], extra: Any = ()) -> tuple[list[RankTrace], list[str]]:
    """The traces `paths` name (folders: the *.json and *.json.gz in them, in name order), and
    notes on the files skipped: what plait analyze wrote itself (a JSON result, a `--trace`)
    when it is among other traces."""
    files: list[tuple[Path, bool]] = []  # (path, found in a folder)
    for p in paths:
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            if not found:
                raise SpecError("trace", f"folder {str(p)!r} holds no .json or .json.gz trace",
                                "pass the folder the ranks exported their traces to")
            files += [(f, True) for f in found]
        else:
            files.append((p, False))
    read, notes = [], []
    for f, in_folder in files:
        try:
            t = read_trace(f, extra)
        except PlaitOutput:
            if not in_folder and len(files) == 1:
                raise
            notes.append(f"{f} skipped: it is plait analyze's own JSON result")
            continue
        if len(files) > 1 and t.written_by_plait:
            notes.append(f"{f} skipped: plait analyze --trace wrote it")
            continue
        read.append(t)
    if not read:
        raise SpecError("trace", "every file given is plait analyze's own output",
                        "pass the traces torch.profiler wrote")
    return read, notes
