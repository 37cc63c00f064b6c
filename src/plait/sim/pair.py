"""Cost a lowered pair schedule into simulator tasks and simulate it.

This is where the plan meets the cost model: each `Compute` becomes a GEMM piece timed by
`plait.cost.gemm`, each `Transfer` a collective kernel or copy command timed by
`plait.cost.comm`, each `Reduce` a memory-bound kernel; contention parameters come from
`plait.cost.contention`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.cost import contention
from plait.cost.comm import collective_time, dma_copy, elementwise_time, sm_exchange
from plait.cost.gemm import gemm_cost
from plait.cost.resources import Cost
from plait.errors import InfeasibleError
from plait.schedule.lower import Compute, PlanOp, Reduce, Transfer, copied_blocks, lower
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.engine import Span, Task, Timeline, simulate
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
        self.collective_s = self._fastest_collective()

    def _fastest_collective(self) -> float:
        """The whole collective alone on its faster engine (library kernels or copy engines)."""
        best = collective_time(self.pair.collective, self.cluster)
        if self.pair.ranks > 1:
            dma = Schedule(CommPattern.SEQ, Engine.DMA)
            ops = lower(dma, self.pair.ranks, self.pair.direction, reduces=False)
            xs = [replace(_task(op, dma, self), deps=()) for op in ops if isinstance(op, Transfer)]
            best = min(best, simulate(xs).makespan)
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
               costs: PairCosts | None = None, ops: tuple[PlanOp, ...] | None = None
               ) -> list[Task]:
    """The simulator tasks of schedule `s` on `pair` (`ops`: its lowering, if at hand)."""
    check_feasible(pair, s)
    costs = costs or PairCosts(pair, cluster)
    if ops is None:
        ops = lower(s, pair.ranks, pair.direction, pair.reduces)
    tasks = [_task(op, s, costs) for op in ops]
    before, after = layout_copy_time(pair, cluster, s)
    if before:  # everything starts from the reordered input
        tasks = [_layout_task("reorder.in", before, (), costs),
                 *(replace(t, deps=t.deps or ("reorder.in",)) for t in tasks)]
    if after:
        tasks.append(_layout_task("reorder.out", after, tuple(t.name for t in tasks), costs))
    return tasks


def _layout_task(name: str, seconds: float, deps: tuple[str, ...], costs: PairCosts) -> Task:
    return Task(name, COMPUTE_STREAM, seconds, contention.COMPUTE, deps,
                uses={"compute": 1.0, "hbm": 1.0}, slowdowns=costs.compute_slowdowns,
                label=name)


def _task(op: PlanOp, s: Schedule, costs: PairCosts) -> Task:
    pair, cluster = costs.pair, costs.cluster
    p = pair.ranks
    steps = s.steps
    block_bytes = pair.collective.bytes / (p * steps)
    block_extent = pair.split_extent // (p * steps)
    args = {"op": op}  # the plan op this task carries out (shown in traces)
    if isinstance(op, Compute):
        piece = pair.gemm.piece(pair.axis, block_extent * len(op.blocks), op.name)
        if pair.axis.value == "K" and op.first:
            piece = Gemm(piece.name, piece.m, piece.n, piece.k, piece.dtype, piece.count)
        c = costs.gemm(piece)
        copy_s = piece_copy_time(pair, cluster, op, s)
        return Task(op.name, COMPUTE_STREAM, c.duration + copy_s, contention.COMPUTE, op.deps,
                    uses=c.uses, slowdowns=costs.compute_slowdowns, label=op.name,
                    args={**args, "m": piece.m, "n": piece.n, "k": piece.k,
                          **({"copy_us": copy_s * 1e6} if copy_s else {})})
    if isinstance(op, Reduce):
        nbytes = (op.parts + 1) * block_bytes * len(op.blocks)
        t = elementwise_time(nbytes, cluster)
        return Task(op.name, COMPUTE_STREAM, t, contention.COMPUTE, op.deps,
                    uses={"compute": 1.0, "hbm": 1.0}, slowdowns=costs.compute_slowdowns,
                    label=op.name, args={**args, "bytes": nbytes})
    assert isinstance(op, Transfer)
    c = costs.transfer(op.engine, op.peers, block_bytes, op.reduce)
    if op.engine is Engine.SM:
        return Task(op.name, COMM_STREAM, c.duration, contention.SM_COMM, op.deps,
                    uses=c.uses, reserves=c.reserves, slowdowns=costs.sm_slowdowns,
                    label=op.name, args={**args, "bytes_per_peer": block_bytes})
    # Shard-level P2P moves one peer per step: one queue. Otherwise peers spread over engines.
    peer = op.peers[0]
    engine = 0 if s.comm is CommPattern.P2P else (peer - 1) % cluster.gpu.dma.engines
    return Task(op.name, f"dma{engine}", c.duration, contention.DMA, op.deps, uses=c.uses,
                slowdowns=costs.dma_slowdowns, label=op.name,
                args={**args, "bytes": block_bytes})


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
                  costs: PairCosts | None = None, ops: tuple[PlanOp, ...] | None = None
                  ) -> PairRun:
    costs = costs or PairCosts(pair, cluster)
    tasks = pair_tasks(pair, s, cluster, costs, ops)
    return PairRun(
        pair, s, simulate(tasks),
        costs.gemm(pair.gemm).duration, costs.collective_s)
