"""Parallel layers overlapped by a schedule.

`ColumnParallelLinear`: input sharded along the sequence (dim `seq_dim`), all-gathered and
multiplied by this rank's column block of the weight (QKV, FC1). `RowParallelLinear`: input
sharded along its features, multiplied by this rank's row block and reduce-scattered back to the
sequence-sharded layout (out-proj, FC2). `ExpertParallelMLP`: one or more experts per rank;
tokens routed to each rank's experts are exchanged all-to-all (dispatch), run through their
expert's MLP and sent back (combine). Each takes a schedule, or a plan written by
`plait explore --json` and the pair name to look up (`qkv`, `fc1`, ...; the backward pair is
`<name>_dgrad`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from plait.errors import SpecError
from plait.ops import (
    GroupLike,
    all_gather_matmul,
    all_to_all_matmul,
    group_key,
    matmul_all_to_all,
    matmul_reduce_scatter,
    runtime_of,
)
from plait.schedule.schedule import SEQUENTIAL, Choice, Schedule, ScheduleLike, as_choice
from plait.workload.operators import Role, gradient_name


@dataclass(frozen=True)
class Plan:
    """Pair name -> schedule, and what the plan was made for: per pair (from an `explore
    --json` file) the group size and the GEMM's per-rank N and K it was chosen at. A mapping
    given directly records nothing and is taken as it is."""

    schedules: dict[str, Choice]  # a schedule, or "auto": tuned in the job
    made_for: str = ""  # "plan.json (llama3-8b, tp=8 on h100-8)"
    shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # ranks, n, k

    def pick(self, name: str, backward: bool, world: int | None = None,
             shape: tuple[int, int] | None = None) -> Choice | None:
        """The schedule of pair `name` (its `_dgrad` with `backward`: None when absent).
        With `world` and `shape` (the layer's per-rank GEMM N and K), a plan made for
        another group size or other shapes is refused: its schedules were chosen there."""
        key = gradient_name(name, Role.DATA_GRAD) if backward else name
        if key not in self.schedules:
            if backward:
                return None
            raise SpecError("name", f"{key!r} is not in the plan",
                            f"use one of {', '.join(self.schedules)}")
        made = self.shapes.get(name)
        if made is not None and world is not None and made[0] != world:
            raise SpecError("plan", f"{self.made_for} chose {name!r} for a group of "
                            f"{made[0]} ranks, but it runs on {world}",
                            f"run `plait explore` with --tp {world} (or --ep) for this group")
        if made is not None and shape is not None and made[1:] != shape:
            raise SpecError("plan", f"{self.made_for} chose {name!r} for a GEMM with N={made[1]}"
                            f", K={made[2]} per rank, but this layer's is N={shape[0]}, "
                            f"K={shape[1]}", "run `plait explore -m` with this model's config")
        return self.schedules[key]


PlanLike = Plan | Mapping[str, ScheduleLike] | str | Path


PLAN_FILE = "pass the file written by `plait plan --json` or `plait explore --json`"


def load_plan(plan: PlanLike) -> Plan:
    """A plan from a mapping (pair name -> schedule), or a `plait plan --json` or `plait
    explore --json` file."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan({str(k): as_choice(v) for k, v in plan.items()})
    path = Path(plan)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError as exc:
        raise SpecError("plan", f"cannot read {path}: {exc}",
                        PLAN_FILE) from exc
    return _read_plan(path, stamp)


@functools.lru_cache(maxsize=16)
def _read_plan(path: Path, stamp: int) -> Plan:
    """The plan file `path` as it was at modification time `stamp`: read once for all the
    layers that name it (a model's every linear does)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError("plan", f"cannot read {path}: {exc}",
                        PLAN_FILE) from exc
    if not isinstance(data, dict) or not isinstance(data.get("plan"), dict):
        raise SpecError("plan", f"{path} has no 'plan' mapping",
                        PLAN_FILE)
    model, par, hw = data.get("model"), data.get("parallel"), data.get("hardware")
    about = [str(model.get("name")) if isinstance(model, dict) else None,
             f"tp={par.get('tp')}" if isinstance(par, dict) else None,
             f"on {hw.get('name', hw) if isinstance(hw, dict) else hw}" if hw else None]
    shapes = {}
    for pair in data.get("pairs") or []:
        try:
            shapes[str(pair["name"])] = (int(pair["ranks"]), int(pair["gemm"]["n"]),
                                         int(pair["gemm"]["k"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError("plan", f"{path}: a pair without name, ranks and gemm n, k "
                            f"({exc})", PLAN_FILE
                            ) from exc
    return Plan({str(k): as_choice(str(v)) for k, v in data["plan"].items()},
                f"{path} ({', '.join(a for a in about if a)})", shapes)


def pick_schedules(name: str | None, schedule: ScheduleLike | None, plan: PlanLike | None,
                   world: int | None = None, shape: tuple[int, int] | None = None
                   ) -> tuple[Choice, Choice | None]:
    """A layer's forward schedule (`schedule`, or the plan's pair `name`; sequential when
    neither says) and its backward one (the plan's `<name>_dgrad`; None: the forward's dual
    default). With a plan, `world` and `shape` (the layer's per-rank GEMM N, K) are checked
    against what the plan was made for (`Plan.pick`)."""
    if plan is None:
        return SEQUENTIAL if schedule is None else as_choice(schedule), None
    if name is None:
        raise SpecError("name", "a plan was given without the pair name to look up",
                        "pass name='qkv' (or fc1, out_proj, fc2, ...)")
    table = load_plan(plan)
    return (table.pick(name, False, world, shape) or SEQUENTIAL, table.pick(name, True))


class _Shared:
    """A group a module communicates on, held so that a deep copy of the module shares it (a
    process group cannot be copied; PyTorch's `DeviceMesh` is shared the same way)."""

    __slots__ = ("group",)

    def __init__(self, group: GroupLike) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, object]) -> _Shared:
        return self


class _OnGroup:
    """A module's `group`, shared by its deep copies (`_Shared`)."""

    _shared_group: _Shared

    @property
    def group(self) -> GroupLike:
        return self._shared_group.group

    @group.setter
    def group(self, group: GroupLike) -> None:
        object.__setattr__(self, "_shared_group", _Shared(group))


class _ParallelLinear(_OnGroup, nn.Module):
    _sharded = ""  # "out_features" (column parallel) or "in_features" (row parallel)

    def __init__(self, in_features: int, out_features: int, group: GroupLike = None, *,
                 seq_dim: int = 0, schedule: ScheduleLike | None = None,
                 plan: PlanLike | None = None, name: str | None = None, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        world = runtime_of(group).world
        size = {"in_features": in_features, "out_features": out_features}[self._sharded]
        if size % world:
            raise SpecError(self._sharded, f"{size} is not divisible by the group size {world}",
                            f"use a multiple of {world}")
        weight_shape = ((out_features // world, in_features) if self._sharded == "out_features"
                        else (out_features, in_features // world))
        self.group, self.seq_dim, self.name = group, seq_dim, name
        mark_plait(self, group)
        self.schedule, self.backward_schedule = pick_schedules(name, schedule, plan, world,
                                                               weight_shape)
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        # column: this rank's out/P entries of the bias; row: the whole bias, added to this
        # rank's sequence shard after the reduce-scatter (its gradient then holds only this
        # rank's tokens: all-reduce it over the group, as for any sequence-parallel parameter)
        n_bias = weight_shape[0]
        self.bias = (nn.Parameter(torch.empty(n_bias, device=device, dtype=dtype)) if bias
                     else None)
        self.reset_parameters(in_features, out_features)

    def reset_parameters(self, in_features: int, out_features: int) -> None:
        """nn.Linear's initialization of the whole layer, of which this rank keeps its slice:
        the whole weight (out, in) and bias drawn as nn.Linear draws them (uniform within
        1/sqrt(in_features), from the default generator, which advances as nn.Linear's
        would), so with the same seed on every rank the shards are slices of the one layer
        that `nn.Linear(in_features, out_features)` would have made. The whole layer exists
        on the CPU for the moment of the draw."""
        rt = runtime_of(self.group)
        bound = 1 / math.sqrt(in_features)
        with torch.no_grad():
            weight = torch.empty(out_features, in_features).uniform_(-bound, bound)
            bias = torch.empty(out_features).uniform_(-bound, bound) if self.bias is not None \
                else None
            column = self._sharded == "out_features"
            self.weight.copy_(weight.chunk(rt.world, 0 if column else 1)[rt.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias.chunk(rt.world)[rt.rank] if column else bias)


class ColumnParallelLinear(_ParallelLinear):
    """y[:, local out] = all_gather(x, seq_dim) @ W_local.T; `weight` is (out/P, in)."""

    _sharded = "out_features"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (y,) = all_gather_matmul(x, [self.weight.T], self.group, gather_dim=self.seq_dim,
                                    schedule=self.schedule,
                                    backward_schedule=self.backward_schedule,
                                    return_gathered=False)
        y = y.contiguous()  # gathering a later dimension returns PyTorch's strided view
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ParallelLinear):
    """y = reduce_scatter(x_local @ W_local.T, seq_dim); `weight` is (out, in/P)."""

    _sharded = "in_features"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_reduce_scatter(x, self.weight.T, self.group, scatter_dim=self.seq_dim,
                                  schedule=self.schedule,
                                  backward_schedule=self.backward_schedule)
        return y if self.bias is None else y + self.bias


def mlp_activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """The MLP's activation on this rank's FC1 columns: SwiGLU (`gated`: the columns hold gate
    then up, `silu(gate) * up`), else GELU."""
    if not gated:
        return torch.nn.functional.gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class SequenceParallelMLP(nn.Module):
    """The MLP of plait's one layer description (`workload.transformer.build_layer`) on this
    rank's sequence shard: `fc1` column-parallel (all-gather -> GEMM; `gated`: gate and up),
    SwiGLU or GELU (`mlp_activation`), `fc2` row-parallel (GEMM -> reduce-scatter). Schedules:
    `schedule` (and `fc2_schedule`), or a plan's `fc1` and `fc2`."""

    def __init__(self, hidden: int, ffn: int, group: GroupLike = None, *, gated: bool = True,
                 seq_dim: int = 0, schedule: ScheduleLike | None = None,
                 fc2_schedule: ScheduleLike | None = None, plan: PlanLike | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.gated = gated
        self.fc1 = ColumnParallelLinear(hidden, (1 + gated) * ffn, group, seq_dim=seq_dim,
                                        schedule=schedule, plan=plan, name="fc1",
                                        device=device, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn, hidden, group, seq_dim=seq_dim,
                                     schedule=fc2_schedule or schedule, plan=plan, name="fc2",
                                     device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc2(mlp_activation(self.fc1(x), self.gated))
        return y


class ExpertParallelMLP(_OnGroup, nn.Module):
    """`experts` local experts per rank: `forward(x)` takes this rank's tokens grouped by
    destination rank and expert (equal-capacity row chunks: chunk q for the experts on rank q,
    each chunk `experts` equal groups of rows, group e for q's expert e), sends each chunk to
    its rank (all-to-all overlapped with FC1), runs each expert's MLP on its rows, and sends
    the results back (FC2 overlapped with the all-to-all): the output rows line up with the
    input rows.

    `gated`: SwiGLU (FC1 makes gate and up, `silu(gate) * up`), else GELU. Schedules: `fc1` for
    the dispatch pair, `fc2` for the combine pair, from `schedule`/`fc2_schedule` or a plan
    (names `fc1`, `fc2` and their `_dgrad`). Weights: `fc1` (up, hidden) and `fc2` (hidden,
    ffn) for one expert, (experts, up, hidden) and (experts, hidden, ffn) for several.
    """

    def __init__(self, hidden: int, ffn: int, group: GroupLike = None, *, experts: int = 1,
                 gated: bool = True, schedule: ScheduleLike | None = None,
                 fc2_schedule: ScheduleLike | None = None, plan: PlanLike | None = None,
                 names: tuple[str, str] = ("fc1", "fc2"),
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if experts < 1:
            raise SpecError("experts", f"{experts} local experts", "use 1 or more")
        self.group, self.gated, self.experts = group, gated, experts
        mark_plait(self, group)
        self.capacity_factor = 1.0  # of the last `routed` call
        up = 2 * ffn if gated else ffn
        world = runtime_of(group).world
        self.schedules = [pick_schedules(n, sch, plan, world, shape)
                          for n, sch, shape in zip(names, (schedule, fc2_schedule or schedule),
                                                   ((up, hidden), (hidden, ffn)), strict=True)]
        lead = () if experts == 1 else (experts,)
        self.fc1 = nn.Parameter(torch.empty(*lead, up, hidden, device=device, dtype=dtype))
        self.fc2 = nn.Parameter(torch.empty(*lead, hidden, ffn, device=device, dtype=dtype))
        # every expert of the group as its own nn.Linear would start (its full fan-in), drawn
        # for all ranks x experts from the default generator: this rank keeps its experts'
        # slice, so with one seed everywhere the ranks' experts differ and are reproducible
        rt = runtime_of(group)
        with torch.no_grad():
            for w in (self.fc1, self.fc2):
                shape = w.shape[-2:]
                every = torch.empty(rt.world * experts, *shape).uniform_(
                    -1 / math.sqrt(shape[1]), 1 / math.sqrt(shape[1]))
                w.view(-1, *shape).copy_(every[rt.rank * experts:(rt.rank + 1) * experts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (s1, b1), (s2, b2) = self.schedules
        _, h = all_to_all_matmul(x, self.fc1.transpose(-1, -2), self.group, schedule=s1,
                                 backward_schedule=b1, return_received=False)
        h = mlp_activation(h, self.gated)
        return matmul_all_to_all(h, self.fc2.transpose(-1, -2), self.group, schedule=s2,
                                 backward_schedule=b2)

    def routed(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor | None = None,
               capacity: int | None = None) -> tuple[torch.Tensor, int]:
        """Route this rank's tokens to their experts and back: the MoE layer around `forward`.

        `x` (tokens, hidden); `experts` (tokens, k) global expert ids, expert i living on rank
        i // experts as its local expert i % experts; `gates` (tokens, k) scale each expert's
        output (default 1). Every (token, choice) takes a slot of its expert's rows from this
        rank, in token order. `capacity` slots per expert and rank; None: dropless, the most
        that any rank sends any expert (one all-reduce), so nothing is dropped and every rank
        pads to it. Capacity is rounded up so that the schedules' sub-chunks split it. Returns
        sum_k gates[:, k] * expert_k(x) and how many choices this rank dropped; leaves the
        rows sent over balanced routing in `self.capacity_factor` (what `plait explore
        --capacity-factor` takes)."""
        if experts.dim() == 1:
            experts = experts[:, None]
        if experts.shape[0] != x.shape[0]:
            raise SpecError("experts", f"{experts.shape[0]} rows for {x.shape[0]} tokens",
                            "pass one row of expert ids per token")
        rt = runtime_of(self.group)
        n = rt.world * self.experts
        flat = experts.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < n:
            raise SpecError("experts", f"ids outside 0..{n - 1}",
                            f"route to the {n} experts of {rt.world} ranks x {self.experts}")
        slot, counts = expert_slots(flat, n)
        if capacity is None:
            most = counts.max().reshape(1)
            torch.distributed.all_reduce(most, torch.distributed.ReduceOp.MAX, group=rt.group)
            capacity = int(most)
        step = math.lcm(*(x.steps for pair in self.schedules for x in pair  # "auto" proposes
                          if isinstance(x, Schedule)))  # only schedules that split the rows
        capacity = max(step, -(-capacity // step) * step)
        # the rows this rank sends, over what balanced routing would send: what
        # `plait explore --capacity-factor` models
        self.capacity_factor = n * capacity / max(1, flat.numel())
        keep = slot < capacity
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(experts.shape[1])
        rows = (flat * capacity + slot)[keep]  # (rank, local expert, slot) order
        packed = x.new_zeros(n * capacity, x.shape[1]).index_put((rows,), x[token[keep]])
        out = self(packed)[rows]
        if gates is not None:
            out = out * gates.reshape(-1)[keep, None]
        return x.new_zeros(x.shape).index_add(0, token[keep], out), int((~keep).sum())


def expert_slots(flat: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one routing rule of plait's MoE layers: each (token, choice) copy, `flat` in token
    order, takes the next slot of its expert's rows (its rank among the copies routed to that
    expert before it); copies at or beyond a capacity are dropped by the caller. The slots,
    and how many copies each of the `experts` got."""
    counts = torch.bincount(flat, minlength=experts)
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    return slot, counts


_GROUP_ATTR = "_plait_group"  # set by the plait.parallel styles on the modules they parallelize
_SHARD_ATTR = "_plait_shard_of"  # on a plain parameter holding one rank's shard over a group


def mark_sharded(param: nn.Parameter, group: GroupLike) -> None:
    """Record that plain parameter `param` holds this rank's shard over `group`
    (`clip_grad_norm_` sums its squares over the group)."""
    setattr(param, _SHARD_ATTR, _Shared(group))


def mark_plait(module: nn.Module, group: GroupLike) -> None:
    """Record that `module` communicates through plait's ops on `group` (plait's layers do so
    for themselves, the `plait.parallel` styles for each module they parallelize), so
    `plait_groups` and `outside_plait` find it."""
    object.__setattr__(module, _GROUP_ATTR, _Shared(group))


def plait_groups(module: nn.Module) -> list[GroupLike]:
    """The groups on which `module` and its submodules communicate through plait's ops, in
    module order, each once: plait's own layers, and modules parallelized by a
    `plait.parallel` style (all marked by `mark_plait`)."""
    found: dict[str, GroupLike] = {}
    for m in module.modules():
        if hasattr(m, _GROUP_ATTR):
            group = getattr(m, _GROUP_ATTR).group
            found.setdefault(group_key(group), group)
    return list(found.values())


def outside_plait(module: nn.Module) -> str | None:
    """The first parameter (its path, and why) that communicates outside plait's ops, or
    None: a `DTensor` parameter sharded over a mesh, unless it lies in a module a
    `plait.parallel` style parallelized and its mesh has one dimension. PyTorch's own
    Colwise/Rowwise styles gather or reduce such a parameter's activations, FSDP gathers it
    before the forward and reduce-scatters its gradient; a module wrapped in
    `DistributedDataParallel` all-reduces its gradients in backward. Replicated `DTensor` parameters
    (`SequenceParallel`'s norms) communicate nothing in a step."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    for path, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):  # all-reduces gradients in backward
            return f"{path or type(module).__name__}: wrapped in DistributedDataParallel"
    marked = [path for path, m in module.named_modules() if hasattr(m, _GROUP_ATTR)]
    for path, m in module.named_modules():
        ours = any(path == a or path.startswith(f"{a}.") or a == "" for a in marked)
        for name, p in m.named_parameters(recurse=False):
            if not isinstance(p, DTensor) or not any(x.is_shard() for x in p.placements):
                continue
            if ours and p.device_mesh.ndim == 1:
                continue
            why = ("sharded over a mesh of several dimensions (FSDP)" if ours else
                   f"a DTensor sharded {list(p.placements)} outside plait's styles")
            return f"{path or type(module).__name__}.{name}: {why}"
    return None


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model with plait's parallel layers: the norm of
    the whole model's gradient, every rank the same. A parallel layer's parameters are shards
    (their squares summed over its group), as are the plain shards of `plait.parallel`'s
    styles under `local=True`; a `DTensor` gradient counts as the whole it stands for; every
    other parameter is replicated (counted once). Scales the gradients in place by
    min(1, max_norm / norm); returns the norm."""
    if norm_type != 2.0:
        raise SpecError("norm_type", f"{norm_type} is not supported", "use the 2-norm")
    sharded: dict[int, GroupLike] = {}
    for m in model.modules():
        if isinstance(m, ExpertParallelMLP):
            shards = list(m.parameters(recurse=False))
        elif isinstance(m, _ParallelLinear):  # a row layer's bias is whole on every rank
            shards = [m.weight, *([m.bias] if isinstance(m, ColumnParallelLinear)
                                  and m.bias is not None else [])]
        else:
            continue
        for p in shards:
            sharded[id(p)] = m.group
    for p in model.parameters():  # plain shards of `plait.parallel`'s styles (local=True)
        if hasattr(p, _SHARD_ATTR):
            sharded[id(p)] = getattr(p, _SHARD_ATTR).group
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64, device=grads[0][1].device)
    by_group: dict[str, torch.Tensor] = {}
    for p, g in grads:
        if isinstance(g, DTensor):  # a DTensor (a style's default, the ends of local=True)
            total = total + torch.linalg.vector_norm(
                g.detach(), dtype=torch.float64).full_tensor().square()
            continue
        sq = g.detach().double().square().sum()
        if id(p) in sharded:
            key = group_key(sharded[id(p)])
            by_group[key] = by_group.get(key, torch.zeros_like(total)) + sq
        else:
            total = total + sq
    for key, sq in by_group.items():
        torch.distributed.all_reduce(sq, group=runtime_of(key).group)  # every rank's shard
        total = total + sq
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for _, g in grads:
        d = g.detach()
        local = d.to_local() if isinstance(d, DTensor) else d
        local.mul_(scale.to(local.dtype))  # a DTensor scaled shard by shard
    return norm.to(grads[0][1].dtype)
