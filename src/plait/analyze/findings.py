"""What stopped overlap, found in any job's trace (plait's or not): each finding one line with
its evidence and the fix.

- Communication kernels on a stream that also runs compute: a stream runs its kernels one
  after another, so those transfers can never overlap that compute.
- Communication and compute that never run at the same time although both are there: the
  overlap is not happening (serialized queues, a wait right after each launch, one stream).
- A dependent pair run plainly where a fused overlap was meant to run: transfers that feed or
  take exactly a GEMM's operand (`analyze.pairing`), exposed, with no fused or decomposed
  kernel of PyTorch's symmetric memory, TransformerEngine's userbuffers or plait's own ranges in
  the trace.
- The host set the pace: the device sat idle before kernels the CPU launched only after it went
  idle (HTA's host wait, on the device's busy time: `analyze.breakdown`), for a part of the
  span that matters; inside plait's calls it gives how often they issued a GPU operation, the
  measured counterpart of the model's host issue (`params.host_call_s`).
- A copy-engine transfer expected where SM kernels moved the data: a plait call whose schedule
  asks for copy engines (`/dma`) ran on another engine, or its data moved by collective
  kernels and no peer copy; NCCL all-gathers or all-to-alls run as SM kernels where other
  calls of the same collective went by copy engine (NCCL's zero-CTA path taken for some calls
  only), or where the job says it asked for copy engines (`expect_copy_engines`).

Copy-engine traffic is communication, never idle time or compute: a peer copy launched inside
a collective's call is that collective "by copy engine" (`analyze.kineto`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from plait import tracing
from plait.analyze import rules
from plait.analyze.breakdown import HOST, idle_gaps
from plait.analyze.exposure import DeviceExposure, exposed_of
from plait.analyze.kineto import Comm, DeviceTrace, Kernel
from plait.analyze.pairing import dependent_pairs
from plait.intervals import intersect, length, union
from plait.workload.operators import CollectiveKind

NEVER_OVERLAPPED = 0.01  # overlapped under 1% of the communication: overlap is not happening
EXPOSED_MATTERS = 0.05  # findings about exposure need it to be at least 5% of the span
FUSED_RULES = ("symmetric memory", "userbuffers")  # kernels of fused or decomposed overlap
COMPUTE_STREAM = 0.2  # a stream running this share of a device's compute is a compute stream
# the collectives NCCL's zero-CTA policy can carry on copy engines (NCCL_CTA_POLICY_ZERO)
COPY_ENGINE_KINDS = (CollectiveKind.AG, CollectiveKind.A2A)


@dataclass(frozen=True, slots=True)
class Finding:
    device: str
    what: str  # what stopped overlap
    evidence: str  # the figures that show it
    fix: str


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f} ms"


def same_stream(d: DeviceTrace) -> list[Finding]:
    """GPU streams that run collective kernels beside a good part of the device's compute (a
    communication stream that also runs small helper kernels is not one)."""
    if not d.device.startswith("gpu"):
        return []  # gloo works on its own threads: there is no shared queue to find
    work_on: dict[str, float] = {}
    for k in d.compute:
        work_on[k.track] = work_on.get(k.track, 0.0) + k.duration
    total = sum(work_on.values())
    out = []
    for track in sorted({c.track for c in d.comms if c.rule not in (rules.PEER_MEMCPY,
                                                                     rules.PLAIT_CHECK)}):
        work = work_on.get(track, 0.0)
        if total <= 0 or work < COMPUTE_STREAM * total:
            continue
        mine = [c for c in d.comms if c.track == track]
        out.append(Finding(
            d.device, f"communication kernels run on the compute {track}",
            f"{len(mine)} collective kernels ({_ms(sum(c.duration for c in mine))}) share "
            f"{track} with {_ms(work)} of compute: one stream runs them one after the other",
            "issue collectives on a stream of their own (async_op=True, or the library's "
            "communication stream); do not wrap them in the compute stream's context"))
    return out


def never_overlapped(d: DeviceTrace, e: DeviceExposure) -> list[Finding]:
    """Compute and communication both present, and practically never at the same time."""
    if e.comm_us <= 0 or e.compute_us <= 0 or e.span_us <= 0:
        return []
    if e.overlapped_us > NEVER_OVERLAPPED * e.comm_us:
        return []
    if e.exposed_us < EXPOSED_MATTERS * e.span_us:
        return []
    per = f" per step over {e.steps} steps" if e.steps else ""
    return [Finding(
        d.device, "compute and communication never run at the same time",
        f"{_ms(e.overlapped_us / (e.steps or 1))} of {_ms(e.comm_us / (e.steps or 1))} "
        f"communication overlapped{per}; {_ms(e.exposed_us / (e.steps or 1))} exposed "
        f"({e.exposed_us / e.span_us:.0%} of the span)",
        "overlap needs the transfer issued before the compute it hides behind, on another "
        "stream, and waited only where its result is read: check `plait doctor` "
        "(CUDA_DEVICE_MAX_CONNECTIONS=1, CUDA_LAUNCH_BLOCKING=1), waits right after each "
        "launch, and run the pairs below through plait's ops or PyTorch's async TP")]


def plain_pairs(d: DeviceTrace, e: DeviceExposure, has_fused: bool) -> list[Finding]:
    """Dependent pairs that ran as a plain collective, then the GEMM (or the reverse), exposed,
    with no fused or decomposed overlap anywhere in the trace."""
    if has_fused:
        return []
    pairs = dependent_pairs(d)
    exposed = {p: sum(exposed_of(c, e.compute) for c, _ in calls) for p, calls in pairs.items()}
    shown = [p for p in pairs if exposed[p] > 0]
    if not shown:
        return []
    total = sum(exposed[p] for p in shown)
    calls = sum(len(pairs[p]) for p in shown)
    names = ", ".join(p.name for p in sorted(shown, key=lambda p: -exposed[p])[:3])
    per = f" ({_ms(total / e.steps)} per step)" if e.steps else ""
    return [Finding(
        d.device, "dependent pairs run plainly: no fused overlap ran",
        f"{len(shown)} pair shapes, {calls} calls, of a transfer feeding or taking exactly a "
        f"GEMM's operand ({names}): {_ms(total)} of their transfers exposed{per}; no "
        "symmetric-memory, userbuffers or plait kernels in the trace",
        "run them through plait's ops or layers (plait explore picks the schedules), or enable "
        "PyTorch's async TP (torch._inductor.config._micro_pipeline_tp = True under "
        "torch.compile; releases that have not deprecated enable_symm_mem_for_group also need "
        "that call); if it is enabled, "
        "its pattern did not match these calls")]


def host_bound(d: DeviceTrace, e: DeviceExposure) -> list[Finding]:
    """The device idle, nothing queued, for a part of the span that matters: the CPU did not
    launch fast enough. Inside plait's calls: the time lost there, and how often the calls
    issued a GPU operation (median over calls)."""
    gaps = [(a, b) for cause, a, b in idle_gaps(d) if cause == HOST]
    waited = sum(b - a for a, b in gaps)
    if e.span_us <= 0 or waited < EXPOSED_MATTERS * e.span_us:
        return []
    calls = [(start, end) for name, start, end in d.regions if tracing.parse_call(name)]
    per = f" per step over {e.steps} steps" if e.steps else ""
    evidence = (f"{_ms(waited / (e.steps or 1))} idle{per} ({waited / e.span_us:.0%} of the "
                f"span) in {len(gaps)} gaps, each before a kernel the CPU launched after the "
                "device had gone idle")
    if calls:
        inside = length(intersect(union(gaps), union(calls)))
        ran: list[Comm | Kernel] = [*d.comms, *d.compute, *d.memory]
        events = sorted((x.start, x.launched) for x in ran if x.launched is not None)
        begun = [b for b, _ in events]
        every = []
        for start, end in calls:  # the launches of what started inside the call
            launched = sorted(at for _, at in
                              events[bisect_left(begun, start):bisect_left(begun, end)])
            if len(launched) > 1:
                every.append((launched[-1] - launched[0]) / (len(launched) - 1))
        evidence += f"; {_ms(inside / (e.steps or 1))} of it inside plait's calls"
        if every:
            every.sort()
            evidence += (f", which issued a GPU operation every {every[len(every) // 2]:,.0f} "
                         "µs (median over calls)")
    return [Finding(
        d.device, "the host set the pace: the device waited for launches", evidence,
        "issue fewer, larger operations where steps are short: a coarser schedule (plait "
        "explore charges each step's host calls, params.host_call_s; schedule=\"auto\" "
        "measures it in the job), CUDA graphs or torch.compile(mode=\"reduce-overhead\"), or "
        "PyTorch's C++ async-TP executor (TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP=1); check that "
        "the CPU is neither throttled nor shared")]


def copy_engine_not_used(d: DeviceTrace) -> list[Finding]:
    """plait calls that asked for copy engines and moved their data another way."""
    off: dict[str, list[str]] = {}  # schedule -> why, per call
    starts = [x.start for x in d.comms]  # in start order
    longest = max((x.duration for x in d.comms), default=0.0)
    for name, start, end in d.regions:
        c = tracing.parse_call(name)
        if c is None or "/dma" not in c.schedule or c.ranks < 2:
            continue
        near = d.comms[bisect_left(starts, start - longest):bisect_left(starts, end)]
        inside = [x for x in near if x.end > start and x.rule != rules.PLAIT_CHECK]
        sm = [x for x in inside if x.rule not in (rules.PEER_MEMCPY,) and
              not x.name.startswith(tracing.COPY)]
        copies = [x for x in inside if x not in sm]
        if not c.engine.startswith("peer_copy"):
            off.setdefault(c.schedule, []).append(f"ran on {c.engine}")
        elif sm and not copies:
            off.setdefault(c.schedule, []).append(f"{len(sm)} collective kernels, no copy")
    return [Finding(d.device, f"copy engines expected, not used: {schedule}",
                    f"{len(why)} calls: {why[0]}",
                    "check `plait doctor` (symmetric memory, peer access, NCCL_P2P_DISABLE); "
                    "the runtime records the engine each call ran (runtime_of(group).records)")
            for schedule, why in off.items()]


def nccl_copy_engines(d: DeviceTrace, expected: bool = False) -> list[Finding]:
    """NCCL collectives that moved their data with SM kernels where copy engines were expected:
    other calls of the same collective went by copy engine, or the job asked for them
    (`expected`: NCCL's zero-CTA policy was set)."""
    out = []
    for kind in COPY_ENGINE_KINDS:
        sm = [c for c in d.comms if c.kind is kind and c.rule == rules.ANNOTATED]
        ce = [c for c in d.comms if c.kind is kind and c.rule == rules.PEER_MEMCPY]
        if not sm or not (ce or expected):
            continue
        why = (f"{len(ce)} peer copies inside other {kind.value} calls went by copy engine"
               if ce else "the job asked NCCL for copy engines (its zero-CTA policy)")
        out.append(Finding(
            d.device, f"copy engines expected, not used: NCCL {kind.value}",
            f"{len(sm)} NCCL {kind.value} kernels ({_ms(sum(c.duration for c in sm))}) moved "
            f"their data on SMs; {why}",
            "NCCL's copy-engine (zero-CTA) collectives need NCCL >= 2.28 with "
            "NCCL_CTA_POLICY=2 (or the communicator's cta_policy), buffers registered as "
            "symmetric windows (NCCL_WIN_COLL_SYMMETRIC) and peers in one NVLink domain; "
            "otherwise NCCL runs SM kernels without saying so: check `plait doctor`"))
    return out


def findings(devices: Sequence[DeviceTrace], exposure: Sequence[DeviceExposure],
             has_plait_ranges: bool = False, expect_copy_engines: bool = False
             ) -> list[Finding]:
    """Every finding on a trace's devices (`exposure`: theirs, in the same order).
    `has_plait_ranges`: the trace shows plait's own calls (its decomposed overlap);
    `expect_copy_engines`: the job asked NCCL for copy-engine collectives."""
    has_fused = has_plait_ranges or any(
        c.rule in FUSED_RULES for d in devices for c in d.comms)
    out: list[Finding] = []
    for d, e in zip(devices, exposure, strict=True):
        out += (same_stream(d) + never_overlapped(d, e) + plain_pairs(d, e, has_fused)
                + host_bound(d, e) + copy_engine_not_used(d)
                + nccl_copy_engines(d, expect_copy_engines))
    return out
