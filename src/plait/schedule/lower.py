"""Lowering: a `Schedule` and a group size -> the ordered ops that carry it out.

This is the one description both the simulator (ops -> timed tasks) and the runtime (ops ->
streams) consume. The gathered (or scattered) tensor is a grid of blocks: P shards x c
sub-chunks. `Block(shard, sub)` names a block by its shard's offset from this rank (0 = own), so
the same ops describe every rank. Ops:

- `Compute(blocks)`: the GEMM piece over these blocks (rows for axis M, reduction slice for K);
- `Transfer(blocks, peers)`: move these blocks, block i to or from peer `peers[i]`; one
  collective kernel when the engine is SM, one copy command otherwise (then one block);
- `Reduce(blocks)`: sum the partials that peers sent for our own blocks (reduce-scatter when the
  transfers could not add).

All-gather direction ("in"): transfers bring remote blocks; the GEMM runs on the local shard
first, then on remote blocks as they arrive. Reduce-scatter direction ("out"): the GEMM produces
the partials for remote blocks first and transfers send them as they are ready; the own rows
come last.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from plait.errors import InfeasibleError
from plait.schedule.schedule import PER_PEER, CommPattern, Engine, Schedule
from plait.workload.operators import Axis


class Block(NamedTuple):
    """A block of the moved tensor, ordered by shard then sub-chunk (a named tuple: a large
    group's lowering names tens of thousands)."""

    shard: int  # offset of the owning (AG) or destination (RS) rank from this rank
    sub: int  # sub-chunk index within the shard

    def __str__(self) -> str:
        return f"{self.shard}.{self.sub}"


@dataclass(frozen=True, slots=True)
class Compute:
    name: str
    blocks: tuple[Block, ...]
    deps: tuple[str, ...] = ()
    first: bool = True  # K split: the first piece writes the output, later ones accumulate


@dataclass(frozen=True, slots=True)
class Transfer:
    name: str
    blocks: tuple[Block, ...]
    peers: tuple[int, ...]
    engine: Engine
    reduce: bool = False  # the collective kernel adds (reduce-scatter)
    deps: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reduce:
    name: str
    blocks: tuple[Block, ...]
    parts: int
    deps: tuple[str, ...] = ()


PlanOp = Compute | Transfer | Reduce


def describe(op: PlanOp) -> str:
    """One-line text of an op, used as its label in traces and error messages."""
    blocks = ",".join(str(b) for b in op.blocks)
    kind = type(op).__name__
    extra = f" {op.engine}->{list(op.peers)}" if isinstance(op, Transfer) else ""
    return f"{kind} {op.name} [{blocks}]{extra}"


def signature(ops: tuple[PlanOp, ...]) -> tuple[object, ...]:
    """What the ops do, without their names: two schedules with equal signatures move the same
    blocks with the same engines and compute the same pieces in the same order (for example
    `p2p/dma/M` and `fine/dma/c1/g1/M` on two ranks)."""
    index = {op.name: i for i, op in enumerate(ops)}
    out: list[object] = []
    for op in ops:
        deps = tuple(sorted(index[d] for d in op.deps))
        if isinstance(op, Transfer):
            out.append(("T", op.blocks, op.peers, op.engine, op.reduce, deps))
        elif isinstance(op, Compute):
            out.append(("C", op.blocks, op.first, deps))
        else:
            out.append(("R", op.blocks, op.parts, deps))
    return tuple(out)


def _summary(ops: tuple[PlanOp, ...]) -> tuple[object, ...]:
    """A cheap digest of `signature(ops)` from its length and its ends: equal signatures have
    equal digests, so lowerings whose digests differ need no signature to tell them apart."""
    ends = (*ops[:3], *ops[-3:])
    return (len(ops), *((type(op).__name__, len(op.blocks), len(op.deps),
                         op.engine if isinstance(op, Transfer) else None) for op in ends))


# digest -> [(signature, or None until another lowering shares the digest; its ops; id)]
_LOWERINGS: dict[tuple[object, ...], list[tuple[tuple[object, ...] | None,
                                                 tuple[PlanOp, ...], int]]] = {}
_IDS = itertools.count()


@functools.lru_cache(maxsize=8192)
def lowering_id(s: Schedule, ranks: int, direction: str, reduces: bool) -> int:
    """A small integer naming `lower(s, ...)`'s ops up to op names: equal for schedules that
    lower to the same ops (their simulated times are equal). Cached, so comparing lowerings
    costs a dictionary look-up; a lowering's `signature` is worked out only when another
    lowering has its digest (`_summary`) and is not the very same ops (`lower` gives both
    split axes one)."""
    ops = lower(s, ranks, direction, reduces)
    known = _LOWERINGS.setdefault(_summary(ops), [])
    same = next((number for _, other_ops, number in known if other_ops is ops), None)
    if same is not None:
        return same
    sig = signature(ops) if known else None
    for k, (other, other_ops, number) in enumerate(known):
        if other is None:
            other = signature(other_ops)
            known[k] = (other, other_ops, number)
        if other == sig:
            return number
    known.append((sig, ops, next(_IDS)))
    return known[-1][2]


def copied_blocks(op: Compute, s: Schedule, ranks: int, direction: str, axis: Axis
                  ) -> tuple[int, int]:
    """Blocks of GEMM piece `op` the runtime copies on the way: (operand blocks gathered into
    one tensor, output blocks scattered to their rows); (0, 0) when it reads and writes them in
    place. The runtime (`plait.runtime.execute`) works this way and the simulator charges it:

    - split along M (rows), either side: a piece within one step reads its blocks in place,
      one GEMM per run of adjacent ranks (a strided batch of blocks when c > 1), and writes its
      rows in place (a sequential schedule on copy engines first copies the own block beside
      the pulled ones, while they fly: not charged). A piece spanning several steps gathers
      its blocks (and, all-gather side, scatters its rows);
    - all-gather side, split along K: the piece gathers its blocks' columns and weight rows;
    - a piece over the whole local shard reads it in place, and so does one over every block:
      the sequential baseline is charged as frameworks run it (a transposed GEMM operand over
      the gathered tokens), although the executor's K-split sequential path copies.
    """
    n = len(op.blocks)
    if n == 1 or n == ranks * s.steps or all(b.shard == 0 for b in op.blocks):
        return 0, 0
    if axis is Axis.K:
        return n, 0
    if len({b.sub for b in op.blocks}) == 1:
        return 0, 0
    return (n, n) if direction == "in" else (n, 0)


def lower(s: Schedule, ranks: int, direction: str, reduces: bool) -> tuple[PlanOp, ...]:
    """The ops of schedule `s` on a group of `ranks`; `reduces` for reduce-scatter pairs (a
    pure function of its arguments, cached: the ops are immutable). The split axis names the
    blocks' dimension but does not change the ops, so both axes share one lowering."""
    return _lower(s if s.axis is Axis.M else replace(s, axis=Axis.M), ranks, direction, reduces)


@functools.lru_cache(maxsize=8192)
def _lower(s: Schedule, ranks: int, direction: str, reduces: bool) -> tuple[PlanOp, ...]:
    if ranks == 1:
        return (Compute("gemm", (Block(0, 0),)),)
    if direction == "in":
        return _lower_in(s, ranks)
    if direction == "out":
        return _lower_out(s, ranks, reduces)
    raise InfeasibleError(f"unknown pair direction {direction!r}")


def _constant(deps: tuple[str, ...], _blocks: tuple[Block, ...]) -> tuple[str, ...]:
    return deps


def _owners_of(owners: dict[Block, str], blocks: tuple[Block, ...]) -> tuple[str, ...]:
    """The pieces that compute `blocks` (a transfer waits for them)."""
    if len(blocks) == 1:
        return (owners[blocks[0]],)
    return tuple(sorted({owners[b] for b in blocks}))


def _transfers(engine: Engine, comm: CommPattern, step: int, peers: range,
               make_deps: Callable[[tuple[Block, ...]], tuple[str, ...]], reduce: bool
               ) -> list[Transfer]:
    """The transfers of one communication step (all `peers`, sub-chunk `step`)."""
    blocks = tuple(Block(p, step) for p in peers)
    if engine is Engine.SM and (len(blocks) > 1 or comm is not CommPattern.P2P):
        return [Transfer(f"x{step}", blocks, tuple(peers), engine, reduce, make_deps(blocks))]
    return [Transfer(f"x{step}.{b.shard}", (b,), (b.shard,), engine, False, make_deps((b,)))
            for b in blocks]


@functools.lru_cache(maxsize=1024)
def _pulls(engine: Engine, comm: CommPattern, step: int, ranks: int) -> tuple[Transfer, ...]:
    """The transfers of all-gather step `step` (they wait for nothing), shared by every
    schedule that makes them: the same ops whatever the pieces after them."""
    return tuple(_transfers(engine, comm, step, range(1, ranks), _no_deps, False))


def _no_deps(_blocks: tuple[Block, ...]) -> tuple[str, ...]:
    return ()


def _lower_in(s: Schedule, ranks: int) -> tuple[PlanOp, ...]:
    remote = range(1, ranks)
    steps = s.steps
    ops: list[PlanOp] = []
    local = Compute("gemm.local", tuple(Block(0, j) for j in range(steps)))
    if s.comm is CommPattern.SEQ:
        xs = _pulls(s.engine, s.comm, 0, ranks)
        return (*xs, Compute("gemm", tuple(sorted(Block(p, 0) for p in range(ranks))),
                             tuple(x.name for x in xs)))
    if s.comm is CommPattern.P2P:  # one peer per step
        ops.append(local)
        for p in remote:
            x = _transfers(s.engine, s.comm, 0, range(p, p + 1), _no_deps, False)[0]
            x = Transfer(f"x{p}", x.blocks, x.peers, x.engine)
            ops += [x, Compute(f"gemm.{p}", x.blocks, (x.name,), first=False)]
        return tuple(ops)
    # FINE: every step exchanges one sub-chunk with all peers at once.
    step_xs = [_pulls(s.engine, s.comm, j, ranks) for j in range(steps)]
    ops.append(local)
    ops += [x for xs in step_xs for x in xs]
    if s.group == PER_PEER:
        for j, xs in enumerate(step_xs):
            carriers: dict[Block, list[str]] = {}  # the transfers that bring each block
            for x in xs:
                for b in x.blocks:
                    carriers.setdefault(b, []).append(x.name)
            for p in remote:
                b = Block(p, j)
                ops.append(Compute(f"gemm.{p}.{j}", (b,), tuple(carriers.get(b, ())),
                                   first=False))
    else:
        for j0 in range(0, steps, s.group):
            js = range(j0, j0 + s.group)
            blocks = tuple(Block(p, j) for j in js for p in remote)
            deps = tuple(x.name for j in js for x in step_xs[j])
            ops.append(Compute(f"gemm.{j0}", blocks, deps, first=False))
    return tuple(ops)


def _lower_out(s: Schedule, ranks: int, reduce: bool) -> tuple[PlanOp, ...]:
    remote = range(1, ranks)
    steps = s.steps
    # A reduce-scatter collective kernel adds the partials itself; then the own rows of each
    # step must be computed before that step's kernel. Otherwise own rows come last.
    in_kernel = reduce and s.engine is Engine.SM and s.comm is not CommPattern.P2P
    ops: list[PlanOp] = []
    if s.comm is CommPattern.SEQ:
        gemm = Compute("gemm", tuple(Block(p, 0) for p in range(ranks)))
        xs = _transfers(s.engine, s.comm, 0, remote, functools.partial(_constant, ("gemm",)),
                        in_kernel)
        ops += [gemm, *xs]
    elif s.comm is CommPattern.P2P:
        for p in remote:
            c = Compute(f"gemm.{p}", (Block(p, 0),))
            x = _transfers(s.engine, s.comm, 0, range(p, p + 1),
                           functools.partial(_constant, (c.name,)), False)[0]
            ops += [c, Transfer(f"x{p}", x.blocks, x.peers, x.engine, False, x.deps)]
        ops.append(Compute("gemm.local", (Block(0, 0),)))
    else:
        owners: dict[Block, str] = {}
        pieces: list[Compute] = []
        first_peer = 0 if in_kernel else 1
        for j0 in range(0, steps, max(s.group, 1)):
            js = range(j0, j0 + max(s.group, 1))
            if s.group == PER_PEER:
                for p in range(first_peer, ranks):
                    pieces.append(Compute(f"gemm.{p}.{j0}", (Block(p, j0),)))
            else:
                blocks = tuple(Block(p, j) for j in js for p in range(first_peer, ranks))
                pieces.append(Compute(f"gemm.{j0}", blocks))
        for c in pieces:
            owners.update({b: c.name for b in c.blocks})
        needed = range(first_peer, ranks)
        left = dict.fromkeys(range(steps), len(needed))  # blocks of each step still to compute
        for c in pieces:  # each step's transfers right after the piece that completes it
            ops.append(c)
            for b in c.blocks:
                left[b.sub] -= 1
            for j in sorted({b.sub for b in c.blocks}):
                if left[j] == 0:
                    left[j] = -1  # issued
                    deps = (functools.partial(_constant, tuple(sorted(
                                {owners[Block(p, j)] for p in needed}))) if in_kernel
                            else functools.partial(_owners_of, owners))
                    ops += _transfers(s.engine, s.comm, j, remote, deps, in_kernel)
        if not in_kernel:
            ops.append(Compute("gemm.local", tuple(Block(0, j) for j in range(steps))))
    if reduce and not in_kernel:
        sent = tuple(o.name for o in ops if isinstance(o, Transfer))
        ops.append(Reduce("reduce", tuple(Block(0, j) for j in range(steps)), ranks,
                          (*sent, "gemm.local" if s.comm is not CommPattern.SEQ else "gemm")))
    return tuple(ops)

