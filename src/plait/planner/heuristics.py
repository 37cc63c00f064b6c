"""Heuristics: pick a schedule from static sizes in a few milliseconds, without the event
simulation, and say why in one line.

The rules, in order:
1. A group of one rank has nothing to overlap: sequential.
2. Pattern: on a full mesh a shard-level step uses one link of P-1, so finer grain (all peers
   per step); on a switch or PCIe shard-level P2P is estimated too.
3. Engine: both are estimated; collective kernels take compute units and pay kernel overhead,
   copy engines pay a command overhead per peer and share a switch port or PCIe.
4. Granularity: c sub-chunks per shard trade the exposed first (all-gather) or last
   (reduce-scatter) step, which shrinks as 1/c, against per-piece costs (launches, partial
   waves, copy overheads), which grow with c. c doubles until the estimate has risen twice,
   with a piece per step; then, on an engine within 5% of the best, with a piece per
   (step, peer) or per g = 2, 4, ... steps.
5. The simplest estimate within 2% of the fastest wins (`simplest_within`, as the explorer
   chooses), so overlap only when it beats the sequential estimate by more than that.

Each candidate's estimate is a two-chain recurrence over its pieces, not an event simulation:
the GEMM pieces back to back on the compute units (with the operand copies the executor makes,
`copied_blocks`), the transfers back to back on their engine (copy engines as phases of equal
concurrent copies that share a port and HBM), each waiting for what it needs from the other
chain; while both chains run they are slowed by the calibrated contention and share HBM, and
run at full speed otherwise. Costs come from the one cost model (`plait.cost`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from plait.cost.comm import collective_time, dma_copy, elementwise_time, sm_exchange
from plait.cost.gemm import gemm_cost, gemm_time
from plait.cost.resources import Cost
from plait.errors import InfeasibleError
from plait.schedule.lower import Block, Compute
from plait.schedule.schedule import PER_PEER, CommPattern, Engine, Schedule, simplest_within
from plait.sim.engine import work_conserving
from plait.sim.pair import check_feasible, layout_copy_time, piece_copy_time
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import OverlapPair

CHUNKS = (1, 2, 4, 8, 16)
ENGINE_MARGIN = 0.05  # an engine this much slower at one piece per step is not searched further


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
    memo = _Memo(pair, cluster)  # piece costs, shared by all candidates
    estimates = list(_estimates(pair, cluster, candidates, seq, memo) if candidates is not None
                     else _search(pair, cluster, seq, memo)) or [(Schedule(), seq[Engine.SM])]
    # The simplest within SIMPLER_WITHIN of the fastest, as the explorer chooses; the runner-up
    # is the fastest that is measurably slower (equal estimates are mostly equal lowerings).
    best = simplest_within(estimates, lambda e: e[1], lambda e: e[0])
    slower = [e for e in estimates if e[1] > best[1] * (1 + 1e-6)]
    runner_up = min(slower, key=lambda e: e[1]) if slower else None
    return Pick(best[0], best[1], _reason(pair, cluster, best, runner_up, g_whole, seq))


def _estimates(pair: OverlapPair, cluster: ClusterSpec, candidates: Iterable[Schedule],
               seq: dict[Engine, float], memo: _Memo) -> Iterator[tuple[Schedule, float]]:
    for s in candidates:
        try:
            check_feasible(pair, s)
        except InfeasibleError:
            continue
        yield s, seq[s.engine] if s.comm is CommPattern.SEQ else (
            _pipeline(pair, cluster, s, memo) + sum(layout_copy_time(pair, cluster, s)))


def _search(pair: OverlapPair, cluster: ClusterSpec, seq: dict[Engine, float],
            memo: _Memo) -> Iterator[tuple[Schedule, float]]:
    """Sequential on both engines; shard-level P2P except on a mesh, where it uses one link of
    P-1 per step; finer grain with a piece per step (g = 1), sub-chunks c = 1, 2, ..., 16 until
    the estimate has risen twice (per-piece costs now outgrow the shrinking exposed step). Then,
    on each engine that came within `ENGINE_MARGIN` of the best so far, the other groupings: a
    piece per (step, peer) or per g = 2, 4, ... steps."""
    mesh = cluster.topology.kind == "mesh" and pair.ranks > 2
    best: dict[Engine, float] = {}

    def family(engine: Engine, g: int) -> Iterator[tuple[Schedule, float]]:
        lowest, rises = math.inf, 0
        for c in CHUNKS[CHUNKS.index(max(g, 1)):]:
            for s, est in _estimates(pair, cluster, [Schedule(
                    CommPattern.FINE, engine, c, g, pair.axis)], seq, memo):
                yield s, est
                rises = rises + 1 if est > lowest else 0
                lowest = min(lowest, est)
            if rises == 2:
                break

    for engine in Engine:
        first = [(Schedule(CommPattern.SEQ, engine), seq[engine])]
        if not mesh:
            first += _estimates(pair, cluster, [Schedule(CommPattern.P2P, engine,
                                                         axis=pair.axis)], seq, memo)
        first += family(engine, 1)
        best[engine] = min(est for _, est in first)
        yield from first
    top = min(best.values())
    for engine in Engine:
        if best[engine] <= top * (1 + ENGINE_MARGIN):
            for g in (PER_PEER, *CHUNKS[1:]):
                yield from family(engine, g)


def _whole_transfer(pair: OverlapPair, cluster: ClusterSpec, engine: Engine) -> float:
    if engine is Engine.SM:
        return collective_time(pair.collective, cluster)
    return _dma_step(pair, cluster, pair.collective.bytes / pair.ranks) + (
        _reduce(pair, cluster, 1) if pair.reduces else 0.0)


def _dma_step(pair: OverlapPair, cluster: ClusterSpec, chunk: float) -> float:
    """All peers' copy commands of one step: spread over the engines, sharing the routes."""
    return sum(item.work for item in _dma_copies(pair, cluster, chunk, 1)[1])


def _dma_copies(pair: OverlapPair, cluster: ClusterSpec, chunk: float, steps: int
                ) -> tuple[list[list[int]], list[_Item]]:
    """`steps` steps of copies issued at once, one per peer and step, peer i's on engine
    i mod engines, step by step: the engines run their queues side by side, sharing a switch
    port, PCIe or the NIC (not a mesh's per-peer links) and HBM. Equal copies, so the k-th of
    every busy engine ends together: one chain item per such phase. Returns which item each
    (step, peer) block lands with, and the items."""
    engines = cluster.gpu.dma.engines
    one = dma_copy(cluster, 1, chunk, pair.collective.stride)
    port, hbm = _shared_use(one), one.uses.get("hbm", 0.0)
    queues = [[(j, i) for j in range(steps) for i in range(e, pair.ranks - 1, engines)]
              for e in range(min(engines, pair.ranks - 1))]
    landed = [[0] * (pair.ranks - 1) for _ in range(steps)]
    items = []
    for k in range(max(len(q) for q in queues)):
        n = sum(len(q) > k for q in queues)
        items.append(_Item(one.duration * max(1.0, n * port, n * hbm), hbm, n, port))
        for q in queues[:n]:  # the longer queues come first
            j, i = q[k]
            landed[j][i] = len(items) - 1
    return landed, items


def _shared_use(c: Cost) -> float:
    """The share of a route every peer's copy crosses (a port, PCIe, the NIC) that `c` uses."""
    return sum(v for r, v in c.uses.items() if r != "hbm" and not r.startswith("link"))


def _reduce(pair: OverlapPair, cluster: ClusterSpec, steps: int) -> float:
    return elementwise_time((pair.ranks + 1) * pair.collective.bytes / pair.ranks, cluster) \
        if steps else 0.0


def _pipeline(pair: OverlapPair, cluster: ClusterSpec, s: Schedule, memo: _Memo
              ) -> float:
    """Two-chain recurrence of schedule `s`: the GEMM pieces in order on the compute units,
    the transfers in order on their engines, each waiting for what it needs from the other
    chain, slowed by contention (and shared HBM) only while both run."""
    P, dma = pair.ranks, cluster.gpu.dma
    fine = s.comm is CommPattern.FINE
    c = s.steps
    block_bytes = pair.collective.bytes / (P * c)
    block_rows = pair.split_extent // (P * c)
    stride = pair.collective.stride
    in_kernel = pair.reduces and s.engine is Engine.SM and fine
    per_peer = s.group == PER_PEER
    group = 1 if per_peer or not fine else s.group
    # A step's transfers as chain items, and the item each peer's block lands with.
    if s.comm is CommPattern.P2P:  # P-1 steps, one peer each
        one = (sm_exchange(cluster, [1], block_bytes, stride) if s.engine is Engine.SM
               else dma_copy(cluster, 1, block_bytes, stride))
        step, step_landed, n_steps = [_Item.of(one)], [0], P - 1
    elif s.engine is Engine.SM:
        one = sm_exchange(cluster, list(range(1, P)), block_bytes, stride, reduce=in_kernel)
        step, step_landed, n_steps = [_Item.of(one)], [0] * (P - 1), c
    else:
        landed1, step = memo.copies(block_bytes, 1)
        step_landed, n_steps = landed1[0], c
    own = 1 if in_kernel else 0  # the kernel reduces our own rows too: computed per step
    pieces: list[tuple[list[int], int | None, int]]  # (steps it needs, peer or all, rows)
    if s.comm is CommPattern.P2P:
        pieces = [([j], None, block_rows) for j in range(n_steps)]
    elif per_peer:
        pieces = [([j], i, block_rows) for j in range(c) for i in range(P - 1 + own)]
    else:
        pieces = [(list(range(j, j + group)), None, block_rows * (P - 1 + own) * group)
                  for j in range(0, c, group)]
    local = [] if in_kernel else [_Item(*memo.gemm(pair.split_extent // P))]
    copy = 0.0  # what the runtime copies around each grouped piece (the others read in place)
    if fine and not per_peer:
        shards = range(0 if in_kernel else 1, P)
        copy = piece_copy_time(pair, cluster, Compute("p", tuple(
            Block(sh, j) for j in range(group) for sh in shards)), s)
    if pair.direction == "in":
        # Every transfer is issued at once; pieces wait for their blocks. Copy engines run
        # the next step's copies while the last ones of a step still run.
        if s.engine is Engine.DMA and fine:
            landed, comm = memo.copies(block_bytes, c)
        else:
            comm = step * n_steps
            landed = [[j * len(step) + k for k in step_landed] for j in range(n_steps)]
        compute = local + [
            _Item(*memo.gemm(rows, copy if peer is None else 0.0),
                  after=max(landed[j][-1] if peer is None else landed[j][peer]
                            for j in needed))
            for needed, peer, rows in pieces]
        return _interleave(compute, comm, s.engine, cluster)[0]
    # out: pieces in order, own rows last; a step's transfer once its last piece is done;
    # then the reduction of what arrived.
    compute = [_Item(*memo.gemm(rows, copy if peer is None else 0.0))
               for _needed, peer, rows in pieces] + local
    comm = []
    last: dict[int, int] = {}
    for k, (needed, _peer, _rows) in enumerate(pieces):
        for j in needed:
            last[j] = k
    # A copy engine sends each peer's block as soon as its piece is done. On a shared port
    # that the copies saturate they take turns on it (`busy` each), and the last one's command
    # overhead and latency remain; otherwise each peer's copies queue on its own engine.
    sends_per_piece = per_peer and s.engine is Engine.DMA
    if sends_per_piece:
        one = dma_copy(cluster, 1, block_bytes, stride)
        busy = one.duration * _shared_use(one)
        port_bound = busy * min(P - 1, dma.engines) > one.duration
        share = _Item(busy if port_bound else sum(i.work for i in step) / (P - 1),
                      one.uses.get("hbm", 0.0))
    for j in sorted(last, key=last.__getitem__):
        if sends_per_piece:
            comm += [share.waiting_for(k)
                     for k, (need, _pe, _r) in enumerate(pieces) if need == [j]]
        else:
            comm += [step[0].waiting_for(last[j]), *step[1:]]
    t, ends = _interleave(compute, comm, s.engine, cluster)
    if sends_per_piece and port_bound:
        t = max(t + one.duration - busy, ends[len(pieces) - 1] + one.duration)
    elif sends_per_piece:
        _g, x_rate = _rates(s.engine, cluster, _Item(0.0, 0.0), _Item.of(one))
        free = [0.0] * dma.engines
        for k, (_need, peer, _rows) in enumerate(pieces):
            assert peer is not None  # sends per piece: a piece per (step, peer)
            e = peer % dma.engines
            start = max(free[e], ends[k])
            free[e] = start + (one.duration / x_rate if start < ends[-1] else one.duration)
        t = max(ends[-1], *free)
    return t + (_reduce(pair, cluster, 1) if pair.reduces and not in_kernel else 0.0)


@dataclass(frozen=True, slots=True)
class _Item:
    """A stretch of one chain: `width` equal tasks running side by side for `work` seconds
    (alone), each using `hbm` of the HBM bandwidth and `port` of a shared route."""

    work: float
    hbm: float
    width: int = 1
    port: float = 0.0
    after: int = -1  # index of the other chain's item it waits for (the chains are FIFO)

    def waiting_for(self, k: int) -> _Item:
        return _Item(self.work, self.hbm, self.width, self.port, k)

    @classmethod
    def of(cls, cost: Cost) -> _Item:
        return cls(cost.duration, cost.uses.get("hbm", 0.0), 1, _shared_use(cost))


def _interleave(compute: list[_Item], comm: list[_Item], engine: Engine,
                cluster: ClusterSpec) -> tuple[float, list[float]]:
    """When the last item of the two chains ends, and when each compute item ends. Each chain
    runs its items in order; an item starts once its predecessor and the other chain's item it
    waits for are done; while both run, they run at `_rates`."""
    nc, nx = len(compute), len(comm)
    t, i, j = 0.0, 0, 0
    ends: list[float] = []
    shared: dict[tuple[float, float, int, float], tuple[float, float]] = {}
    left_i = compute[0].work if nc else 0.0
    left_j = comm[0].work if nx else 0.0
    while i < nc or j < nx:
        on_i = i < nc and compute[i].after < j  # comm items 0..j-1 are done
        on_j = j < nx and comm[j].after < i
        if on_i and on_j:
            g, x = compute[i], comm[j]
            key = (g.hbm, x.hbm, x.width, x.port)
            rates = shared.get(key)
            if rates is None:
                rates = shared[key] = _rates(engine, cluster, g, x)
            gr, xr = rates
            dt_i, dt_j = left_i / gr, left_j / xr
            if dt_i <= dt_j:
                t += dt_i
                left_j -= xr * dt_i
                left_i = 0.0
            else:
                t += dt_j
                left_i -= gr * dt_j
                left_j = 0.0
        elif on_i:
            t += left_i
            left_i = 0.0
        elif on_j:
            t += left_j
            left_j = 0.0
        else:
            raise AssertionError("chains wait on each other")
        if on_i and left_i <= 1e-12 * max(1.0, compute[i].work):
            i += 1
            ends.append(t)
            left_i = compute[i].work if i < nc else 0.0
        if on_j and left_j <= 1e-12 * max(1.0, comm[j].work):
            j += 1
            left_j = comm[j].work if j < nx else 0.0
    return t, ends


def _rates(engine: Engine, cluster: ClusterSpec, g: _Item, x: _Item) -> tuple[float, float]:
    """Rates of GEMM item `g` and transfer item `x` running together, relative to each alone,
    shared as the simulator shares the GPU: compute units held by collective kernels, HBM and
    a shared route by nominal use, the calibrated slowdowns, never slower together than one
    after the other."""
    p = cluster.params

    def cap(*uses: float) -> float:
        return min(1.0, *(1.0 / u for u in uses if u > 0))

    both = cap(g.hbm + x.width * x.hbm)
    x_alone = cap(x.width * x.hbm, x.width * x.port)
    x_both = min(x_alone, both)
    if engine is Engine.SM:
        cu = min(1.0, p.comm_compute_units / cluster.gpu.compute_units)
        g_rate = min(1.0 - cu, both) * (1.0 - p.gemm_slowdown_sm_comm)
        x_both *= 1.0 - p.sm_comm_slowdown_under_compute
    else:
        g_rate = both * (1.0 - p.gemm_slowdown_dma)
        x_both *= 1.0 - p.dma_slowdown_under_compute
    rates = work_conserving({"g": g_rate, **{f"x{k}": x_both for k in range(x.width)}})
    return rates["g"], rates["x0"] / x_alone


class _Memo:
    """Costs of one pair's pieces, shared by all the candidates of one pick."""

    def __init__(self, pair: OverlapPair, cluster: ClusterSpec) -> None:
        self.pair, self.cluster = pair, cluster
        self._gemm: dict[int, tuple[float, float]] = {}
        self._copies: dict[tuple[float, int], tuple[list[list[int]], list[_Item]]] = {}

    def gemm(self, rows: int, copy_s: float = 0.0) -> tuple[float, float]:
        """Standalone time of the GEMM piece over `rows` (plus `copy_s` of operand copies) and
        its share of HBM bandwidth."""
        if rows not in self._gemm:
            piece = self.pair.gemm.piece(self.pair.axis, max(rows, 1), "p")
            c = gemm_cost(piece, self.cluster)
            self._gemm[rows] = (c.duration, c.uses["hbm"])
        t, hbm = self._gemm[rows]
        return t + copy_s, hbm

    def copies(self, chunk: float, steps: int) -> tuple[list[list[int]], list[_Item]]:
        if (chunk, steps) not in self._copies:
            self._copies[chunk, steps] = _dma_copies(self.pair, self.cluster, chunk, steps)
        return self._copies[chunk, steps]


def _reason(pair: OverlapPair, cluster: ClusterSpec, best: tuple[Schedule, float],
            runner_up: tuple[Schedule, float] | None, g_whole: float,
            seq: dict[Engine, float]) -> str:
    s, est = best
    comm = min(seq.values()) - g_whole
    ratio = g_whole / comm if comm > 0 else math.inf
    head = (f"GEMM {g_whole * 1e6:,.0f} us vs transfer {comm * 1e6:,.0f} us "
            f"(x{ratio:.2f}) on {pair.ranks} ranks, {cluster.topology.kind}")
    nxt = "" if runner_up is None else (
        f"; next best {runner_up[0]} est. {runner_up[1] * 1e6:,.0f} us "
        f"(+{runner_up[1] / est - 1:.1%})")
    if s.comm is CommPattern.SEQ:
        return (f"{head}: no overlap beats sequential (piece and step overheads exceed the "
                f"{min(g_whole, comm) * 1e6:,.0f} us it could hide); {s.engine} moves it "
                f"faster{nxt}")
    how = "one peer per step" if s.comm is CommPattern.P2P else \
        f"{s.chunks} sub-chunk step(s) with all peers at once"
    eng = ("copy engines: no compute units taken, command overhead amortized"
           if s.engine is Engine.DMA else
           "collective kernels: cheaper than per-peer copy commands here")
    gain = seq[Engine.SM] / est if est > 0 else 1.0
    return f"{head}: {how}; {eng}; est. {est * 1e6:,.0f} us (x{gain:.2f} vs seq/sm){nxt}"
