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

from collections.abc import Callable, Sequence

import torch

from plait import tracing
from plait.errors import InfeasibleError
from plait.runtime.context import CallRecord, Group
from plait.runtime.engines import Handle
from plait.runtime.ranges import traced
from plait.schedule.lower import Block, Compute, PlanOp, Reduce, Transfer, lower
from plait.schedule.schedule import CommPattern, Engine, Schedule
from plait.spec import dtypes
from plait.workload.operators import Axis


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


# A GEMM piece computed another way than `x @ w` (FP8 scaled): (weight index, the piece's
# rows (rows, K), the weight, what makes the global row numbers of those rows) -> (rows, N).
RowGemm = Callable[[int, torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]], torch.Tensor]


def all_gather_matmul(rt: Group, a_shard: torch.Tensor, weights: list[torch.Tensor],
                      s: Schedule, axis: Axis, need_gathered: bool, label: str,
                      exchange: bool = False, gemm: RowGemm | None = None,
                      out_dtypes: Sequence[torch.dtype | None] = ()
                      ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """A = all_gather(a_shard) along rows (axis M) or columns (axis K); return A, [A @ W].

    `exchange`: A = all_to_all(a_shard) instead (rows only): `a_shard` holds P row chunks,
    chunk q for rank q, and A's rows are the chunks every rank sent here, by source rank.
    A weight (E, K, N) holds E local experts: every block of rows (a rank's chunk cut in the
    schedule's sub-chunks) is E equal groups, group e for expert e. `gemm` (rows, axis M):
    each piece's product computed by it, weight i's in `out_dtypes[i]` (FP8 scaled GEMMs,
    whose row scales follow the rows)."""
    if rt.world == 1:
        s = Schedule()  # nothing to overlap; recorded as what ran
    g = _Gather(rt, a_shard, weights, s, axis, label, exchange, gemm, out_dtypes)
    m, n = g.outs[0].shape[0], sum(w.shape[-1] for w in weights)
    with traced(lambda: _call(rt, m, n, weights[0].shape[-2], a_shard.dtype).range()):
        _walk(lower(s, rt.world, "in", reduces=False), g.issue, g.compute, None, label)
        if g.peer is not None:
            g.peer.end()
    return (g.gathered() if need_gathered else None), g.outs


def _call(rt: Group, m: int, n: int, k: int, dtype: torch.dtype) -> tracing.Call:
    """The call just recorded (`rt.records[-1]`) as its trace range names it."""
    rec = rt.records[-1]
    return tracing.Call(rec.op, rec.label, rec.schedule, rec.engine, m, n, k, rec.world,
                        dtypes.plait_name(dtype))


class _Gather:
    """One all-gather (or all-to-all dispatch) -> GEMM call: the transport (`issue`: a
    lowered transfer on the collective or the copy engine) and the consumption (`compute`: a
    GEMM piece on the blocks it names, in place where the layout allows)."""

    def __init__(self, rt: Group, a_shard: torch.Tensor, weights: list[torch.Tensor],
                 s: Schedule, axis: Axis, label: str, exchange: bool,
                 gemm: RowGemm | None = None, out_dtypes: Sequence[torch.dtype | None] = ()
                 ) -> None:
        P, r, c = rt.world, rt.rank, s.steps
        self.rt, self.a_shard, self.weights, self.s, self.axis = rt, a_shard, weights, s, axis
        self.label, self.P, self.r, self.c, self.gemm = label, P, r, c, gemm
        device, dtype = a_shard.device, a_shard.dtype
        self.send4: torch.Tensor | None = None  # exchange: the block (q, j) we send to rank q
        if axis is Axis.M:
            m_shard, K = a_shard.shape
            if exchange:
                m_shard //= P
                self.send4 = a_shard.view(P, c, m_shard // c, K)
            self.sub, self.K, self.m_shard = m_shard // c, K, m_shard
            block_shape: tuple[int, ...] = (self.sub, K)
            M = P * m_shard
            self.local_blocks = (a_shard.view(c, self.sub, K) if self.send4 is None
                                 else self.send4[r])
            self.own = self.local_blocks.view(m_shard, K)  # our own rows
        else:
            M, self.k_shard = a_shard.shape
            self.sub, self.K = self.k_shard // c, M
            block_shape = (M, self.sub)
            self.local_blocks = a_shard.view(M, c, self.sub).permute(1, 0, 2).contiguous()
            self.own = a_shard
        kinds = list(out_dtypes) or [None] * len(weights)
        self.outs = [torch.empty((M, w.shape[-1]), device=device, dtype=kind or dtype)
                     for w, kind in zip(weights, kinds, strict=True)]
        self.recv = torch.empty((c, P, *block_shape), device=device, dtype=dtype)
        rt.records.append(CallRecord(
            "all_to_all_matmul" if exchange else "all_gather_matmul", str(s),
            rt.engine_name(s.engine, device),
            (tuple(a_shard.shape), *(tuple(w.shape) for w in weights)), P, label))
        self.own_in_recv: set[int] = set()  # steps whose recv also holds our own block
        self.peer = rt.peer(device) if s.engine is Engine.DMA and P > 1 else None
        self.block_bytes = self.sub * (self.K if axis is Axis.M else M) * a_shard.element_size()
        if self.peer is not None:
            published = self.local_blocks if self.send4 is None else a_shard  # exchange: all
            self.peer.begin(published.numel() * published.element_size())
            self.peer.publish(slot=0, offset=0, src=published)
            if s.comm is CommPattern.SEQ and axis is Axis.M:
                # One GEMM over every block: our own goes beside the pulled ones now.
                self.recv[0, r].copy_(self.own)
                self.own_in_recv.add(0)

    def block(self, q: int, j: int) -> torch.Tensor:
        return self.local_blocks[j] if q == self.r else self.recv[j, q]

    def issue(self, x: Transfer) -> Handle:
        """Start transfer `x`; the data lands in `recv[step, source rank]`."""
        P, r, j = self.P, self.r, x.blocks[0].sub
        what = f"{self.label} {x.name}"
        if self.peer is not None:
            (b,) = x.blocks
            q = (r + b.shard) % P
            at = b.sub if self.send4 is None else r * self.c + b.sub  # where q keeps our block
            return self.peer.pull(q, 0, at * self.block_bytes, self.recv[b.sub, q], what)
        eng = self.rt.collective()
        if len(x.peers) == 1 and self.s.comm is CommPattern.P2P:  # one peer per step
            dst, src = (r - x.peers[0]) % P, (r + x.peers[0]) % P
            sent = self.local_blocks[j] if self.send4 is None else self.send4[dst, j]
            return eng.sendrecv(sent, dst, self.recv[j, src], src, what)
        self.own_in_recv.add(j)
        if self.send4 is not None:
            return eng.all_to_all(self.recv[j].view(P * self.sub, self.K),
                                  self.send4[:, j].contiguous(), what)
        return eng.all_gather(self.recv[j], self.local_blocks[j].contiguous(), what)

    def compute(self, op: Compute) -> None:
        """GEMM piece `op` on its blocks, in (rank, sub-chunk) order."""
        coords = sorted(((self.r + b.shard) % self.P, b.sub) for b in op.blocks)
        if self.gemm is not None:
            self._rows_by(self.gemm, coords)
        elif self.axis is Axis.M:
            self._rows(coords)
        else:
            self._columns(coords, op.first)

    def _rows_by(self, gemm: RowGemm, coords: list[tuple[int, int]]) -> None:
        """A piece over row blocks computed by `gemm`: its blocks' rows side by side, their
        global row numbers beside them, each block's product put back in its rows."""
        P, c, sub = self.P, self.c, self.sub
        x = _cat([self.block(q, j) for q, j in coords], 0)
        rows = _block_rows(coords, self.m_shard, sub, x.device)
        for i, (w, out) in enumerate(zip(self.weights, self.outs, strict=True)):
            y = gemm(i, x, w, rows)
            o4 = out.view(P, c, sub, out.shape[1])
            for n, (q, j) in enumerate(coords):
                o4[q, j].copy_(y[n * sub:(n + 1) * sub])

    def _rows(self, coords: list[tuple[int, int]]) -> None:
        """A piece over row blocks: whole-local, one whole step, one step in place (a GEMM per
        run of adjacent ranks), or gathered from anywhere (copied)."""
        P, r, c, sub, K = self.P, self.r, self.c, self.sub, self.K
        steps = {j for _, j in coords}
        j0 = next(iter(steps)) if len(steps) == 1 else None
        whole_local = len(coords) == c and all(q == r for q, _ in coords)
        whole_step = j0 is not None and j0 in self.own_in_recv and len(coords) == P
        if not (whole_local or whole_step) and j0 is not None and (
                j0 in self.own_in_recv or all(q != r for q, _ in coords)):
            self._one_step_in_place(j0, [q for q, _ in coords])
            return
        x = (self.own if whole_local else self.recv[j0].view(P * sub, K) if whole_step
             else _cat([self.block(q, j) for q, j in coords], 0))
        for w, out in zip(self.weights, self.outs, strict=True):
            o4 = out.view(P, c, sub, out.shape[1])
            if whole_local:
                _mm(x, w, sub, out=out[r * self.m_shard:(r + 1) * self.m_shard])
            elif len(coords) == 1:
                _mm(x, w, sub, out=o4[coords[0]])
            elif whole_step and c == 1:
                _mm(x, w, sub, out=out)
            else:  # the product of gathered blocks goes back to each block's rows
                y = _mm(x, w, sub)
                for i, (q, j) in enumerate(coords):
                    o4[q, j].copy_(y[i * sub:(i + 1) * sub])

    def _one_step_in_place(self, j0: int, ranks: list[int]) -> None:
        """Blocks of step `j0`, all in recv[j0]: a GEMM per run of adjacent ranks, written
        straight to their rows (a strided batch when c > 1)."""
        P, c, sub, K = self.P, self.c, self.sub, self.K
        for q0, q1 in _runs(ranks):
            x = self.recv[j0, q0:q1]
            for w, out in zip(self.weights, self.outs, strict=True):
                if c == 1:  # its output rows are adjacent too
                    _mm(x.view(-1, K), w, sub, out=out[q0 * sub:q1 * sub])
                else:  # a block's rows every c blocks
                    _mm(x, w, sub, out=out.view(P, c, sub, out.shape[1])[q0:q1, j0])

    def _columns(self, coords: list[tuple[int, int]], first: bool) -> None:
        """A piece over column blocks (axis K): the first writes the output, the rest add."""
        P, r, c, sub = self.P, self.r, self.c, self.sub
        own_cols = coords == [(r, j) for j in range(c)]  # our own columns: a_shard itself
        x = self.a_shard if own_cols else _cat([self.block(q, j) for q, j in coords], 1)
        for w, out in zip(self.weights, self.outs, strict=True):
            w4 = w.view(P, c, sub, w.shape[1])
            wr = (w[r * self.k_shard:(r + 1) * self.k_shard] if own_cols
                  else _cat([w4[q, j] for q, j in coords], 0))
            if first:
                torch.mm(x, wr, out=out)
            else:
                out.addmm_(x, wr)

    def gathered(self) -> torch.Tensor:
        """The gathered A (rank-major rows, or columns for axis K)."""
        recv, own, P, r, c = self.recv, self.own, self.P, self.r, self.c
        if self.axis is Axis.M:
            m_shard, K = own.shape
            if c == 1:  # recv[0] is the gathered matrix, rank-major
                if 0 not in self.own_in_recv:
                    recv[0, r].copy_(own)
                return recv[0].view(P * m_shard, K)
            a = torch.empty((P * m_shard, K), device=own.device, dtype=own.dtype)
            a.view(P, c, m_shard // c, K).copy_(recv.transpose(0, 1))
            a[r * m_shard:(r + 1) * m_shard] = own
            return a
        M, k_shard = own.shape
        a = torch.empty((M, P * k_shard), device=own.device, dtype=own.dtype)
        a.view(M, P, c, k_shard // c).copy_(recv.permute(2, 1, 0, 3))
        a[:, r * k_shard:(r + 1) * k_shard] = own
        return a


def matmul_reduce_scatter(rt: Group, a: torch.Tensor, w: torch.Tensor, s: Schedule,
                          label: str, exchange: bool = False, gemm: RowGemm | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows of shard `rank` of reduce_scatter(a @ w) (sum over ranks).

    `exchange`: all_to_all(a @ w) instead: row chunk q of the product goes to rank q, and the
    result is the chunks every rank computed for this one, by source rank (no sum). A weight
    (E, K, N) holds E local experts, as in `all_gather_matmul`. `gemm`: each piece's product
    computed by it, partials and result in `out_dtype` (as in `all_gather_matmul`)."""
    if rt.world == 1:
        s = Schedule()  # nothing to overlap; recorded as what ran
    sc = _Scatter(rt, a, w, s, label, exchange, gemm, out_dtype)
    with traced(lambda: _call(rt, a.shape[0], w.shape[-1], a.shape[1], a.dtype).range()):
        _walk(lower(s, rt.world, "out", reduces=not exchange), sc.issue, sc.compute,
              sc.reduce, label)
        return sc.finish()


class _Scatter:
    """One GEMM -> reduce-scatter (or all-to-all combine) call: the consumption of the inputs
    (`compute`: a GEMM piece producing partial blocks for their destination ranks), the
    transport (`issue`: a lowered transfer sending them), and the reduction of what arrived."""

    def __init__(self, rt: Group, a: torch.Tensor, w: torch.Tensor, s: Schedule, label: str,
                 exchange: bool, gemm: RowGemm | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        P, r, c = rt.world, rt.rank, s.steps
        self.rt, self.a, self.w, self.s, self.label = rt, a, w, s, label
        self.P, self.r, self.c, self.gemm = P, r, c, gemm
        M, K = a.shape
        N = self.N = w.shape[-1]
        self.m_shard = M // P
        sub = self.sub = self.m_shard // c
        device, dtype = a.device, out_dtype or a.dtype  # the partials' and the result's
        self.a4 = a.view(P, c, sub, K)
        self.out = torch.empty((M if exchange else self.m_shard, N), device=device, dtype=dtype)
        self.partial: dict[tuple[int, int], torch.Tensor] = {}
        self.whole: list[torch.Tensor] = []  # the full product when one piece computed it all
        # recv[offset, j]: the block rank - offset sent; exchanging, it lands in its output rows.
        self.recv = torch.empty((P, c, sub, N) if not exchange else (0,), device=device,
                                dtype=dtype)
        self.o4 = self.out.view(P, c, sub, N) if exchange else None
        self.exchanged: dict[int, torch.Tensor] = {}  # step -> all-to-all output, by source
        self.step_rows: dict[int, torch.Tensor] = {}  # step -> every rank's partial, in order
        self.spare = torch.empty((sub, N), device=device, dtype=dtype)  # for our own block
        rt.records.append(CallRecord(
            "matmul_all_to_all" if exchange else "matmul_reduce_scatter", str(s),
            rt.engine_name(s.engine, device), (tuple(a.shape), tuple(w.shape)), P, label))
        self.peer = rt.peer(device) if s.engine is Engine.DMA and P > 1 else None
        self.block_bytes = sub * N * self.out.element_size()
        if self.peer is not None:
            self.peer.begin(P * c * self.block_bytes, slots=P * c)

    def compute(self, op: Compute) -> None:
        """GEMM piece `op`: the partial blocks of its (destination rank, sub-chunk) rows."""
        P, r, c, sub, N = self.P, self.r, self.c, self.sub, self.N
        a, w = self.a, self.w
        coords = sorted(((r + b.shard) % P, b.sub) for b in op.blocks)
        if self.gemm is not None:  # its blocks' rows side by side, their row numbers beside
            y = self.gemm(0, _cat([self.a4[q, j] for q, j in coords], 0), w,
                          _block_rows(coords, self.m_shard, sub, a.device))
            for i, qj in enumerate(coords):
                self.partial[qj] = y[i * sub:(i + 1) * sub]
        elif len(coords) == P * c:  # the whole product, canonical order
            self.whole.append(_mm(a, w, sub))
            y = self.whole[0].view(P, c, sub, N)
            self.partial.update({(q, j): y[q, j] for q, j in coords})
        elif len({j for _, j in coords}) == 1:  # one step: a GEMM per run of adjacent blocks
            j0 = coords[0][1]
            for q0, q1 in _runs([q for q, _ in coords]):
                if c == 1:  # adjacent rows of `a`
                    y = _mm(a[q0 * sub:q1 * sub], w, sub).view(q1 - q0, sub, N)
                else:  # a block's rows every c blocks: a strided batch
                    y = _mm(self.a4[q0:q1, j0], w, sub)
                self.partial.update({(q, j0): y[q - q0] for q in range(q0, q1)})
                if (q0, q1) == (0, P):  # the step's reduce-scatter input as it is
                    self.step_rows[j0] = y.view(P * sub, N)
        elif coords == [(r, j) for j in range(c)]:  # our own rows: adjacent already
            y = _mm(a[r * self.m_shard:(r + 1) * self.m_shard], w, sub)
            self.partial.update({(r, j): y[j * sub:(j + 1) * sub] for j in range(c)})
        else:
            y = _mm(_cat([self.a4[q, j] for q, j in coords], 0), w, sub)
            for i, qj in enumerate(coords):
                self.partial[qj] = y[i * sub:(i + 1) * sub]

    def _landing(self, b: Block) -> torch.Tensor:
        """Where the block from rank r - b.shard lands."""
        if self.o4 is None:
            return self.recv[b.shard, b.sub]
        return self.o4[(self.r - b.shard) % self.P, b.sub]

    def issue(self, x: Transfer) -> Handle:
        """Send the partial blocks of transfer `x` (and receive the ones for us)."""
        P, r, c, sub = self.P, self.r, self.c, self.sub
        what = f"{self.label} {x.name}"
        if self.peer is not None:
            (b,) = x.blocks
            slot = b.shard * c + b.sub
            self.peer.publish(slot, slot * self.block_bytes,
                              self.partial[((r + b.shard) % P, b.sub)],
                              readers=[(r + b.shard) % P])
            return self.peer.pull((r - b.shard) % P, slot, slot * self.block_bytes,
                                  self._landing(b), what)
        eng = self.rt.collective()
        j = x.blocks[0].sub
        whole = self.whole[0] if self.whole and c == 1 else None
        if x.reduce:  # reduce-scatter kernel over step j: every rank's partial, rank order
            inp = whole if whole is not None else self.step_rows.get(j)
            if inp is None:
                inp = torch.cat([self.partial[(q, j)] for q in range(P)])
            return eng.reduce_scatter(self.out[j * sub:(j + 1) * sub], inp, what)
        if len(x.blocks) > 1:  # all-to-all over step j; our own block is not sent anywhere
            inp = whole if whole is not None else torch.cat(
                [self.partial.get((q, j), self.spare) for q in range(P)])
            self.exchanged[j] = self.out if c == 1 else torch.empty_like(inp)
            return eng.all_to_all(self.exchanged[j], inp, what)
        (b,) = x.blocks
        return eng.sendrecv(self.partial[((r + b.shard) % P, j)], (r + b.shard) % P,
                            self._landing(b), (r - b.shard) % P, what)

    def reduce(self, op: Reduce) -> None:
        """Our own partial plus every peer's, for our rows (the copy engines cannot add)."""
        o = self.out.view(self.c, self.sub, self.N)
        for j in range(self.c):
            o[j].copy_(self.partial[(self.r, j)])
        o.add_(self.recv[1:].sum(0))

    def finish(self) -> torch.Tensor:
        """The result, once every op ran: our rows (exchanging: the received steps and our
        own block put in place)."""
        if self.P == 1:
            self.out.copy_(self.partial[(0, 0)])
        elif self.o4 is not None:
            for j in range(self.c):
                if j in self.exchanged and self.exchanged[j] is not self.out:
                    self.o4[:, j].copy_(self.exchanged[j].view(self.P, self.sub, self.N))
                self.o4[self.r, j].copy_(self.partial[(self.r, j)])
        if self.peer is not None:
            self.peer.end()
        return self.out


def _block_rows(coords: list[tuple[int, int]], shard_rows: int, sub: int,
                device: torch.device) -> Callable[[], torch.Tensor]:
    """How to make the row numbers, in the whole (rank-major) matrix, of blocks (rank,
    sub-chunk) laid one after the other: made only when a GEMM asks (row-wise scales), and on
    the device itself, without a host list copied over (a copy from pageable host memory
    would synchronize the stream on every piece)."""
    def rows() -> torch.Tensor:
        starts = [q * shard_rows + j * sub for q, j in coords]
        return torch.cat([torch.arange(s, s + sub, device=device) for s in starts])
    return rows


def _walk(ops: tuple[PlanOp, ...], issue: Callable[[Transfer], Handle],
          compute: Callable[[Compute], None], reduce: Callable[[Reduce], None] | None,
          label: str) -> None:
    """Run ops in plan order, the transport (`issue`) and the consumption (`compute`,
    `reduce`) injected: every transfer is issued as soon as its producers are done, and
    waited just before the first op that consumes it."""
    pending = _Pending()
    done: set[str] = set()
    transfers = [op for op in ops if isinstance(op, Transfer)]
    for op in ops:
        # Issue every transfer whose producers are done before blocking on compute.
        for x in transfers:
            if x.name not in done and all(d in done for d in x.deps):
                with traced(tracing.op_range, label, x.name):
                    pending.add(x.name, issue(x))
                done.add(x.name)
        if isinstance(op, Transfer):
            continue
        pending.wait(op.deps)
        with traced(tracing.op_range, label, op.name):
            if isinstance(op, Compute):
                compute(op)
            elif reduce is not None:
                reduce(op)
        done.add(op.name)
    pending.wait_all()

