"""Cost a lowered pair schedule into simulator tasks and simulate it.

This is where the plan meets the cost model: each `Compute` becomes a GEMM piece timed by
`plait.cost.gemm`, each `Transfer` a collective kernel or copy command timed by
`plait.cost.comm`, each `Reduce` a memory-bound kernel; contention parameters come from
`plait.cost.contention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, cast

from plait.cost import contention
from plait.cost.comm import collective_time, dma_copy, elementwise_time, route, sm_exchange
from plait.cost.gemm import gemm_cost
from plait.cost.host import PLAIT, Executor, host_use
from plait.cost.resources import Cost
from plait.errors import InfeasibleError
from plait.schedule.lower import Compute, PlanOp, Reduce, Transfer, copied_blocks, lower
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.sim.engine import (
    Graph,
    Share,
    Task,
    Timeline,
    class_rates,
    critical_path,
    exposed,
    graph,
    run_graph,
    share,
    simulate,
)
from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Axis, CollectiveKind, Gemm, OverlapPair

COMPUTE_STREAM = "compute"
COMM_STREAM = "comm"
LAYOUT_USES = {"compute": 1.0, "hbm": 1.0}  # the layout copies: memory-bound kernels


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
    """Costs of the pieces of one pair on one cluster, memoized across its schedules, as
    `executor` issues them (`plait.cost.host`: plait's runtime unless said otherwise)."""

    def __init__(self, pair: OverlapPair, cluster: ClusterSpec,
                 executor: Executor = PLAIT) -> None:
        self.pair, self.cluster, self.executor = pair, cluster, executor
        self._ranks, self._extent = pair.ranks, pair.split_extent
        self.slowdowns = contention.slowdowns(cluster)
        self._memo: dict[tuple[object, ...], Cost] = {}
        self._tasks: dict[tuple[int, tuple[object, ...]], tuple[float, Cost]] = {}
        self._classes: dict[tuple[object, ...], int] = {}
        self._members: list[Share] = []  # the rate classes, by number
        self._shares: dict[Share, int] = {}  # their numbers
        self._rates: dict[tuple[int, ...], tuple[float, ...]] = {}
        self.routes = route_kinds(pair, cluster)
        self.collective_s = self._fastest_collective()

    def _fastest_collective(self) -> float:
        """The whole collective alone on its faster engine (library kernels or copy engines)."""
        best = collective_time(self.pair.collective, self.cluster)
        if self.pair.ranks > 1:
            best = min(best, pair_makespan(self.pair, Schedule(CommPattern.SEQ, Engine.DMA),
                                           self.cluster, self, only=contention.DMA))
        return best

    def piece(self, rows: int, first: bool = True) -> Cost:
        """The GEMM over `rows` of the split dimension (`piece_gemm`), memoized: pieces of
        equal extent cost the same in any schedule."""
        key = ("piece", rows, first)
        if key not in self._memo:
            self._memo[key] = gemm_cost(piece_gemm(self.pair, rows, first), self.cluster)
        return self._memo[key]

    def whole(self) -> Cost:
        """The undecomposed GEMM."""
        return self.piece(self._extent)

    def transfer(self, engine: Engine, peers: tuple[int, ...], nbytes: float,
                 reduce: bool = False) -> Cost:
        key = (engine, peers, nbytes, reduce)
        if key not in self._memo:
            stride = self.pair.collective.stride
            direct = self.pair.collective.kind is CollectiveKind.A2A  # NCCL: rings but A2A
            self._memo[key] = (sm_exchange(self.cluster, list(peers), nbytes, stride,
                                           reduce=reduce, ring=0 if direct else None)
                               if engine is Engine.SM
                               else dma_copy(self.cluster, peers[0], nbytes, stride))
        return self._memo[key]

    def task(self, shape: TaskShape, steps: int) -> tuple[float, Cost]:
        """The standalone seconds a task of `shape` copies for, and the cost of its kernel or
        command, in a schedule of `steps` sub-chunks per shard (memoized: equal pieces,
        copies and reductions cost the same in every schedule)."""
        key = (steps, shape.cost)
        if key not in self._tasks:
            self._tasks[key] = self._cost(shape, steps)
        return self._tasks[key]

    def seconds(self, shape: TaskShape, steps: int) -> float:
        """The standalone seconds of a task of `shape` (its copies and its kernel)."""
        copy_s, c = self.task(shape, steps)
        return c.duration + copy_s

    def rate_class(self, shape: TaskShape | str, steps: int, mult: int, seconds: float
                   ) -> int:
        """The number, in this pair, of tasks that run at equal rates in equal company: those
        of one cost (a program's layout copies: `shape` is their name) and multiplicity."""
        key = (shape, mult) if isinstance(shape, str) else (steps, shape.cost, mult)
        if key not in self._classes:
            if isinstance(shape, str):
                category, uses, reserves = contention.COMPUTE, LAYOUT_USES, {}
            else:
                category, (_, c) = shape.category, self.task(shape, steps)
                uses, reserves = c.uses, c.reserves
            own = [r for r in uses if r.startswith("link")] if mult > 1 else []
            member = share(category, seconds, uses, reserves, self.slowdowns[category], mult,
                           own)  # a peer's own link is not shared
            # Tasks of equal claims run at equal rates, whatever their cost key (a copy to any
            # peer behind the same switch port): one class, so rates are worked out once.
            if member not in self._shares:
                self._shares[member] = len(self._members)
                self._members.append(member)
            self._classes[key] = self._shares[member]
        return self._classes[key]

    def rates(self, classes: tuple[int, ...]) -> tuple[float, ...]:
        """The rates of tasks of `classes` running together (`rate_class`), memoized."""
        if classes not in self._rates:
            self._rates[classes] = class_rates([self._members[c] for c in classes])
        return self._rates[classes]

    def _cost(self, shape: TaskShape, steps: int) -> tuple[float, Cost]:
        """The device cost of a task of `shape`, issued by the host (`host_use`)."""
        pair, cluster, ex = self.pair, self.cluster, self.executor
        op = shape.op
        if isinstance(op, Compute):
            _, blocks, first, cin, cout = cast(tuple[str, int, bool, int, int], shape.cost)
            piece = self.piece(self._extent // (self._ranks * steps) * blocks, first)
            copies = piece_copy_time(pair, cluster, steps, cin, cout) if cin or cout else 0.0
            return copies, host_use(piece, ex.compute * cluster.params.host_call_s, copies)
        block_bytes = pair.collective.bytes / (self._ranks * steps)
        if isinstance(op, Reduce):
            nbytes = (op.parts + 1) * block_bytes * len(op.blocks)
            return 0.0, host_use(Cost(elementwise_time(nbytes, cluster),
                                      {"compute": 1.0, "hbm": 1.0}),
                                 ex.reduce * cluster.params.host_call_s)
        assert isinstance(op, Transfer)
        calls = (ex.collective if op.engine is Engine.SM else
                 ex.copy_in if pair.direction == "in" else ex.copy_out)
        return 0.0, host_use(self.transfer(op.engine, op.peers, block_bytes, op.reduce),
                             calls * cluster.params.host_call_s)


class TaskShape(NamedTuple):
    """A task of a lowered schedule before its costs: the plan op, the stream it queues on, what
    it waits for, and the key under which tasks cost the same (`PairCosts.task`). A named tuple:
    lowering a large group makes tens of thousands of them."""

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
    queues = [f"dma{e}" for e in range(dma_engines)]
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
            shapes.append(TaskShape(op, queues[engine], contention.DMA, ("dma", op.peers)))
    return tuple(shapes)


@functools.lru_cache(maxsize=8192)
def folded_shapes(s: Schedule, ranks: int, direction: str, reduces: bool, axis: Axis,
                  dma_engines: int, routes: tuple[str, ...]
                  ) -> tuple[tuple[TaskShape, int, tuple[str, ...]], ...]:
    """`task_shapes` with symmetric copy-engine queues folded into one: queues whose tasks cost
    the same (their peers sit behind the same kind of route) and wait for the same tasks
    progress identically, so one stands for `mult` of them. The representatives with their
    multiplicity and what they wait for (the representatives of their dependencies), in order;
    `routes[i]`: the kind of route to peer i + 1 (`route_kinds`)."""
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
    alias: dict[str, str] = {}  # a folded task -> its representative
    mult: dict[str, int] = {}  # a representative of several -> how many
    for names in groups.values():
        if len(names) > 1:
            rep = streams[names[0]]
            for sh in rep:
                mult[sh.op.name] = len(names)
            for n in names[1:]:
                for sh, other in zip(rep, streams[n], strict=True):
                    alias[other.op.name] = sh.op.name
    kept = {names[0] for names in groups.values()}
    return tuple((sh, mult.get(sh.op.name, 1),
                  tuple(dict.fromkeys(alias.get(d, d) for d in sh.op.deps)) if alias
                  else sh.op.deps)
                 for sh in shapes if sh.stream in kept)


def route_kinds(pair: OverlapPair, cluster: ClusterSpec) -> tuple[str, ...]:
    """The kind of route to each peer (a mesh peer's own link, a switch port, the NIC);
    memoized per cluster."""
    def build() -> tuple[str, ...]:
        names = (route(cluster, peer, pair.collective.stride).resource
                 for peer in range(1, pair.ranks))
        return tuple("link" if r.startswith("link") else r for r in names)

    return cluster.cached(("route_kinds", pair.ranks, pair.collective.stride), build)


LAYOUT_IN, LAYOUT_OUT = "reorder.in", "reorder.out"


def with_layout_copies(deps: list[tuple[str, tuple[str, ...]]], before: bool, after: bool
                       ) -> list[tuple[str, tuple[str, ...]]]:
    """(name, dependencies) of a pair's tasks, in order, with the layout copies around them
    (`layout_copy_time`): `before`, `LAYOUT_IN` first and every task without dependencies
    waiting for it; `after`, `LAYOUT_OUT` last, waiting for every task. The one rule for the
    simulator's tasks (`pair_tasks`) and the heuristics' programs (`program`)."""
    if before:
        deps = [(LAYOUT_IN, ()), *((n, d or (LAYOUT_IN,)) for n, d in deps)]
    if after:
        deps = [*deps, (LAYOUT_OUT, tuple(n for n, _ in deps))]
    return deps


@dataclass(frozen=True, slots=True)
class Program:
    """`folded_shapes` as the index arrays `run_graph` takes, with the layout copies of
    `pair_tasks` around them: what `pair_makespan` evaluates. Sizes enter only through the
    durations of `shapes` (one per cost key; `LAYOUT_IN`/`LAYOUT_OUT` for the copies), so one
    program serves every pair of its structure."""

    shapes: tuple[TaskShape | str, ...]
    shape: tuple[int, ...]  # per task: its entry of `shapes`
    count: tuple[int, ...]  # per task: the back-to-back tasks of its shape it stands for
    graph: Graph  # the tasks' streams and dependencies
    work: tuple[tuple[tuple[int, int], ...], ...]  # per stream: (shape, how many tasks)
    kinds: tuple[tuple[int, int], ...]  # the distinct (shape, mult): tasks of one kind run
    kind: tuple[int, ...]  # per task: its kind               # at equal rates

    def durations(self, seconds: Sequence[float]) -> list[float]:
        """Each task's standalone seconds, from the seconds of each of `shapes`."""
        return [seconds[k] * c if c > 1 else seconds[k]
                for k, c in zip(self.shape, self.count, strict=True)]


def back_to_back(streams: Sequence[int], shape: Sequence[int], mult: Sequence[int],
                 deps: Sequence[Sequence[int]]) -> list[list[int]]:
    """Tasks (in order, dependencies earlier) grouped into runs that simulate as one task:
    consecutive on one stream, of one shape and multiplicity (so one rate class), each ready
    once the one before it ends (its dependencies are the run's, or the run's own tasks) and
    needed by nothing that does not also wait for the next. Such a run keeps its stream busy
    at one rate from its first start to its last end, and no other task can start inside it,
    so one task of their summed time is the same simulation (up to rounding). The peers of a
    finer-grain step collapse this way: the pieces of one step that wait for one collective
    kernel, the copies of one step on one copy engine to peers behind the same route."""
    dependents: list[set[int]] = [set() for _ in shape]
    for i, ds in enumerate(deps):
        for d in ds:
            dependents[d].add(i)
    runs: list[list[int]] = []
    needs: list[set[int]] = []  # per run: what its tasks wait for, and its tasks
    last: dict[int, int] = {}  # stream -> its latest run
    for i, st in enumerate(streams):
        r = last.get(st)
        if r is not None:
            a = runs[r][-1]
            da, di = dependents[a], dependents[i]
            if (shape[a] == shape[i] and mult[a] == mult[i]
                    and (da <= di or (i in da and da - {i} <= di))
                    and needs[r].issuperset(deps[i])):
                runs[r].append(i)
                needs[r].add(i)
                needs[r].update(deps[i])
                continue
        last[st] = len(runs)
        runs.append([i])
        needs.append({i, *deps[i]})
    return runs


@functools.lru_cache(maxsize=8192)
def program(s: Schedule, ranks: int, direction: str, reduces: bool, axis: Axis,
            dma_engines: int, routes: tuple[str, ...], layout: tuple[bool, bool],
            only: str | None = None) -> Program:
    """The program of `s`; `layout`: whether the copies before and after the pieces run;
    `only`: just the tasks of that category, all started at once."""
    folded = folded_shapes(s, ranks, direction, reduces, axis, dma_engines, routes)
    kept = [(sh, m, deps) for sh, m, deps in folded if only is None or sh.category == only]
    before, after = layout if only is None else (False, False)
    by_name: dict[str, tuple[TaskShape | str, int, str]] = {
        sh.op.name: (sh, m, sh.stream) for sh, m, _ in kept}
    by_name |= {c: (c, 1, COMPUTE_STREAM) for c in (LAYOUT_IN, LAYOUT_OUT)}
    named = with_layout_copies([(sh.op.name, deps if only is None else ())
                                for sh, _, deps in kept], before, after)
    rows = [(*by_name[n], deps) for n, deps in named]
    names = [n for n, _ in named]
    index = {name: i for i, name in enumerate(names)}
    def cost_key(sh: TaskShape | str) -> object:
        """Tasks of one key cost the same: a copy to any peer behind a shared route (a switch
        port, the NIC) is one (a mesh peer's own link is its own)."""
        if isinstance(sh, str):
            return sh
        if sh.category == contention.DMA and isinstance(sh.op, Transfer):
            kind = routes[sh.op.peers[0] - 1]
            return sh.cost if kind == "link" else ("dma", kind)
        return sh.cost

    keys: dict[object, int] = {}
    shapes: list[TaskShape | str] = []
    every_shape = []
    for sh, *_ in rows:
        k = keys.setdefault(cost_key(sh), len(shapes))
        if k == len(shapes):
            shapes.append(sh)
        every_shape.append(k)
    numbers: dict[str, int] = {}
    every_stream = [numbers.setdefault(st, len(numbers)) for _, _, st, _ in rows]
    every_deps = [tuple([index[d] for d in ds]) for *_, ds in rows]  # (distinct: folded)
    assert all(d < i for i, ds in enumerate(every_deps) for d in ds), "lowering out of order"
    work: list[dict[int, int]] = [{} for _ in numbers]
    for k, st in zip(every_shape, every_stream, strict=True):
        work[st][k] = work[st].get(k, 0) + 1
    every_mult = [m for _, m, _, _ in rows]
    runs = back_to_back(every_stream, every_shape, every_mult, every_deps)
    run_of = {i: r for r, run in enumerate(runs) for i in run}
    shape = tuple(every_shape[run[0]] for run in runs)
    mult = tuple(every_mult[run[0]] for run in runs)
    deps = tuple(tuple(dict.fromkeys(run_of[d] for i in run for d in every_deps[i]
                                     if run_of[d] != r)) for r, run in enumerate(runs))
    kinds = {km: None for km in zip(shape, mult, strict=True)}
    kind_index = {km: i for i, km in enumerate(kinds)}
    return Program(tuple(shapes), shape, tuple(len(run) for run in runs),
                   graph([every_stream[run[0]] for run in runs], deps),
                   tuple(tuple(w.items()) for w in work), tuple(kinds),
                   tuple(kind_index[km] for km in zip(shape, mult, strict=True)))


def pair_makespan(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, costs: PairCosts,
                  above: float = math.inf, only: str | None = None) -> float:
    """The simulated time of schedule `s` on `pair`, as `simulate_pair(...).time_s`, from the
    folded tasks (`program`). When a lower bound of it exceeds `above`, the bound is returned
    instead (no need to simulate what cannot win): the busiest stream's work alone at full
    speed (`work_floor`), then the critical path at full speed (contention only slows a task),
    then the simulation itself, stopped early (`run_graph`). `only`: just the tasks of that
    category, all started at once (the transfers of a schedule alone)."""
    prog, seconds = costed_program(pair, s, cluster, costs, only)
    if above < math.inf:
        floor = work_floor(prog.work, seconds)
        if floor > above:
            return floor
    durations = prog.durations(seconds)
    if above < math.inf:
        floor = critical_path(prog.graph, durations)
        if floor > above:
            return floor
    return program_makespan(prog, s, seconds, durations, costs, above)


def pair_program(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, routes: tuple[str, ...],
                 only: str | None = None) -> Program:
    """`program` of `s` on `pair`, with the layout copies `layout_columns` says it makes
    (`routes`: `route_kinds`)."""
    before, after = layout_columns(pair, s) if only is None else ((0, 0), (0, 0))
    return program(s, pair.ranks, pair.direction, pair.reduces, pair.axis,
                   cluster.gpu.dma.engines, routes, (any(before), any(after)), only)


def costed_program(pair: OverlapPair, s: Schedule, cluster: ClusterSpec, costs: PairCosts,
                   only: str | None = None) -> tuple[Program, list[float]]:
    """The program of `s` on `pair` (`pair_program`) and the standalone seconds of each of its
    `shapes`: what the stages of `pair_makespan` take."""
    prog = pair_program(pair, s, cluster, costs.routes, only)
    before, after = layout_copy_time(pair, cluster, s) if only is None else (0.0, 0.0)
    steps = s.steps
    return prog, [(before if sh == LAYOUT_IN else after) if isinstance(sh, str) else
                  costs.seconds(sh, steps) for sh in prog.shapes]


def work_floor(work: Sequence[Sequence[tuple[int, int]]], seconds: Sequence[float]) -> float:
    """The busiest stream's work at full speed, a lower bound of a program's makespan: `work`
    lists each stream's (index into `seconds`, how many tasks), as `Program.work` does."""
    floor = 0.0
    for stream in work:
        total = 0.0
        for k, n in stream:
            total += n * seconds[k]
        if total > floor:
            floor = total
    return floor


def program_makespan(prog: Program, s: Schedule, seconds: Sequence[float],
                     durations: Sequence[float], costs: PairCosts,
                     above: float = math.inf,
                     spans: list[tuple[int, float, float]] | None = None) -> float:
    """The simulated makespan of `prog` (schedule `s`; `seconds` per shape, `durations` per
    task), or a lower bound of it past `above` (`run_graph`, which fills `spans`)."""
    steps = s.steps
    ids = [costs.rate_class(prog.shapes[k], steps, m, seconds[k]) for k, m in prog.kinds]
    return run_graph(prog.graph, durations, [ids[c] for c in prog.kind], costs.rates,
                     spans, above)


def piece_gemm(pair: OverlapPair, rows: int, first: bool = True, name: str = "piece") -> Gemm:
    """The part of `pair`'s GEMM over `rows` of its split dimension; split along K, a piece
    after the first adds into the output (reads it too), the first writes it. The whole split
    dimension is the whole GEMM."""
    piece = pair.gemm.piece(pair.axis, rows, name)
    if pair.axis is Axis.K and first:
        return Gemm(piece.name, piece.m, piece.n, piece.k, piece.dtype, piece.count)
    return piece


def _piece(pair: OverlapPair, steps: int, shape: TaskShape) -> Gemm:
    """The GEMM piece a Compute task shape runs in a schedule with `steps` sub-chunks per shard,
    from its cost key (`task_shapes`: its blocks, and whether it is the first of a K split)."""
    _, blocks, first, _, _ = cast(tuple[str, int, bool, int, int], shape.cost)
    return piece_gemm(pair, pair.split_extent // (pair.ranks * steps) * blocks, first,
                      shape.op.name)


def piece_copy_time(pair: OverlapPair, cluster: ClusterSpec, steps: int, cin: int, cout: int
                    ) -> float:
    """Seconds the runtime spends copying `cin` operand and `cout` output blocks of a piece
    that it cannot use in place (see `copied_blocks`), as a memory-bound kernel."""
    if not (cin or cout):
        return 0.0
    g = pair.gemm
    extent = pair.split_extent // (pair.ranks * steps)
    width_in = g.k if pair.axis is Axis.M else g.m + g.n  # K split: columns + weight rows
    nbytes = (cin * width_in + cout * g.n) * extent * DTYPE_BYTES[g.dtype]
    return elementwise_time(2 * nbytes, cluster)  # read and write


def layout_copy_time(pair: OverlapPair, cluster: ClusterSpec, s: Schedule
                     ) -> tuple[float, float]:
    """Seconds of the copies the expert-parallel ops and executors make around the pieces, as
    (before the first piece, after the last): `layout_columns` of every expert's rows, read
    and written."""
    g = pair.gemm
    row = g.count * g.m * DTYPE_BYTES[g.dtype]  # bytes per column over every expert's rows
    (bk, bn), (ak, an) = layout_columns(pair, s)
    before, after = bk * g.k + bn * g.n, ak * g.k + an * g.n
    return (elementwise_time(2 * row * before, cluster) if before else 0.0,
            elementwise_time(2 * row * after, cluster) if after else 0.0)


def layout_columns(pair: OverlapPair, s: Schedule) -> tuple[tuple[int, int], tuple[int, int]]:
    """The columns the copies around the pieces move, as (K columns, N columns) before the
    first piece and after the last; with c > 1 sub-chunks only:

    - E > 1 local experts: rows ordered (rank, expert, slot) become (rank, sub-chunk, expert,
      slot) so that every block holds its expert groups, and back (`plait.ops`): the input
      before, the outputs after (a dispatch's received tokens too);
    - the collective-kernel all-to-all of a finer-grain schedule packs each step's blocks into
      one send buffer (`plait.runtime.execute`): a dispatch packs every step as it issues them
      all, before the first piece; a combine packs each step's partials and copies what it
      received back into the output rows (counted after the last piece).

    It depends on the schedule and the pair's kind, not on its sizes."""
    if s.steps == 1 or pair.collective.kind is not CollectiveKind.A2A:
        return (0, 0), (0, 0)
    dispatch = pair.direction == "in"
    before_k = after_k = after_n = 0
    if pair.gemm.count > 1:
        before_k, after_n, after_k = 1, 1, int(dispatch)
    if s.engine is Engine.SM and s.comm is CommPattern.FINE:
        if dispatch:
            before_k += 1
        else:
            after_n += 2
    return (before_k, 0), (after_k, after_n)


def pair_tasks(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
               costs: PairCosts | None = None) -> list[Task]:
    """The simulator tasks of schedule `s` on `pair`: `task_shapes` costed by the cost model,
    and the layout copies of expert-parallel pairs around them."""
    check_feasible(pair, s)
    costs = costs or PairCosts(pair, cluster)
    tasks = []
    for sh in task_shapes(s, pair.ranks, pair.direction, pair.reduces, pair.axis,
                          cluster.gpu.dma.engines):
        copy_s, c = costs.task(sh, s.steps)
        tasks.append(Task(sh.op.name, sh.stream, c.duration + copy_s, sh.category, sh.op.deps,
                          uses=c.uses, reserves=c.reserves, slowdowns=costs.slowdowns[sh.category],
                          label=sh.op.name, args={"op": sh.op, **_detail(pair, s, sh, copy_s)}))
    before, after = layout_copy_time(pair, cluster, s)
    by_name = {t.name: t for t in tasks}
    copies = {LAYOUT_IN: before, LAYOUT_OUT: after}
    return [_layout_task(n, copies[n], deps, costs) if n not in by_name else
            by_name[n] if by_name[n].deps == deps else replace(by_name[n], deps=deps)
            for n, deps in with_layout_copies([(t.name, t.deps) for t in tasks],
                                              before > 0, after > 0)]


def _detail(pair: OverlapPair, s: Schedule, sh: TaskShape, copy_s: float) -> dict[str, object]:
    """What a trace shows of a task beside its plan op."""
    op = sh.op
    block_bytes = pair.collective.bytes / (pair.ranks * s.steps)
    if isinstance(op, Compute):
        g = _piece(pair, s.steps, sh)
        return {"m": g.m, "n": g.n, "k": g.k, **({"copy_us": copy_s * 1e6} if copy_s else {})}
    if isinstance(op, Reduce):
        return {"bytes": (op.parts + 1) * block_bytes * len(op.blocks)}
    return {"bytes_per_peer" if sh.category == contention.SM_COMM else "bytes": block_bytes}


def _layout_task(name: str, seconds: float, deps: tuple[str, ...], costs: PairCosts) -> Task:
    return Task(name, COMPUTE_STREAM, seconds, contention.COMPUTE, deps,
                uses=LAYOUT_USES, slowdowns=costs.slowdowns[contention.COMPUTE],
                label=name)


@dataclass(frozen=True, slots=True, eq=False)
class PairRun:
    """A simulated schedule of one pair and the losses it reveals. Its figures come from the
    folded tasks (`program`: what `pair_makespan` runs, symmetric streams as one); the
    timeline of every task, which traces, plots and the layer's simulation read, is built on
    first use from the same tasks unfolded (`pair_tasks`) and gives the same figures."""

    pair: OverlapPair
    schedule: Schedule
    cluster: ClusterSpec
    time_s: float
    exposed_comm_s: float
    decomposition_loss: float  # extra standalone GEMM time of the pieces (their issue
    # included: `cost.host`), fraction of the whole GEMM alone
    contention_loss: float  # extra GEMM time slowed by concurrent transfers, fraction
    gemm_whole_s: float  # the undecomposed GEMM alone
    comm_whole_s: float  # the undecomposed collective alone, on its faster engine
    _timeline: list[Timeline] = field(default_factory=list, repr=False)  # built once

    @property
    def timeline(self) -> Timeline:
        if not self._timeline:
            self._timeline.append(simulate(pair_tasks(self.pair, self.schedule, self.cluster)))
        return self._timeline[0]

    @property
    def ideal_s(self) -> float:
        """Perfect overlap, no losses: the longer of compute and communication."""
        return max(self.gemm_whole_s, self.comm_whole_s)


def simulate_pair(pair: OverlapPair, s: Schedule, cluster: ClusterSpec,
                  costs: PairCosts | None = None) -> PairRun:
    """Simulate schedule `s` on `pair`: its time, exposed transfer and losses, from the folded
    tasks (`program`); the full timeline on demand (`PairRun.timeline`)."""
    check_feasible(pair, s)
    costs = costs or PairCosts(pair, cluster)
    prog, seconds = costed_program(pair, s, cluster, costs)
    durations = prog.durations(seconds)
    spans: list[tuple[int, float, float]] = []
    makespan = program_makespan(prog, s, seconds, durations, costs, spans=spans)
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    pieces = slowed = 0.0
    for i, t0, t1 in spans:
        sh = prog.shapes[prog.shape[i]]
        if isinstance(sh, str) or sh.category == contention.COMPUTE:
            compute.append((t0, t1))
            if not isinstance(sh, str) and isinstance(sh.op, Compute):
                mult = prog.kinds[prog.kind[i]][1]
                pieces += durations[i] * mult
                slowed += (t1 - t0 - durations[i]) * mult
        else:
            comm.append((t0, t1))
    whole = costs.whole().duration
    return PairRun(pair, s, cluster, makespan, exposed(comm, compute),
                   pieces / whole - 1.0, max(0.0, slowed) / whole, whole, costs.collective_s)
