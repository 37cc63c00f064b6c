"""Cost a lowered pair schedule into simulator tasks and simulate it.

This is where the plan meets the cost model: each `Compute` becomes a GEMM piece timed by
`plait.cost.gemm`, each `Transfer` a collective kernel or copy command timed by
`plait.cost.comm`, each `Reduce` a memory-bound kernel; contention parameters come from
`plait.cost.contention`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from plait.cost import contention
from plait.cost.comm import collective_time, dma_copy, elementwise_time, route, sm_exchange
from plait.cost.gemm import gemm_cost
from plait.cost.resources import Cost
from plait.errors import InfeasibleError
from plait.schedule.lower import Compute, PlanOp, Reduce, Transfer, copied_blocks, lower
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.engine import (
    Span,
    Task,
    Timeline,
    folded_makespan,
    simulate,
    uncontended_makespan,
)
from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.hardware import ClusterSpec
from plait.workload.ops import Axis, CollectiveKind, Gemm, OverlapPair

COMPUTE_STREAM = "compute"
COMM_STREAM = "comm"


def check_feasible(pair: OverlapPair, s: Schedule) -> None:
    """Raise `InfeasibleError` when `s` cannot run on `pair`, saying why."""
    if s.axis is not pair.axis and s.comm is not CommPattern.SEQ:
        raise InfeasibleError(f"{s}: pair {pair.name} gathers/scatters GEMM dimension "
                              f"{pair.axis}, not {s.axis}")
    if pair.ranks == 1 and s.comm is not CommPattern.SEQ:
        raise InfeasibleError(f"{s}: a group of one rank has nothing to overlap")
    if pair.axis.value == "K" and pair.direction == "out":
        raise InfeasibleError(f"{s}: a K split cannot feed a reduce-scatter")
    blocks = pair.ranks * s.steps
    if pair.split_extent % blocks:
        raise InfeasibleError(f"{s}: {pair.axis}={pair.split_extent} of {pair.name} does not "
                              f"split into {pair.ranks} shards x {blocks // pair.ranks} "
                              "sub-chunks")


class PairCosts:
    """Costs of the pieces of one pair on one cluster, memoized across its schedules."""

    def __init__(self, pair: OverlapPair, cluster: ClusterSpec) -> None:
        self.pair, self.cluster = pair, cluster
        self.compute_slowdowns = contention.compute_slowdowns(cluster)
        self.sm_slowdowns = contention.comm_slowdowns(cluster, contention.SM_COMM)
        self.dma_slowdowns = contention.comm_slowdowns(cluster, contention.DMA)
        self._memo: dict[tuple[object, ...], Cost] = {}
        self._tasks: dict[tuple[object, ...], tuple[float, Cost]] = {}
        self.routes = route_kinds(pair, cluster)
        self.collective_s = self._fastest_collective()

    def _fastest_collective(self) -> float:
        """The whole collective alone on its faster engine (library kernels or copy engines)."""
        best = collective_time(self.pair.collective, self.cluster)
        if self.pair.ranks > 1:
            best = min(best, pair_makespan(self.pair, Schedule(CommPattern.SEQ, Engine.DMA),
                                           self.cluster, self, only=contention.DMA))
        return best

    def gemm(self, piece: Gemm) -> Cost:
        key = ("gemm", piece.m, piece.k, piece.accumulate)
        if key not in self._memo:
            self._memo[key] = gemm_cost(piece, self.cluster)
        return self._memo[key]

    def transfer(self, engine: Engine, peers: tuple[int, ...], nbytes: float,
                 reduce: bool = False) -> Cost:
        key = (engine, peers, nbytes, reduce)
        if key not in self._memo:
            stride = self.pair.collective.stride
            self._memo[key] = (sm_exchange(self.cluster, list(peers), nbytes, stride,
                                           reduce=reduce)
                               if engine is Engine.SM
                               else dma_copy(self.cluster, peers[0], nbytes, stride))
        return self._memo[key]

    def task(self, shape: TaskShape, s: Schedule) -> tuple[float, Cost]:
        """The standalone seconds and resource use of `shape` in schedule `s` (memoized: equal
        pieces, copies and reductions cost the same in every schedule)."""
        key = (s.steps, *shape.cost)
        if key not in self._tasks:
            self._tasks[key] = self._cost(shape, s)
        return self._tasks[key]

    def _cost(self, shape: TaskShape, s: Schedule) -> tuple[float, Cost]:
        pair, cluster = self.pair, self.cluster
        op = shape.op
        block_bytes = pair.collective.bytes / (pair.ranks * s.steps)
        if isinstance(op, Compute):
            c = self.gemm(_piece(pair, s, op))
            return piece_copy_time(pair, cluster, op, s), c
        if isinstance(op, Reduce):
            nbytes = (op.parts + 1) * block_bytes * len(op.blocks)
            return 0.0, Cost(elementwise_time(nbytes, cluster), {"compute": 1.0, "hbm": 1.0})
        assert isinstance(op, Transfer)
        return 0.0, self.transfer(op.engine, op.peers, block_bytes, op.reduce)


@dataclass(frozen=True, slots=True)
class TaskShape:
    """A task of a lowered schedule before its costs: the plan op, the stream it queues on, what
    it waits for, and the key under which tasks cost the same (`PairCosts.task`)."""

    op: PlanOp
    stream: str
    category: str
    cost: tuple[object, ...]


@functools.lru_cache(maxsize=8192)
def task_shapes(s: Schedule, ranks: int, direction: str, reduces: bool, axis: Axis,
                dma_engines: int) -> tuple[TaskShape, ...]:
    """`lower(s, ...)`'s ops as the streams and categories they run on: GEMM pieces and
    reductions on the compute stream, collective kernels on `comm`, copy commands on
    `dma<e>` (shard-level P2P on one queue, one peer per step; otherwise peer i on engine
    (i - 1) mod engines). One definition for the simulator and the heuristics, cached: it
    depends on the schedule and the group, not on the sizes."""
    shapes = []
    for op in lower(s, ranks, direction, reduces):
        if isinstance(op, Compute):
            cin, cout = copied_blocks(op, s, ranks, direction, axis)
            first = op.first or axis is not Axis.K
            shapes.append(TaskShape(op, COMPUTE_STREAM, contention.COMPUTE,
                                    ("gemm", len(op.blocks), first, cin, cout)))
        elif isinstance(op, Reduce):
            shapes.append(TaskShape(op, COMPUTE_STREAM, contention.COMPUTE,
                                    ("reduce", op.parts, len(op.blocks))))
        elif op.engine is Engine.SM:
            shapes.append(TaskShape(op, COMM_STREAM, contention.SM_COMM,
                                    ("sm", op.peers, op.reduce)))
        else:
            engine = 0 if s.comm is CommPattern.P2P else (op.peers[0] - 1) % dma_engines
            shapes.append(TaskShape(op, f"dma{engine}", contention.DMA, ("dma", op.peers)))
    return tuple(shapes)


@dataclass(frozen=True, slots=True)
class FoldedShapes:
    """`task_shapes` with symmetric copy-engine queues folded into one: queues whose tasks cost
    the same (their peers sit behind the same kind of route) and wait for the same tasks
    progress identically, so one stands for `mult` of them. `tasks`: the representatives with
    their multiplicity, in order; `work`: per remaining stream, one shape per cost key and how
    many of its tasks have that key (a lower bound sums them)."""

    tasks: tuple[tuple[TaskShape, int], ...]
    work: tuple[tuple[tuple[TaskShape, int], ...], ...]


@functools.lru_cache(maxsize=8192)
def folded_shapes(s: Schedule, ranks: int, direction: str, reduces: bool, axis: Axis,
                  dma_engines: int, routes: tuple[str, ...]) -> FoldedShapes:
    """`routes[i]`: the kind of route to peer i + 1 (`route_kinds`)."""
    shapes = task_shapes(s, ranks, direction, reduces, axis, dma_engines)
    streams: dict[str, list[TaskShape]] = {}
    for sh in shapes:
        streams.setdefault(sh.stream, []).append(sh)

    def like(sh: TaskShape) -> tuple[object, ...]:
        if isinstance(sh.op, Transfer) and sh.category == contention.DMA:
            return ("dma", routes[sh.op.peers[0] - 1], sh.op.deps)
        return (sh.cost, sh.op.deps)

    groups: dict[tuple[object, ...], list[str]] = {}
    for name, queue in streams.items():
        groups.setdefault(tuple(like(sh) for sh in queue), []).append(name)
    alias: dict[str, str] = {}
    mult: dict[str, int] = {}
    for names in groups.values():
        for k, sh in enumerate(streams[names[0]]):
            mult[sh.op.name] = len(names)
            for n in names:
                alias[streams[n][k].op.name] = sh.op.name
    kept = {names[0] for names in groups.values()}
    tasks = []
    for sh in shapes:
        if sh.stream in kept:
            deps = tuple(dict.fromkeys(alias[d] for d in sh.op.deps))
            if deps != sh.op.deps:
                sh = replace(sh, op=replace(sh.op, deps=deps))
            tasks.append((sh, mult[sh.op.name]))
    work = []
    for name in kept:
        keys: dict[tuple[object, ...], list[TaskShape]] = {}
        for sh in streams[name]:
            keys.setdefault(sh.cost, []).append(sh)
        work.append(tuple((same[0], len(same)) for same in keys.values()))
    return FoldedShapes(tuple(tasks), tuple(work))


def route_kinds(pair: OverlapPair, cluster: ClusterSpec) -> tuple[str, ...]:
    """The kind of route to each peer (a mesh peer's own link, a switch port, the NIC)."""
    kinds = []
    for peer in range(1, pair.ranks):
        r = route(cluster, peer, pair.collective.stride).resource
        kinds.append("link" if r.startswith("link") else r)
    return tuple(kinds)


def _folded(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, costs: PairCosts
            ) -> FoldedShapes:
    return folded_shapes(s, pair.ranks, pair.direction, pair.reduces, pair.axis,
                         cluster.gpu.dma.engines, costs.routes)


def pair_bound(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, costs: PairCosts
               ) -> float:
    """A lower bound on `pair_makespan`: the busiest stream's work alone at full speed
    (contention only slows a task; the layout copies run on the compute stream)."""
    before, after = layout_copy_time(pair, cluster, s)
    bound = 0.0
    for stream in _folded(pair, s, cluster, costs).work:
        total = 0.0
        for sh, n in stream:
            copy_s, c = costs.task(sh, s)
            total += n * (c.duration + copy_s)
        if stream[0][0].category == contention.COMPUTE:
            total += before + after
        bound = max(bound, total)
    return bound


def pair_makespan(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, costs: PairCosts,
                  above: float = math.inf, only: str | None = None) -> float:
    """The simulated time of schedule `s` on `pair`, as `simulate_pair(...).time_s`, from the
    folded tasks: what the heuristics estimate a candidate with. When even the uncontended
    time of the tasks exceeds `above`, that bound is returned instead (no need to simulate
    what cannot win). `only`: just the tasks of that category, all started at once (the
    transfers of a schedule alone)."""
    if above < math.inf and (floor := pair_bound(pair, s, cluster, costs)) > above:
        return floor
    slowdowns = {contention.COMPUTE: costs.compute_slowdowns,
                 contention.SM_COMM: costs.sm_slowdowns, contention.DMA: costs.dma_slowdowns}
    tasks, mult, private = [], {}, set()
    for sh, m in _folded(pair, s, cluster, costs).tasks:
        if only is not None and sh.category != only:
            continue
        copy_s, c = costs.task(sh, s)
        name = sh.op.name
        tasks.append(Task(name, sh.stream, c.duration + copy_s, sh.category,
                          sh.op.deps if only is None else (), c.uses, c.reserves,
                          slowdowns[sh.category]))
        if m > 1:
            mult[name] = m
            private |= {(name, r) for r in c.uses if r.startswith("link")}  # a peer's own
    before, after = layout_copy_time(pair, cluster, s) if only is None else (0.0, 0.0)
    if before:
        tasks = [_layout_task("reorder.in", before, (), costs),
                 *(replace(t, deps=t.deps or ("reorder.in",)) for t in tasks)]
    if after:
        tasks.append(_layout_task("reorder.out", after, tuple(t.name for t in tasks), costs))
    if above < math.inf and (floor := uncontended_makespan(tasks)) > above:
        return floor
    return folded_makespan(tasks, mult, private)


def _piece(pair: OverlapPair, s: Schedule, op: Compute) -> Gemm:
    """The GEMM piece that Compute `op` runs (a K split's first piece writes, the others add)."""
    extent = pair.split_extent // (pair.ranks * s.steps)
    piece = pair.gemm.piece(pair.axis, extent * len(op.blocks), op.name)
    if pair.axis is Axis.K and op.first:
        return Gemm(piece.name, piece.m, piece.n, piece.k, piece.dtype, piece.count)
    return piece


def piece_copy_time(pair: OverlapPair, cluster: ClusterSpec, op: Compute, s: Schedule
                    ) -> float:
    """Seconds the runtime spends copying the operand and output blocks of piece `op` that it
    cannot use in place (see `copied_blocks`), as a memory-bound kernel."""
    cin, cout = copied_blocks(op, s, pair.ranks, pair.direction, pair.axis)
    if not (cin or cout):
        return 0.0
    g = pair.gemm
    extent = pair.split_extent // (pair.ranks * s.steps)
    width_in = g.k if pair.axis is Axis.M else g.m + g.n  # K split: columns + weight rows
    nbytes = (cin * width_in + cout * g.n) * extent * DTYPE_BYTES[g.dtype]
    return elementwise_time(2 * nbytes, cluster)  # read and write


def layout_copy_time(pair: OverlapPair, cluster: ClusterSpec, s: Schedule
                     ) -> tuple[float, float]:
    """Seconds of the copies the expert-parallel ops and executors make around the pieces, as
    (before the first piece, after the last); with c > 1 sub-chunks only:

    - E > 1 local experts: rows ordered (rank, expert, slot) become (rank, sub-chunk, expert,
      slot) so that every block holds its expert groups, and back (`plait.ops`): the input
      before, the outputs after (a dispatch's received tokens too);
    - the collective-kernel all-to-all of a finer-grain schedule packs each step's blocks into
      one send buffer (`plait.runtime.execute`): a dispatch packs every step as it issues them
      all, before the first piece; a combine packs each step's partials and copies what it
      received back into the output rows (counted after the last piece).
    """
    g = pair.gemm
    if s.steps == 1 or pair.collective.kind is not CollectiveKind.A2A:
        return 0.0, 0.0
    row = g.count * g.m * DTYPE_BYTES[g.dtype]  # bytes per column over every expert's rows
    before = after = 0.0  # columns copied
    if g.count > 1:
        before += g.k
        after += g.n + (g.k if pair.direction == "in" else 0)
    if s.engine is Engine.SM and s.comm is CommPattern.FINE:
        if pair.direction == "in":
            before += g.k
        else:
            after += 2 * g.n
    return (elementwise_time(2 * row * before, cluster) if before else 0.0,
            elementwise_time(2 * row * after, cluster) if after else 0.0)


def pair_tasks(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
               costs: PairCosts | None = None) -> list[Task]:
    """The simulator tasks of schedule `s` on `pair`: `task_shapes` costed by the cost model,
    and the layout copies of expert-parallel pairs around them."""
    check_feasible(pair, s)
    costs = costs or PairCosts(pair, cluster)
    slowdowns = {contention.COMPUTE: costs.compute_slowdowns,
                 contention.SM_COMM: costs.sm_slowdowns, contention.DMA: costs.dma_slowdowns}
    tasks = []
    for sh in task_shapes(s, pair.ranks, pair.direction, pair.reduces, pair.axis,
                          cluster.gpu.dma.engines):
        copy_s, c = costs.task(sh, s)
        tasks.append(Task(sh.op.name, sh.stream, c.duration + copy_s, sh.category, sh.op.deps,
                          uses=c.uses, reserves=c.reserves, slowdowns=slowdowns[sh.category],
                          label=sh.op.name, args={"op": sh.op, **_detail(pair, s, sh, copy_s)}))
    before, after = layout_copy_time(pair, cluster, s)
    if before:  # everything starts from the reordered input
        tasks = [_layout_task("reorder.in", before, (), costs),
                 *(replace(t, deps=t.deps or ("reorder.in",)) for t in tasks)]
    if after:
        tasks.append(_layout_task("reorder.out", after, tuple(t.name for t in tasks), costs))
    return tasks


def _detail(pair: OverlapPair, s: Schedule, sh: TaskShape, copy_s: float) -> dict[str, object]:
    """What a trace shows of a task beside its plan op."""
    op = sh.op
    block_bytes = pair.collective.bytes / (pair.ranks * s.steps)
    if isinstance(op, Compute):
        g = _piece(pair, s, op)
        return {"m": g.m, "n": g.n, "k": g.k, **({"copy_us": copy_s * 1e6} if copy_s else {})}
    if isinstance(op, Reduce):
        return {"bytes": (op.parts + 1) * block_bytes * len(op.blocks)}
    return {"bytes_per_peer" if sh.category == contention.SM_COMM else "bytes": block_bytes}


def _layout_task(name: str, seconds: float, deps: tuple[str, ...], costs: PairCosts) -> Task:
    return Task(name, COMPUTE_STREAM, seconds, contention.COMPUTE, deps,
                uses={"compute": 1.0, "hbm": 1.0}, slowdowns=costs.compute_slowdowns,
                label=name)


@dataclass(frozen=True, slots=True)
class PairRun:
    """A simulated schedule of one pair and the losses it reveals."""

    pair: OverlapPair
    schedule: Schedule
    timeline: Timeline
    gemm_whole_s: float  # the undecomposed GEMM alone
    comm_whole_s: float  # the undecomposed collective alone, on its faster engine

    @property
    def time_s(self) -> float:
        return self.timeline.makespan

    @property
    def ideal_s(self) -> float:
        """Perfect overlap, no losses: the longer of compute and communication."""
        return max(self.gemm_whole_s, self.comm_whole_s)

    def _gemm_spans(self) -> list[Span]:
        return [sp for sp in self.timeline.spans if isinstance(sp.task.args.get("op"), Compute)]

    @property
    def decomposition_loss(self) -> float:
        """Extra standalone GEMM time of the pieces over the whole, as a fraction of the whole."""
        pieces = sum(sp.task.duration for sp in self._gemm_spans())
        return pieces / self.gemm_whole_s - 1.0

    @property
    def contention_loss(self) -> float:
        """Extra GEMM time spent slowed by concurrent communication, fraction of the whole."""
        slowed = sum(sp.duration - sp.task.duration for sp in self._gemm_spans())
        return max(0.0, slowed) / self.gemm_whole_s

    @property
    def exposed_comm_s(self) -> float:
        return self.timeline.exposed()


def simulate_pair(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
                  costs: PairCosts | None = None) -> PairRun:
    costs = costs or PairCosts(pair, cluster)
    tasks = pair_tasks(pair, s, cluster, costs)
    return PairRun(
        pair, s, simulate(tasks),
        costs.gemm(pair.gemm).duration, costs.collective_s)
