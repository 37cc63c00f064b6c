"""Run a training step of a `ShardedModel` on a TP group, plainly or with co-execution.

Plain: every micro-batch runs forward then backward, operator after operator.

Co-executed (DHelix strand interleaving with mirrored-layer folding): the layers pair up as
blocks i = (layer i, layer L-1-i), one copy of the weights. After a warm-up forward of
micro-batch 0, each steady step runs the forward of micro-batch n down the layers while the
backward of micro-batch n-1 comes up them: forward of layer i beside backward of layer L-1-i,
aligned block by block by a `CoexecPlan`. Within a plan block the collectives of both strands are
launched first, then both strands' compute is issued in order, each unit waiting only for the
collective that produces its input. A drain backward of the last micro-batch ends the step.
Gradients accumulate across micro-batches; the replicated parameters' gradients are summed over
the group at the end.

Activation memory is accounted as the bytes of the tensors the strands hold (forward tensors kept
for the backward, gradients in flight), sampled after every unit.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.errors import SpecError
from plait.measure.coexec.small_model import ShardedModel, batches
from plait.measure.coexec.units import backward_units, forward_units, fuse, rms_norm, saved
from plait.measure.coexec.values import LayerParams, Store, Unit
from plait.runtime import strands
from plait.runtime.context import Group
from plait.runtime.engines import CollectiveEngine, Handle
from plait.schedule.coexec import CoexecBlock, CoexecPlan
from plait.schedule.schedule import Schedule


@dataclass
class Memory:
    """Bytes held by live strand stores; `peak` over the step."""

    stores: dict[tuple[int, int], Store] = field(default_factory=dict)  # (mb, layer) -> store
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    peak: int = 0

    def sample(self) -> None:
        seen: set[int] = set()
        total = 0
        for t in [*(v for s in self.stores.values() for v in s.values()), *self.extra.values()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        self.peak = max(self.peak, total)


class Strand:
    """One micro-batch's pass through one layer (forward or backward), unit by unit."""

    def __init__(self, units: tuple[Unit, ...], store: Store, params: LayerParams,
                 comm: CollectiveEngine, memory: Memory) -> None:
        self.units = {u.name: u for u in units}
        self.store, self.params, self.comm, self.memory = store, params, comm, memory
        self.pending: dict[str, Handle] = {}  # output tensor name -> its transfer

    def launch(self, name: str) -> None:
        unit = self.units[name]
        self._wait_for(unit)
        handle = unit.run(self.store, self.params, self.comm)
        assert handle is not None
        for out in unit.outputs:
            self.pending[out] = handle

    def compute(self, name: str) -> None:
        unit = self.units[name]
        self._wait_for(unit)
        unit.run(self.store, self.params, self.comm)
        self.memory.sample()

    def finish(self) -> None:
        for h in list(self.pending.values()):
            h.wait()
        self.pending.clear()

    def _wait_for(self, unit: Unit) -> None:
        for name in unit.inputs:
            h = self.pending.pop(name, None)
            if h is not None:
                h.wait()


def run_blocks(blocks: tuple[CoexecBlock, ...], fwd: Strand | None, bwd: Strand | None) -> int:
    """Execute plan blocks: per block, first launch the collectives that open either strand's
    segment (their inputs come from earlier blocks), then run the rest of each strand in order
    (a collective met later starts when reached; compute waits only for its own inputs). A
    FiCCO unit communicates and computes in one call: the other strand's compute units of the
    block run in its waits on communication (`strands.filling`), so its strand goes first.
    Returns how many units ran so."""
    filled = [0]
    for blk in blocks:
        rest: list[tuple[Strand, deque[str]]] = []
        for strand, names in ((fwd, blk.fwd), (bwd, blk.bwd)):
            if strand is None:
                continue
            i = 0
            while i < len(names) and strand.units[names[i]].collective:
                strand.launch(names[i])
                i += 1
            rest.append((strand, deque(names[i:])))
        if len(rest) == 2 and not _holds_ficco(*rest[0]) and _holds_ficco(*rest[1]):
            rest.reverse()
        for k, (strand, queue) in enumerate(rest):
            other = rest[1 - k] if len(rest) == 2 else None
            while queue:
                n = queue.popleft()
                unit = strand.units[n]
                if unit.collective:
                    strand.launch(n)
                elif unit.fused and other is not None:
                    with strands.filling(functools.partial(_fill, *other, filled)):
                        strand.compute(n)
                else:
                    strand.compute(n)
    for strand in (fwd, bwd):
        if strand is not None:
            strand.finish()
    return filled[0]


def _holds_ficco(strand: Strand, queue: deque[str]) -> bool:
    return any(strand.units[n].fused for n in queue)


def _fill(strand: Strand, queue: deque[str], filled: list[int]) -> None:
    """Run `strand`'s next unit if it only computes."""
    if queue and not (strand.units[queue[0]].collective or strand.units[queue[0]].fused):
        strand.compute(queue.popleft())
        filled[0] += 1


@dataclass
class StepResult:
    loss: float  # summed over micro-batches and the group's tokens
    peak_activation_bytes: int
    grads: dict[str, torch.Tensor]  # same names as `reference_step`
    filled: int = 0  # compute units that ran inside a FiCCO unit's waits


class Trainer:
    """Holds the model, its units and the group; `step(plan)` runs one training step.

    With `fused` (pair name -> FiCCO schedule, run on `rt`), each such pair is one FiCCO unit
    (`fuse`): the warm-up and drain passes use them, and so does a steady plan over the fused
    units' names (`<pair>*`); a plan over the plain units' names runs those."""

    def __init__(self, model: ShardedModel, comm: CollectiveEngine, micro_batches: int,
                 seed: int = 0, fused: Mapping[str, Schedule] | None = None,
                 rt: Group | None = None) -> None:
        self.m, self.comm, self.k = model, comm, micro_batches
        layer = model.layer
        self.plain = (forward_units(layer, model.shape), backward_units(layer, model.shape))
        self.saved = saved(*self.plain)  # what a layer keeps from its forward to its backward
        if fused:
            if rt is None:
                raise ValueError("fused units need the group's runtime (rt)")
            self.fwd_units = fuse(self.plain[0], layer, fused, rt, model.shape, self.saved)
            self.bwd_units = fuse(self.plain[1], layer, fused, rt, model.shape)
        else:
            self.fwd_units, self.bwd_units = self.plain
        self.fwd_names = tuple(u.name for u in self.fwd_units)
        self.bwd_names = tuple(u.name for u in self.bwd_units)
        par = model.parallel
        self.moe = bool(model.shape.experts)
        if self.moe and (par.tp != 1 or par.ep != par.dp):
            raise SpecError("parallel", f"an expert-parallel layer with tp={par.tp}, "
                            f"ep={par.ep}, dp={par.dp}", "co-execute MoE with tp = 1 and "
                            "ep = dp (the group is both the EP and the DP group)")
        # the group's ranks: TP ranks slice one sequence; MoE's are data-parallel replicas
        replica, r = (model.rank, 0) if self.moe else (0, model.rank)
        self.data = batches(model.spec, par, micro_batches, seed, replica)
        s = par.seq_len // par.tp
        dev = model.embed.device
        self.tokens = [(t[r * s:(r + 1) * s].to(dev), lab[r * s:(r + 1) * s].to(dev))
                       for t, lab in self.data]

    # -- pieces of a micro-batch outside the layers ------------------------------------------
    def _embed(self, mb: int, mem: Memory) -> Store:
        store: Store = {"x": self.m.embed[self.tokens[mb][0]]}
        mem.stores[(mb, 0)] = store
        mem.sample()
        return store

    def _head(self, mb: int, out: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Final norm, LM head and loss on this rank's tokens; returns loss and d_out."""
        m, labels = self.m, self.tokens[mb][1]
        x = out.detach().requires_grad_(True)
        g, w = m.g_final.detach().requires_grad_(True), m.head.detach().requires_grad_(True)
        with torch.enable_grad():
            xn = rms_norm(x, g)
            loss = F.cross_entropy(xn @ w, labels, reduction="sum") / m.parallel.seq_len
            dx, dg, dw = torch.autograd.grad(loss, (x, g, w))
        m.accumulate("g_final", dg)
        m.accumulate("head", dw)
        return float(loss.detach()), dx

    def _embed_bwd(self, mb: int, d_x: torch.Tensor) -> None:
        d = torch.zeros_like(self.m.embed)
        d.index_add_(0, self.tokens[mb][0], d_x)
        self.m.accumulate("embed", d)

    # -- layer passes -----------------------------------------------------------------------
    def _fwd_strand(self, mb: int, layer: int, x: torch.Tensor, mem: Memory,
                    units: tuple[Unit, ...] | None = None) -> Strand:
        store = mem.stores.setdefault((mb, layer), {})
        store["x"] = x
        return Strand(units or self.fwd_units, store, self.m.layers[layer], self.comm, mem)

    def _after_fwd(self, mb: int, layer: int, mem: Memory) -> torch.Tensor:
        store = mem.stores[(mb, layer)]
        out = store["out"]
        for k in list(store):  # keep only what the backward reads
            if k not in self.saved:
                del store[k]
        mem.sample()
        return out

    def _bwd_strand(self, mb: int, layer: int, d_out: torch.Tensor, mem: Memory,
                    units: tuple[Unit, ...] | None = None) -> Strand:
        store = mem.stores[(mb, layer)]
        store["d_out"] = d_out
        return Strand(units or self.bwd_units, store, self.m.layers[layer], self.comm, mem)

    def _after_bwd(self, mb: int, layer: int, mem: Memory) -> torch.Tensor:
        d_x = mem.stores.pop((mb, layer))["d_x"]
        mem.extra[f"d{mb}"] = d_x
        mem.sample()
        return d_x

    def _forward_all(self, mb: int, mem: Memory) -> float:
        x = self._embed(mb, mem)["x"]
        for i in range(self.m.spec.layers):
            s = self._fwd_strand(mb, i, x, mem)
            run_blocks((CoexecBlock(self.fwd_names, ()),), s, None)
            x = self._after_fwd(mb, i, mem)
        loss, d = self._head(mb, x)
        mem.extra[f"d{mb}"] = d
        return loss

    def _backward_all(self, mb: int, mem: Memory) -> None:
        d = mem.extra.pop(f"d{mb}")
        for i in reversed(range(self.m.spec.layers)):
            s = self._bwd_strand(mb, i, d, mem)
            run_blocks((CoexecBlock((), self.bwd_names),), None, s)
            d = self._after_bwd(mb, i, mem)
        self._embed_bwd(mb, mem.extra.pop(f"d{mb}"))

    # -- steps --------------------------------------------------------------------------------
    def step(self, plan: CoexecPlan | None) -> StepResult:
        """One training step over the micro-batches: plain when `plan` is None."""
        mem = Memory()
        loss = 0.0
        filled = 0
        L = self.m.spec.layers
        if plan is None or self.k < 2:
            for mb in range(self.k):
                loss += self._forward_all(mb, mem)
                self._backward_all(mb, mem)
        else:
            named = {n for blk in plan.blocks for n in (*blk.fwd, *blk.bwd)}
            fu, bu = ((self.fwd_units, self.bwd_units)
                      if named <= {u.name for u in (*self.fwd_units, *self.bwd_units)}
                      else self.plain)  # a plan over the plain units
            loss += self._forward_all(0, mem)  # warm-up
            for n in range(1, self.k):  # steady: forward n down beside backward n-1 up
                x = self._embed(n, mem)["x"]
                d = mem.extra.pop(f"d{n - 1}")
                for i in range(L):
                    f = self._fwd_strand(n, i, x, mem, fu)
                    b = self._bwd_strand(n - 1, L - 1 - i, d, mem, bu)
                    filled += run_blocks(plan.blocks, f, b)
                    x = self._after_fwd(n, i, mem)
                    d = self._after_bwd(n - 1, L - 1 - i, mem)
                mem.extra.pop(f"d{n - 1}")
                self._embed_bwd(n - 1, d)
                loss_n, dn = self._head(n, x)
                loss += loss_n
                mem.extra[f"d{n}"] = dn
            self._backward_all(self.k - 1, mem)  # drain
        return StepResult(self._total_loss(loss), mem.peak, self._gathered_grads(), filled)

    def _total_loss(self, loss: float) -> float:
        t = torch.tensor([loss], dtype=torch.float64, device=self.m.embed.device)
        dist.all_reduce(t, group=self.comm.group)
        return float(t)

    def _gathered_grads(self) -> dict[str, torch.Tensor]:
        """Replicated parameters' gradients summed over the group; shards named per rank."""
        out: dict[str, torch.Tensor] = {}
        for name in ("embed", "g_final", "head"):
            g = self.m.grads[name].clone()
            dist.all_reduce(g, group=self.comm.group)
            out[name] = g
        replicated = ("g1", "g2", "wqkv", "wo", "wr") if self.moe else ("g1", "g2")
        for i, layer in enumerate(self.m.layers):
            for n in replicated:
                g = layer.grads[n].clone()
                dist.all_reduce(g, group=self.comm.group)
                out[f"{i}.{n}"] = g
            for n in layer.names():
                if n not in replicated:
                    out[f"{i}.{n}.{self.m.rank}"] = layer.grads[n]
        return out
