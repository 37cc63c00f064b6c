"""Heuristics: pick a schedule from static sizes in well under a millisecond, without the
event simulation, and say why in one line.

The rules, in order:
1. A group of one rank has nothing to overlap: sequential.
2. Engine, per candidate: copy engines when a step's chunk per peer is well past the copy
   command's overhead knee (`chunk / bandwidth >= KNEE x command overhead`) or when the
   collective kernels' compute-unit share and interference cost more than the copy overhead;
   both engines are estimated and the cheaper kept.
3. Pattern: on a full mesh a shard-level step uses one link of P-1, so finer grain (all peers
   per step); on a switch or PCIe both are estimated.
4. Granularity: c sub-chunks per shard trade the exposed first (all-gather) or last
   (reduce-scatter) step, which shrinks as 1/c, against per-piece costs (launches, partial
   waves, copy overheads), which grow with c. Each candidate's time is a closed-form pipeline
   bound: transfers back to back on their engine, GEMM pieces back to back on the compute units,
   each piece waiting for its data (or each transfer for its piece), with the calibrated
   contention slowdowns applied to the overlapped parts.
5. Overlap only when it beats the sequential estimate of the same engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from plait.cost.comm import collective_time, dma_copy, elementwise_time, sm_exchange
from plait.cost.gemm import gemm_time
from plait.errors import InfeasibleError
from plait.schedule.schedule import PER_PEER, CommPattern, Engine, Schedule
from plait.sim.engine import work_conserving
from plait.sim.pair import check_feasible
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import OverlapPair

KNEE = 4.0  # chunk transfer time over command overhead past which copy engines are efficient
CHUNKS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Pick:
    schedule: Schedule
    estimate_s: float
    reason: str


def pick(pair: OverlapPair, cluster: ClusterSpec,
         candidates: Iterable[Schedule] | None = None) -> Pick:
    """The heuristic's schedule for `pair` on `cluster`, its estimate and a one-line reason.

    `candidates` restricts the choice (default: its own short list of likely winners)."""
    P = pair.ranks
    if P == 1:
        return Pick(Schedule(), gemm_time(pair.gemm, cluster), "one rank: nothing to overlap")
    g_whole = gemm_time(pair.gemm, cluster)
    seq = {e: g_whole + _whole_transfer(pair, cluster, e) for e in Engine}
    gemm = _GemmCache(pair, cluster)  # GEMM piece times, shared by all candidates
    best: Pick | None = None
    for s in candidates if candidates is not None else _shortlist(pair, cluster):
        try:
            check_feasible(pair, s)
        except InfeasibleError:
            continue
        est = seq[s.engine] if s.comm is CommPattern.SEQ else _pipeline(pair, cluster, s, gemm)
        if best is None or est < best.estimate_s * (1 - 1e-9):
            best = Pick(s, est, "")
    if best is None:
        best = Pick(Schedule(), seq[Engine.SM], "")
    return Pick(best.schedule, best.estimate_s, _reason(pair, cluster, best, g_whole, seq))


def _shortlist(pair: OverlapPair, cluster: ClusterSpec) -> Iterator[Schedule]:
    """Sequential on both engines, finer grain (c = 1..16, a piece per step or per peer), and
    shard-level P2P except on a mesh, where it uses one link of P-1 per step."""
    mesh = cluster.topology.kind == "mesh" and pair.ranks > 2
    for engine in Engine:
        yield Schedule(CommPattern.SEQ, engine)
        if not mesh:
            yield Schedule(CommPattern.P2P, engine, axis=pair.axis)
        for c in CHUNKS:
            for g in (1, PER_PEER):
                yield Schedule(CommPattern.FINE, engine, c, g, pair.axis)


def _whole_transfer(pair: OverlapPair, cluster: ClusterSpec, engine: Engine) -> float:
    if engine is Engine.SM:
        return collective_time(pair.collective, cluster)
    return _dma_step(pair, cluster, pair.collective.bytes / pair.ranks) + (
        _reduce(pair, cluster, 1) if pair.reduces else 0.0)


def _dma_step(pair: OverlapPair, cluster: ClusterSpec, chunk: float) -> float:
    """All peers' copy commands of one step: spread over the engines, sharing the routes."""
    P, dma = pair.ranks, cluster.gpu.dma
    one = dma_copy(cluster, 1, chunk, pair.collective.stride)
    waves = math.ceil((P - 1) / dma.engines)
    shared = max(sum(v for r, v in one.uses.items() if r != "hbm") * (P - 1)
                 if cluster.topology.kind != "mesh" else 1.0, 1.0)
    return one.duration * max(waves, shared)


def _reduce(pair: OverlapPair, cluster: ClusterSpec, steps: int) -> float:
    return elementwise_time((pair.ranks + 1) * pair.collective.bytes / pair.ranks, cluster) \
        if steps else 0.0


def _pipeline(pair: OverlapPair, cluster: ClusterSpec, s: Schedule, gemm: _GemmCache
              ) -> float:
    """Closed-form pipeline bound of schedule `s`: when each chunk of data is ready, when each
    GEMM piece can run, with constant contention rates while both sides are busy."""
    P, p = pair.ranks, cluster.params
    c = s.chunks if s.comm is CommPattern.FINE else 1
    extent = pair.split_extent
    block_bytes = pair.collective.bytes / (P * c)
    stride = pair.collective.stride
    in_kernel = pair.reduces and s.engine is Engine.SM and s.comm is CommPattern.FINE
    per_peer = s.group == PER_PEER
    group = 1 if per_peer else s.group
    block_rows = extent // (P * c)
    if s.comm is CommPattern.P2P:  # P-1 steps, one peer each, a shard per piece
        x = (sm_exchange(cluster, [1], block_bytes, stride).duration if s.engine is Engine.SM
             else dma_copy(cluster, 1, block_bytes, stride).duration)
        steps = [[x] for _ in range(P - 1)]  # per step: arrival offsets of its chunks
    elif s.engine is Engine.SM:
        x = sm_exchange(cluster, list(range(1, P)), block_bytes, stride,
                        reduce=in_kernel).duration
        steps = [[x] * (P - 1) for _ in range(c)]  # one kernel: all peers arrive together
    else:
        x = _dma_step(pair, cluster, block_bytes)
        waves = math.ceil((P - 1) / cluster.gpu.dma.engines)  # copies run an engine-wave apart
        steps = [[x * (i // cluster.gpu.dma.engines + 1) / waves for i in range(P - 1)]
                 for _ in range(c)]
    if s.engine is Engine.SM:
        cu = min(1.0, p.comm_compute_units / cluster.gpu.compute_units)
        g_rate = (1.0 - cu) * (1.0 - p.gemm_slowdown_sm_comm)  # as the simulator: both apply
        x_rate = 1.0 - p.sm_comm_slowdown_under_compute
    else:
        g_rate, x_rate = 1.0 - p.gemm_slowdown_dma, 1.0 - p.dma_slowdown_under_compute
    both = work_conserving({"g": g_rate, "x": x_rate})  # as the simulator shares
    g_rate, x_rate = both["g"], both["x"]
    # Pieces: (data it needs: (step, peer index) or a whole step, rows).
    own = 1 if in_kernel else 0  # the kernel reduces our own rows too: computed per step
    if s.comm is CommPattern.P2P:
        pieces = [([j], None, block_rows) for j in range(P - 1)]
    elif per_peer:
        pieces = [([j], i, block_rows) for j in range(c) for i in range(P - 1 + own)]
    else:
        pieces = [(list(range(j, j + group)), None, block_rows * (P - 1 + own) * group)
                  for j in range(0, c, group)]
    local = 0.0 if in_kernel else gemm(extent // P)
    if pair.direction == "in":
        ends: list[list[float]] = []
        for offsets in steps:  # transfers back to back, slowed while compute runs
            start = ends[-1][-1] if ends else 0.0
            ends.append([start + o / x_rate for o in offsets])
        busy_until = ends[-1][-1]
        t = _run(0.0, local, busy_until, g_rate)
        for needed, peer, rows in pieces:
            ready = max(ends[j][-1] if peer is None else ends[j][peer] for j in needed)
            t = _run(max(t, ready), gemm(rows), busy_until, g_rate)
        return t
    # out: pieces in order; a step's transfer starts once its last piece is done; own rows
    # last; then the reduction of what arrived.
    remaining: dict[int, int] = {}
    for needed, _peer, _rows in pieces:
        for j in needed:
            remaining[j] = remaining.get(j, 0) + 1
    done_step: dict[int, float] = {}
    t = 0.0
    for needed, _peer, rows in pieces:  # transfers run from the first step's end: slowed
        t += gemm(rows) / (g_rate if done_step else 1.0)
        for j in needed:
            remaining[j] -= 1
            if remaining[j] == 0:
                done_step[j] = t
    t += local / g_rate
    sent = 0.0
    for j in sorted(done_step):
        start = max(sent, done_step[j])
        sent = _run(start, steps[j][-1], t, x_rate)  # slowed while the GEMM still runs
    red = _reduce(pair, cluster, 1) if pair.reduces and not in_kernel else 0.0
    return max(t, sent) + red


def _run(start: float, work: float, busy_until: float, rate: float) -> float:
    """End of `work` seconds of standalone work begun at `start`, done at `rate` until
    `busy_until` (while the other side runs) and at full speed after."""
    if start >= busy_until:
        return start + work
    slow_span = work / rate
    if start + slow_span <= busy_until:
        return start + slow_span
    return busy_until + work - (busy_until - start) * rate


class _GemmCache:
    def __init__(self, pair: OverlapPair, cluster: ClusterSpec) -> None:
        self.pair, self.cluster, self.memo = pair, cluster, {}

    def __call__(self, rows: int) -> float:
        if rows not in self.memo:
            piece = self.pair.gemm.piece(self.pair.axis, max(rows, 1), "p")
            self.memo[rows] = gemm_time(piece, self.cluster)
        return self.memo[rows]


def _reason(pair: OverlapPair, cluster: ClusterSpec, best: Pick, g_whole: float,
            seq: dict[Engine, float]) -> str:
    s = best.schedule
    comm = min(seq.values()) - g_whole
    ratio = g_whole / comm if comm > 0 else math.inf
    head = (f"GEMM {g_whole * 1e6:,.0f} us vs transfer {comm * 1e6:,.0f} us "
            f"(x{ratio:.2f}) on {pair.ranks} ranks, {cluster.topology.kind}")
    if s.comm is CommPattern.SEQ:
        return (f"{head}: no overlap beats sequential (piece and step overheads exceed the "
                f"{min(g_whole, comm) * 1e6:,.0f} us it could hide); {s.engine} moves it faster")
    how = "one peer per step" if s.comm is CommPattern.P2P else \
        f"{s.chunks} sub-chunk step(s) with all peers at once"
    eng = ("copy engines: chunks past the command-overhead knee, no compute units taken"
           if s.engine is Engine.DMA else
           "collective kernels: chunks too small for copy-command overhead")
    gain = max(seq.values()) / best.estimate_s if best.estimate_s > 0 else 1.0
    return f"{head}: {how}; {eng}; est. {best.estimate_s * 1e6:,.0f} us (x{gain:.2f} vs seq)"
