"""Execute lowered schedules: the same ops the simulator timed, on real tensors.

Both executors walk `lower(schedule, ...)` in order. Transfers are issued as soon as their
dependencies are done and waited only just before the op that consumes them, so communication
runs (on the collective backend's threads/stream, or the copier thread/copy stream) while the
compute thread computes earlier pieces.

Data layout (P ranks, c sub-chunks per shard, block (offset, sub) of rank q = rank + offset):
- all-gather side, axis M: the gathered matrix is rank-major rows; a rank's shard splits into c row
  blocks. Axis K: the gather is along columns; blocks are column blocks.
- reduce-scatter side: rows of the full product, rank-major; rank q keeps rows of shard q.
Received blocks land in `recv[j, q]` (contiguous per step); outputs go straight to their rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from plait import tracing
from plait.errors import InfeasibleError
from plait.runtime.context import CallRecord, Group
from plait.runtime.engines import Handle
from plait.schedule.lower import Block, Compute, PlanOp, Reduce, Transfer, lower
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.workload.ops import Axis


def check_splits(op: str, extent: int, s: Schedule, what: str) -> None:
    c = s.steps
    if extent % c:
        raise InfeasibleError(f"{op}: schedule {s} cuts each shard into {c} sub-chunks but the "
                              f"shard has {extent} {what}; use chunks dividing {extent}")


class _Pending:
    """Issued transfers by op name; waits happen just before a consumer."""

    def __init__(self) -> None:
        self.handles: dict[str, Handle] = {}

    def add(self, name: str, h: Handle) -> None:
        self.handles[name] = h

    def wait(self, names: tuple[str, ...]) -> None:
        for n in names:
            h = self.handles.pop(n, None)
            if h is not None:
                h.wait()

    def wait_all(self) -> None:
        self.wait(tuple(self.handles))


def _runs(qs: list[int]) -> list[tuple[int, int]]:
    """Sorted ranks `qs` as runs [q0, q1) of consecutive ranks."""
    runs: list[tuple[int, int]] = []
    for q in qs:
        if runs and runs[-1][1] == q:
            runs[-1] = (runs[-1][0], q + 1)
        else:
            runs.append((q, q + 1))
    return runs


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _mm(x: torch.Tensor, w: torch.Tensor, block_rows: int, out: torch.Tensor | None = None
        ) -> torch.Tensor:
    """`x @ w` over whole row blocks of `block_rows` rows: `x` (rows, K), or (n, block_rows, K)
    for n blocks anywhere in memory. `w` (K, N); or (E, K, N), local experts: every block holds
    E equal groups of rows, group e for expert e (a batched GEMM per expert, in place)."""
    if w.dim() == 2:
        if x.dim() == 3:  # blocks strided in memory: one batched GEMM
            return torch.bmm(x, w.expand(x.shape[0], *w.shape), out=out)
        return torch.mm(x, w, out=out)
    E, K, N = w.shape
    if out is None:
        out = x.new_empty((*x.shape[:-1], N))
    blocks = x.shape[0] if x.dim() == 3 else x.shape[0] // block_rows
    xs = x.view(blocks, E, block_rows // E, K)
    os = out.view(blocks, E, block_rows // E, N)
    for e in range(E):
        torch.bmm(xs[:, e], w[e].expand(xs.shape[0], K, N), out=os[:, e])
    return out


def all_gather_matmul(rt: Group, a_shard: torch.Tensor, weights: list[torch.Tensor],
                      s: Schedule, axis: Axis, need_gathered: bool, label: str,
                      exchange: bool = False
                      ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """A = all_gather(a_shard) along rows (axis M) or columns (axis K); return A, [A @ W].

    `exchange`: A = all_to_all(a_shard) instead (rows only): `a_shard` holds P row chunks,
    chunk q for rank q, and A's rows are the chunks every rank sent here, by source rank.
    A weight (E, K, N) holds E local experts: every block of rows (a rank's chunk cut in the
    schedule's sub-chunks) is E equal groups, group e for expert e."""
    P, r = rt.world, rt.rank
    if P == 1:
        s = Schedule()  # nothing to overlap; recorded as what ran
    c = s.steps
    device, dtype = a_shard.device, a_shard.dtype
    send4 = None  # exchange: the block (q, j) this rank sends to rank q
    if axis is Axis.M:
        m_shard, K = a_shard.shape
        if exchange:
            m_shard //= P
            send4 = a_shard.view(P, c, m_shard // c, K)
        sub = m_shard // c
        block_shape: tuple[int, ...] = (sub, K)
        M = P * m_shard
        local_blocks = a_shard.view(c, sub, K) if send4 is None else send4[r]
    else:
        M, k_shard = a_shard.shape
        sub = k_shard // c
        block_shape = (M, sub)
        local_blocks = a_shard.view(M, c, sub).permute(1, 0, 2).contiguous()  # block-major
    outs = [torch.empty((M, w.shape[-1]), device=device, dtype=dtype) for w in weights]
    recv = torch.empty((c, P, *block_shape), device=device, dtype=dtype)
    engine = rt.engine_name(s.engine, device)
    own = local_blocks.view(m_shard, K) if axis is Axis.M else a_shard  # our own rows
    rt.records.append(CallRecord("all_to_all_matmul" if exchange else "all_gather_matmul",
                                 str(s), engine,
                                 (tuple(a_shard.shape), *(tuple(w.shape) for w in weights)), P,
                                 label))

    own_in_recv: set[int] = set()  # steps whose recv also holds our own block

    def block(q: int, j: int) -> torch.Tensor:
        return local_blocks[j] if q == r else recv[j, q]

    pending = _Pending()
    peer = rt.peer(device) if s.engine is Engine.DMA and P > 1 else None
    published = local_blocks if send4 is None else a_shard  # exchange: every rank's blocks
    if peer is not None:
        peer.begin(published.numel() * published.element_size())
        peer.publish(slot=0, offset=0, src=published)
    block_bytes = sub * (K if axis is Axis.M else M) * a_shard.element_size()
    if peer is not None and s.comm is CommPattern.SEQ and axis is Axis.M:
        # One GEMM over every block: our own goes beside the pulled ones now, while they fly.
        recv[0, r].copy_(own)
        own_in_recv.add(0)

    def sent(q: int, j: int) -> torch.Tensor:  # the block rank q receives from us at step j
        return local_blocks[j] if send4 is None else send4[q, j]

    def issue(x: Transfer) -> Handle:
        j = x.blocks[0].sub
        what = f"{label} {x.name}"
        if peer is not None:
            (b,) = x.blocks
            q = (r + b.shard) % P
            at = b.sub if send4 is None else r * c + b.sub  # where q keeps our block
            return peer.pull(q, 0, at * block_bytes, recv[b.sub, q], what)
        eng = rt.collective()
        if len(x.peers) == 1 and s.comm is CommPattern.P2P:  # one peer per step
            off = x.peers[0]
            return eng.sendrecv(sent((r - off) % P, j), (r - off) % P, recv[j, (r + off) % P],
                                (r + off) % P, what)
        own_in_recv.add(j)
        if send4 is not None:
            return eng.all_to_all(recv[j].view(P * sub, K), send4[:, j].contiguous(), what)
        return eng.all_gather(recv[j], local_blocks[j].contiguous(), what)

    def compute(op: Compute) -> None:
        blocks = sorted(op.blocks, key=lambda b: ((r + b.shard) % P, b.sub))
        coords = [((r + b.shard) % P, b.sub) for b in blocks]
        if axis is Axis.M:
            whole_local = len(blocks) == c and all(q == r for q, _ in coords)
            steps = {j for _, j in coords}
            (j0,) = steps if len(steps) == 1 else (None,)
            whole_step = j0 is not None and j0 in own_in_recv and len(coords) == P
            if whole_local:
                x = own
            elif whole_step:  # one all-gathered step, rank order: contiguous already
                x = recv[j0].view(P * sub, K)
            elif j0 is not None and (j0 in own_in_recv or all(q != r for q, _ in coords)):
                # One step, all in recv[j0]: a GEMM per run of adjacent blocks, no gathering.
                for q0, q1 in _runs([q for q, _ in coords]):
                    x = recv[j0, q0:q1]
                    for w, out in zip(weights, outs, strict=True):
                        if c == 1:  # its output rows are adjacent too
                            _mm(x.view(-1, K), w, sub, out=out[q0 * sub:q1 * sub])
                        else:  # a block's rows every c blocks: a strided batch, in place
                            _mm(x, w, sub, out=out.view(P, c, sub, out.shape[1])[q0:q1, j0])
                return
            else:
                x = _cat([block(q, j) for q, j in coords], 0)
            for w, out in zip(weights, outs, strict=True):
                o4 = out.view(P, c, sub, out.shape[1])
                if whole_local:
                    _mm(x, w, sub, out=out[r * m_shard:(r + 1) * m_shard])
                elif len(coords) == 1:
                    _mm(x, w, sub, out=o4[coords[0]])
                elif whole_step and c == 1:
                    _mm(x, w, sub, out=out)
                else:
                    y = _mm(x, w, sub)
                    for i, (q, j) in enumerate(coords):
                        o4[q, j].copy_(y[i * sub:(i + 1) * sub])
        else:
            own_cols = coords == [(r, j) for j in range(c)]  # our own columns: a_shard itself
            x = a_shard if own_cols else _cat([block(q, j) for q, j in coords], 1)
            for w, out in zip(weights, outs, strict=True):
                w4 = w.view(P, c, sub, w.shape[1])
                wr = w[r * k_shard:(r + 1) * k_shard] if own_cols else \
                    _cat([w4[q, j] for q, j in coords], 0)
                if op.first:
                    torch.mm(x, wr, out=out)
                else:
                    out.addmm_(x, wr)

    _walk(lower(s, P, "in", reduces=False), pending, issue, compute, None, label)
    if peer is not None:
        peer.end()
    gathered = None
    if need_gathered:
        gathered = _assemble_gathered(recv, own, axis, P, r, c, own_in_recv)
    return gathered, outs


def _assemble_gathered(recv: torch.Tensor, a_shard: torch.Tensor, axis: Axis, P: int, r: int,
                       c: int, own_in_recv: set[int]) -> torch.Tensor:
    if axis is Axis.M:
        m_shard, K = a_shard.shape
        if c == 1:  # recv[0] is the gathered matrix, rank-major
            if 0 not in own_in_recv:
                recv[0, r].copy_(a_shard)
            return recv[0].view(P * m_shard, K)
        a = torch.empty((P * m_shard, K), device=a_shard.device, dtype=a_shard.dtype)
        a.view(P, c, m_shard // c, K).copy_(recv.transpose(0, 1))
        a[r * m_shard:(r + 1) * m_shard] = a_shard
        return a
    M, k_shard = a_shard.shape
    a = torch.empty((M, P * k_shard), device=a_shard.device, dtype=a_shard.dtype)
    a.view(M, P, c, k_shard // c).copy_(recv.permute(2, 1, 0, 3))
    a[:, r * k_shard:(r + 1) * k_shard] = a_shard
    return a


def matmul_reduce_scatter(rt: Group, a: torch.Tensor, w: torch.Tensor, s: Schedule,
                          label: str, exchange: bool = False) -> torch.Tensor:
    """Rows of shard `rank` of reduce_scatter(a @ w) (sum over ranks).

    `exchange`: all_to_all(a @ w) instead: row chunk q of the product goes to rank q, and the
    result is the chunks every rank computed for this one, by source rank (no sum). A weight
    (E, K, N) holds E local experts, as in `all_gather_matmul`."""
    P, r = rt.world, rt.rank
    if P == 1:
        s = Schedule()  # nothing to overlap; recorded as what ran
    c = s.steps
    M, K = a.shape
    N = w.shape[-1]
    m_shard = M // P
    sub = m_shard // c
    device, dtype = a.device, a.dtype
    a4 = a.view(P, c, sub, K)
    out = torch.empty((M if exchange else m_shard, N), device=device, dtype=dtype)
    partial: dict[tuple[int, int], torch.Tensor] = {}
    whole: list[torch.Tensor] = []  # the full product when one piece computed it all
    # recv[offset, j]: the block rank - offset sent; exchanging, it lands in its output rows.
    recv = torch.empty((P, c, sub, N) if not exchange else (0,), device=device, dtype=dtype)
    o4 = out.view(P, c, sub, N) if exchange else None
    exchanged: dict[int, torch.Tensor] = {}  # step -> all-to-all output, by source rank
    step_rows: dict[int, torch.Tensor] = {}  # step -> every rank's partial, adjacent in order
    engine = rt.engine_name(s.engine, device)
    rt.records.append(CallRecord("matmul_all_to_all" if exchange else "matmul_reduce_scatter",
                                 str(s), engine, (tuple(a.shape), tuple(w.shape)), P, label))
    pending = _Pending()
    peer = rt.peer(device) if s.engine is Engine.DMA and P > 1 else None
    block_bytes = sub * N * a.element_size()
    if peer is not None:
        peer.begin(P * c * block_bytes)

    def compute(op: Compute) -> None:
        coords = sorted(((r + b.shard) % P, b.sub) for b in op.blocks)
        if len(coords) == P * c:  # the whole product, canonical order
            whole.append(_mm(a, w, sub))
            y = whole[0].view(P, c, sub, N)
            partial.update({(q, j): y[q, j] for q, j in coords})
            return
        if len({j for _, j in coords}) == 1:  # one step: a GEMM per run of adjacent blocks
            j0 = coords[0][1]
            for q0, q1 in _runs([q for q, _ in coords]):
                if c == 1:  # adjacent rows of `a`
                    y = _mm(a[q0 * sub:q1 * sub], w, sub).view(q1 - q0, sub, N)
                else:  # a block's rows every c blocks: a strided batch
                    y = _mm(a4[q0:q1, j0], w, sub)
                partial.update({(q, j0): y[q - q0] for q in range(q0, q1)})
                if (q0, q1) == (0, P):  # the step's reduce-scatter input as it is
                    step_rows[j0] = y.view(P * sub, N)
            return
        if coords == [(r, j) for j in range(c)]:  # our own rows: adjacent already
            y = _mm(a[r * m_shard:(r + 1) * m_shard], w, sub)
            partial.update({(r, j): y[j * sub:(j + 1) * sub] for j in range(c)})
            return
        y = _mm(_cat([a4[q, j] for q, j in coords], 0), w, sub)
        for i, qj in enumerate(coords):
            partial[qj] = y[i * sub:(i + 1) * sub]

    def issue(x: Transfer) -> Handle:
        what = f"{label} {x.name}"
        if peer is not None:
            (b,) = x.blocks
            slot = b.shard * c + b.sub
            peer.publish(slot, slot * block_bytes, partial[((r + b.shard) % P, b.sub)],
                         readers=[(r + b.shard) % P])
            return peer.pull((r - b.shard) % P, slot, slot * block_bytes, landing(b), what)
        eng = rt.collective()
        j = x.blocks[0].sub
        if x.reduce:  # reduce-scatter kernel over step j: every rank's partial, rank order
            inp = whole[0] if whole and c == 1 else step_rows[j] if j in step_rows else \
                torch.cat([partial[(q, j)] for q in range(P)])
            return eng.reduce_scatter(out[j * sub:(j + 1) * sub], inp, what)
        if len(x.blocks) > 1:  # all-to-all over step j; our own block is not sent anywhere
            inp = whole[0] if whole and c == 1 else torch.cat(
                [partial.get((q, j), spare) for q in range(P)])
            exchanged[j] = out if c == 1 else torch.empty_like(inp)
            return eng.all_to_all(exchanged[j], inp, what)
        (b,) = x.blocks
        return eng.sendrecv(partial[((r + b.shard) % P, j)], (r + b.shard) % P,
                            landing(b), (r - b.shard) % P, what)

    spare = torch.empty((sub, N), device=device, dtype=dtype)  # stands in for our own block

    def landing(b: Block) -> torch.Tensor:  # where the block from rank r - b.shard lands
        return recv[b.shard, b.sub] if o4 is None else o4[(r - b.shard) % P, b.sub]

    def reduce(op: Reduce) -> None:
        o = out.view(c, sub, N)
        for j in range(c):
            o[j].copy_(partial[(r, j)])
        o.add_(recv[1:].sum(0))

    _walk(lower(s, P, "out", reduces=not exchange), pending, issue, compute, reduce, label)
    if P == 1:
        out.copy_(partial[(0, 0)])
    elif o4 is not None:  # exchanged: our own rows, and the steps received all-to-all
        for j in range(c):
            if j in exchanged and exchanged[j] is not out:
                o4[:, j].copy_(exchanged[j].view(P, sub, N))
            o4[r, j].copy_(partial[(r, j)])
    if peer is not None:
        peer.end()
    return out


def _walk(ops: tuple[PlanOp, ...], pending: _Pending, issue: Callable[[Transfer], Handle],
          compute: Callable[[Compute], None], reduce: Callable[[Reduce], None] | None,
          label: str) -> None:
    """Run ops in plan order; every transfer is issued before the compute that follows it."""
    done: set[str] = set()
    transfers = [op for op in ops if isinstance(op, Transfer)]
    for op in ops:
        # Issue every transfer whose producers are done before blocking on compute.
        for x in transfers:
            if x.name not in done and all(d in done for d in x.deps):
                with record_function(tracing.op_range(label, x.name)):
                    pending.add(x.name, issue(x))
                done.add(x.name)
        if isinstance(op, Transfer):
            continue
        pending.wait(op.deps)
        with record_function(tracing.op_range(label, op.name)):
            if isinstance(op, Compute):
                compute(op)
            elif reduce is not None:
                reduce(op)
        done.add(op.name)
    pending.wait_all()

