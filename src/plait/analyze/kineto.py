"""Reading a torch.profiler (Kineto) Chrome trace into what the exposure analysis needs.

A trace is one rank's `prof.export_chrome_trace(...)` (JSON, optionally gzipped). From it:
- **communication**: on GPUs, the NCCL/RCCL kernels (their `Collective name`, message sizes,
  group size and dtype come with the kernel) and peer-to-peer memcopies; on CPUs, gloo's work on
  its own threads (`gloo:*`), matched in order to the `c10d::*` calls that issued it (gloo runs a
  reduce-scatter as an all-reduce, so the kind and sizes come from the c10d call), and the
  copies of plait's CPU copy engine (`plait:copy *`, on its copier thread, recorded when the
  profiler follows every thread);
- **compute**: every other GPU kernel (GPU traces), or every `aten::*` operator that is not part
  of a transfer (CPU traces);
- **GEMMs**: compute whose operator is a matmul, with its (M, N, K) from the recorded input shapes
  (`record_shapes=True`), so a collective can be paired with the GEMM beside it;
- **steps**: `ProfilerStep#N` annotations, to report per step.

A trace with GPU kernels is analyzed on its GPUs (the CPU side only launches them).
"""

from __future__ import annotations

import gzip
import json
import math
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait import tracing
from plait.errors import SpecError
from plait.spec.dtypes import DTYPE_BYTES, from_kineto
from plait.workload.ops import CollectiveKind

_KINDS = (  # (pattern over a collective's name, kind), first match wins
    (r"all_?gather|allgather", CollectiveKind.AG),
    (r"reduce_?scatter|reducescatter", CollectiveKind.RS),
    (r"all_?reduce|allreduce", CollectiveKind.AR),
    (r"all_?to_?all|alltoall", CollectiveKind.A2A),
    (r"send|recv|ptop", CollectiveKind.P2P),
)
# Communication kernels known by name: PyTorch's symmetric-memory collectives (async TP,
# low-latency all-reduce) and TransformerEngine's userbuffers (its comm-GEMM overlap)
_COMM_KERNELS = ("multimem_", "one_shot_all_reduce", "two_shot_all_reduce", "symm_mem",
                 "userbuffers")
_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
          "aten::matmul", "aten::linear"}


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
    # Of its duration, the time spent waiting for the last rank to arrive: this rank's time in
    # the call minus the shortest any rank spent in it (None: other ranks' traces not given).
    wait: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def key(self) -> tuple[str, int, int]:
        """What identifies the same call on every rank, with its order among such calls."""
        return (self.kind.value if self.kind else self.name, self.group, self.elems)


@dataclass(frozen=True, slots=True)
class Compute:
    """One compute interval; `gemm` is (m, n, k, count) when it is a matmul of known shape."""

    start: float
    end: float
    track: str
    name: str
    gemm: tuple[int, int, int, int] | None = None
    dtype: str | None = None
    # operands that are transposed views (A (m, k) stored as (k, m); B (k, n) as (n, k)):
    # which dimension of the stored tensor its rows are, so which one a gather filled
    transposed: tuple[bool, bool] = (False, False)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class DeviceTrace:
    """Everything one device (a GPU, or a CPU process) did in the trace, in start order."""

    device: str
    pid: object  # the trace's process id of the device's events (to add tracks beside them)
    comms: tuple[Comm, ...]
    compute: tuple[Compute, ...]
    steps: int  # ProfilerStep annotations seen (0: none)
    # record_function ranges on this device's timeline: (name, start, end); on GPUs the ranges
    # Kineto projects onto the kernels they launched (gpu_user_annotation)
    regions: tuple[tuple[str, float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RankTrace:
    path: str
    rank: int | None
    world: int | None
    gpu_name: str | None  # as the trace's deviceProperties give it
    devices: tuple[DeviceTrace, ...]


def load_trace(path: str | Path) -> tuple[Any, list[Any]]:
    """The JSON document of a Chrome trace (.json or .json.gz) and its event list (the same
    list object inside it)."""
    p = Path(path)
    if not p.is_file():
        raise SpecError("trace", f"file {str(p)!r} does not exist",
                        "pass the JSON that torch.profiler's export_chrome_trace wrote")
    try:
        raw = _read_bounded(p)
        doc = json.loads(raw)
    except (OSError, ValueError, EOFError, RecursionError) as exc:  # EOF: a truncated .gz
        raise SpecError("trace", f"{p} is not a (gzipped) JSON trace: "
                        f"{type(exc).__name__}: {str(exc)[:200]}",
                        "pass the JSON that torch.profiler's export_chrome_trace wrote") from exc
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise SpecError("trace", f"{p} has no traceEvents list",
                        "pass a Chrome trace: a JSON object with a traceEvents array")
    return doc, events


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


def _usable(e: object) -> bool:
    """A complete event ("X") with finite, non-negative times."""
    if not (isinstance(e, dict) and e.get("ph") == "X"):
        return False
    ts, dur = e.get("ts"), e.get("dur")
    return (isinstance(ts, int | float) and isinstance(dur, int | float)
            and not isinstance(ts, bool) and math.isfinite(ts) and math.isfinite(dur)
            and dur >= 0)


def _clean(e: dict[str, Any]) -> dict[str, Any]:
    """An event with fields of the types the reader relies on: args a mapping (else none),
    name and category text, process and thread ids scalars."""
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


def read_trace(path: str | Path) -> RankTrace:
    """Read one rank's torch.profiler Chrome trace (.json or .json.gz)."""
    p = Path(path)
    doc, events = load_trace(p)
    info = doc.get("distributedInfo", {}) if isinstance(doc, dict) else {}
    world = info.get("world_size")
    spans = [_clean(e) for e in events if _usable(e)]
    steps = len({e["name"] for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")})
    spans = _mark_plait_pieces(spans)
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy")]
    devices = _gpu_devices(gpu, spans, steps) if gpu else _cpu_devices(spans, steps, world)
    props = doc.get("deviceProperties") if isinstance(doc, dict) else None
    gpu_name = props[0].get("name") if isinstance(props, list) and props and isinstance(
        props[0], dict) else None
    return RankTrace(str(p), info.get("rank"), world, gpu_name, tuple(devices))


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
    for ranges in pieces.values():
        ranges.sort()
    return [e | {"plait": True} if e.get("cat") == "cpu_op" and _inside(
        float(e["ts"]), pieces.get((e.get("pid"), e.get("tid")), [])) else e for e in spans]


def _gpu_devices(gpu: list[dict[str, Any]], spans: list[dict[str, Any]], steps: int
                 ) -> list[DeviceTrace]:
    ops = {e["args"]["External id"]: e for e in spans
           if e.get("cat") == "cpu_op" and isinstance(e["args"].get("External id"), int | str)}
    by_device: dict[object, tuple[list[Comm], list[Compute]]] = {}
    for e in gpu:
        args = e.get("args", {})
        comms, compute = by_device.setdefault(e.get("pid"), ([], []))
        start, end = _interval(e)
        track = f"stream {args.get('stream', e.get('tid'))}"
        name = str(e.get("name", ""))
        if e["cat"] == "gpu_memcpy":
            if "ptop" in name.lower():  # a peer copy (copy engine or NVLink), not a local one
                comms.append(Comm(start, end, track, name, CollectiveKind.P2P, 2, 0,
                                  float(_number(args.get("bytes"))), None))
            continue
        coll = args.get("Collective name")
        if coll is not None or _comm_kernel(name):
            kind = _kind(str(coll or name))
            comms.append(_comm(start, end, track, name, kind, _number(args.get("Group size")),
                               _number(args.get("In msg nelems")),
                               _number(args.get("Out msg nelems")),
                               from_kineto(args.get("dtype"))))
            continue
        ext = args.get("External id")
        op = ops.get(ext) if isinstance(ext, int | str) else None
        compute.append(_compute(start, end, track, name, op))
    return [DeviceTrace(f"gpu {pid}", pid, tuple(sorted(c, key=_start)),
                        tuple(sorted(g, key=_start)), steps,
                        _regions(spans, pid, "gpu_user_annotation"))
            for pid, (c, g) in sorted(by_device.items(), key=lambda x: str(x[0]))]


def _regions(spans: list[dict[str, Any]], pid: object, cat: str
             ) -> tuple[tuple[str, float, float], ...]:
    return tuple(sorted((str(e.get("name", "")), *_interval(e))
                        for e in spans if e.get("cat") == cat and e.get("pid") == pid))


def _cpu_devices(spans: list[dict[str, Any]], steps: int, world: int | None
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
        comms = [_gloo_comm(w, c, world) for w, c in zip(work, calls, strict=True)]
        # plait's peer-copy engine on CPU: its copier thread's copies (recorded when the
        # profiler follows every thread)
        copies = [e for e in mine if tracing.is_copy(str(e.get("name", "")))]
        comms += [Comm(*_interval(e), f"thread {e.get('tid')}", str(e["name"]), CollectiveKind.P2P,
                       int(world or 0), 0, 0.0, None) for e in copies]
        busy: dict[object, list[tuple[float, float]]] = {}
        for e in sorted(work + copies, key=_ts):
            busy.setdefault(e.get("tid"), []).append(_interval(e))
        compute = [_compute(*_interval(e), f"thread {e.get('tid')}", str(e["name"]), e)
                   for e in mine if e.get("cat") == "cpu_op"
                   and str(e.get("name", "")).startswith("aten::")
                   and not _inside(float(e["ts"]), busy.get(e.get("tid"), []))]
        if comms or compute:
            out.append(DeviceTrace(f"cpu {pid}", pid, tuple(sorted(comms, key=_start)),
                                   tuple(sorted(compute, key=_start)), steps,
                                   _regions(mine, pid, "user_annotation")))
    return out


def _gloo_comm(work: dict[str, Any], call: dict[str, Any], world: int | None) -> Comm:
    start, end = _interval(work)
    args = call.get("args", {})
    dims = args.get("Input Dims") or []
    kind = _kind(str(call["name"]))
    types = args.get("Input type") or [None]
    if call is work:  # no c10d call to read: gloo's own input is all we know
        n = _numel(dims[0]) if dims else 0
        ins = outs = n
    else:  # c10d::_allgather_base_(output, input), _reduce_scatter_base_(output, input), ...
        outs = _numel(dims[0]) if len(dims) > 0 else 0
        ins = _numel(dims[1]) if len(dims) > 1 and dims[1] else outs
    return _comm(start, end, f"thread {work.get('tid')}", str(call["name"]), kind,
                 int(world or 0), ins, outs, from_kineto(types[0]))


def _comm(start: float, end: float, track: str, name: str, kind: CollectiveKind | None,
          group: int, ins: int, outs: int, dtype: str | None) -> Comm:
    """The full tensor plait's cost model counts: the gathered output of an all-gather, the
    input of the others."""
    elems = outs if kind is CollectiveKind.AG else ins
    return Comm(start, end, track, name, kind, group, elems,
                float(elems * DTYPE_BYTES.get(dtype or "", 0)), dtype)


def _compute(start: float, end: float, track: str, name: str, op: dict[str, Any] | None
             ) -> Compute:
    if op is None or op.get("name") not in _GEMMS or op.get("plait"):
        return Compute(start, end, track, name)
    args = op.get("args", {})
    types = [t for t in args.get("Input type", []) if t]
    strides = [x for x in args.get("Input Strides", []) if isinstance(x, list) and len(x) >= 2]
    if op["name"] in ("aten::addmm", "aten::baddbmm"):
        strides = strides[-2:]
    flags = tuple(len(x) == 2 and x[0] == 1 and x[1] > 1 for x in strides[:2])
    return Compute(start, end, track, name, _gemm_dims(op["name"], args.get("Input Dims", [])),
                   from_kineto(types[0]) if types else None,
                   flags if op["name"] in ("aten::mm", "aten::addmm") and len(flags) == 2
                   else (False, False))


def _gemm_dims(op: str, dims: list[Any]) -> tuple[int, int, int, int] | None:
    """(m, n, k, count) of a matmul operator from its recorded input shapes."""
    shapes = [d for d in dims if isinstance(d, list) and len(d) >= 2]
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


def _comm_kernel(name: str) -> bool:
    """A communication kernel by name: NCCL/RCCL, PyTorch's symmetric-memory kernels,
    TransformerEngine's userbuffers."""
    low = name.lower()
    return low.startswith(("nccl", "rccl")) or any(k in low for k in _COMM_KERNELS)


def _kind(name: str) -> CollectiveKind | None:
    low = name.lower()
    return next((k for pat, k in _KINDS if re.search(pat, low)), None)




def _numel(dims: object) -> int:
    return math.prod(dims) if isinstance(dims, list) and dims else 0


def _inside(t: float, spans: list[tuple[float, float]]) -> bool:
    """Whether time `t` lies in one of `spans` (sorted by start, not overlapping)."""
    i = bisect_right(spans, (t, math.inf)) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def _interval(e: dict[str, Any]) -> tuple[float, float]:
    """[start, end) of a complete event, in microseconds."""
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _ts(e: dict[str, Any]) -> float:
    return float(e["ts"])


def _start(x: Comm | Compute) -> float:
    return x.start
