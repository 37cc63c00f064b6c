"""plait's overlapped linears as PyTorch tensor-parallel styles, for `parallelize_module`.

    from torch.distributed.tensor.parallel import parallelize_module
    from plait.parallel import PlaitColwiseParallel, PlaitRowwiseParallel

    parallelize_module(block, tp_mesh, {"w1": PlaitColwiseParallel(schedule="fine/dma/c2/g1/M"),
                                        "w2": PlaitRowwiseParallel(plan="plan.json", name="fc2")})

An `nn.Linear` given a style keeps its name and parameters, now `DTensor`s sharded over the
mesh (colwise: weight and bias by output rows, `Shard(0)`; rowwise: the weight by input
columns, `Shard(1)`, the bias replicated), so distributed checkpointing and
`torch.nn.utils.clip_grad_norm_` see the whole layer. Its forward runs plait's op under the
schedule (a plan's pair, as in `plait.nn`), sequence-parallel: the colwise input is this
rank's sequence shard (dim `seq_dim`; a `DTensor` is taken local), the rowwise output is again
a sequence shard. Outputs are local tensors, or `DTensor`s with `use_local_output=False`.

`seq_dim` None (the default): the sequence is read from the activations themselves, as the
dimension before the hidden one (`(batch, sequence, hidden)` and flattened `(tokens, hidden)`
alike); a `DTensor` input already sharded along another dimension than a `seq_dim` given is
refused in one line naming both.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from plait.errors import SpecError
from plait.nn import PlanLike, mark_plait, mark_sharded, pick_schedules
from plait.ops import all_gather_matmul, matmul_reduce_scatter, reduce_scatter
from plait.schedule.schedule import ScheduleLike


def seq_dim_of(x: torch.Tensor, seq_dim: int | None) -> int:
    """Where `x` (an activation, hidden last) holds the sequence: `seq_dim` when given
    (normalized), else the dimension before the hidden one."""
    return x.dim() - 2 if seq_dim is None else seq_dim % x.dim()


def sequence_dim(x: torch.Tensor, seq_dim: int | None, who: str) -> int:
    """`seq_dim_of(x, seq_dim)`, for an input that arrives sequence-sharded: a `DTensor`
    sharded along another dimension than the one given disagrees with where it came from (a
    stage's or a layer's `seq_dim`): one line naming both."""
    d = seq_dim_of(x, seq_dim)
    if seq_dim is not None and isinstance(x, DTensor):
        sharded = [p.dim % x.dim() for p in x.placements if isinstance(p, Shard)]
        if sharded and d not in sharded:
            raise SpecError("seq_dim", f"{who} takes the sequence along dim {d} but its "
                            f"input {tuple(x.shape)} arrives sharded along dim {sharded[0]}",
                            "give llama_plan, llama_block_plan and TensorParallelStage the "
                            "same seq_dim, or none (each then reads it from the activations)")
    return d


class _PlaitStyle(ParallelStyle):
    _weight_dim = 0  # the weight dimension sharded: output rows (colwise) or input columns

    def __init__(self, *, seq_dim: int | None = None, schedule: ScheduleLike | None = None,
                 plan: PlanLike | None = None, name: str | None = None,
                 use_local_output: bool = True, local: bool = False) -> None:
        super().__init__()
        self.seq_dim, self.schedule, self.plan, self.name = seq_dim, schedule, plan, name
        self.use_local_output, self.local = use_local_output or local, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        lin = _shard_linear(type(self).__name__, module, device_mesh, self._weight_dim,
                            self.local)
        world = device_mesh.size()
        group = device_mesh.get_group()
        shape = tuple(_local(lin.weight).shape)
        schedule, backward = pick_schedules(self.name, self.schedule, self.plan, world,
                                            (shape[0], shape[1]))
        module.forward = types.MethodType(
            self._forward(group, schedule, backward, device_mesh), module)
        mark_plait(module, group)
        return module

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        raise NotImplementedError


def _shard_linear(style: str, module: nn.Module, mesh: DeviceMesh, dim: int,
                  local: bool = False) -> nn.Linear:
    """`module`'s weight (and bias) as DTensors over the 1-d `mesh`: the weight sharded along
    `dim` (0: output rows, colwise; 1: input columns, rowwise), the bias along its rows with a
    colwise weight, replicated with a rowwise one. `local`: plain parameters holding this
    rank's shard instead (`llama_plan(local=True)`)."""
    if not isinstance(module, nn.Linear):
        raise SpecError(style, f"applies to nn.Linear, not {type(module).__name__}",
                        "give the style to a Linear submodule")
    if mesh.ndim != 1:
        raise SpecError("device_mesh", f"a {mesh.ndim}-d mesh", "pass the TP mesh (a 1-d "
                        "mesh, or mesh['tp'])")
    world, size = mesh.size(), module.weight.shape[dim]
    if size % world:
        raise SpecError(style, f"dimension {dim} of the weight ({size}) does not split over "
                        f"{world} ranks", f"use a layer whose {'out' if dim == 0 else 'in'}"
                        f"_features is a multiple of {world}")
    if local:
        rank, group = mesh.get_local_rank(), mesh.get_group()
        module.weight = nn.Parameter(module.weight.data.chunk(world, dim)[rank].clone())
        mark_sharded(module.weight, group)
        if module.bias is not None:
            module.bias = nn.Parameter(module.bias.data.chunk(world)[rank].clone() if dim == 0
                                       else module.bias.data.clone())
            if dim == 0:
                mark_sharded(module.bias, group)
            else:  # added to this rank's sequence shard: its gradient is partial
                sum_gradient_over(module.bias, group)
        return module
    module.weight = nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(dim)]))
    if module.bias is not None:
        bias = [Shard(0)] if dim == 0 else [Replicate()]
        module.bias = nn.Parameter(distribute_tensor(module.bias.data, mesh, bias))
    return module


def sum_gradient_over(param: nn.Parameter, group: Any) -> None:
    """Sum each gradient `param` receives over `group`'s ranks before it accumulates: a
    parameter replicated on every rank of a sequence-parallel group sees only its rank's
    tokens (a norm's weight, a row-parallel bias; Megatron-LM all-reduces them the same
    way). The sum goes through the strands' turn on the group (a twin communicator for the
    backward strand of `plait.pipelining`'s OVERLAP_F_B), as plait's ops do."""
    import torch.distributed as dist

    from plait.ops import group_key, runtime_of
    from plait.runtime import strands

    key = group_key(group)

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        with strands.turn("replicated_grad", key) as k:
            dist.all_reduce(grad, group=runtime_of(k).group)
        return grad

    param.register_hook(summed)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class PlaitColwiseParallel(_PlaitStyle):
    """all_gather(x, seq_dim) @ W_local.T (+ b_local): QKV, FC1."""

    _weight_dim = 0

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        local_out, who = self.use_local_output, type(self).__name__

        def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            seq_dim = sequence_dim(x, self.seq_dim, who)
            _, (y,) = all_gather_matmul(_local(x), [_local(lin.weight).T], group,
                                        gather_dim=seq_dim, schedule=schedule,
                                        backward_schedule=backward, return_gathered=False)
            y = y.contiguous()  # gathering a later dimension returns PyTorch's strided view
            if lin.bias is not None:
                y = y + _local(lin.bias)
            return y if local_out else DTensor.from_local(y, mesh, [Shard(-1)],
                                                          run_check=False)
        return forward


class PlaitRowwiseParallel(_PlaitStyle):
    """reduce_scatter(x_local @ W_local.T, seq_dim) (+ b): out-proj, FC2."""

    _weight_dim = 1

    def _forward(self, group: Any, schedule: ScheduleLike, backward: ScheduleLike | None,
                 mesh: DeviceMesh) -> Any:
        local_out = self.use_local_output

        def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            seq_dim = seq_dim_of(x, self.seq_dim)
            y = matmul_reduce_scatter(_local(x), _local(lin.weight).T, group,
                                      scatter_dim=seq_dim, schedule=schedule,
                                      backward_schedule=backward)
            if self.local:  # no DTensor at all
                return y if lin.bias is None else y + lin.bias
            out: torch.Tensor = DTensor.from_local(y, mesh, [Shard(seq_dim)], run_check=False)
            if lin.bias is not None:  # in DTensor: the replicated bias's gradient is summed
                out = out + lin.bias  # over the ranks' sequence shards
            return _local(out) if local_out else out
        return forward


class PlaitEmbeddingParallel(ParallelStyle):
    """A vocabulary-parallel `nn.Embedding` whose output is sharded along the sequence (as
    torchtitan's `RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))` lays
    it out), communicating only through plait: each rank looks up the ids of its vocabulary
    shard (zeros for the others) and plait's reduce-scatter sums the partial embeddings into
    this rank's sequence shard (its backward all-gathers the gradient). A pipeline stage
    holding it can run under `plait.pipelining.overlap_f_b`. The weight becomes a `DTensor`,
    `Shard(0)`; the output a local tensor, or a `DTensor` `Shard(seq_dim)` with
    `use_local_output=False`."""

    def __init__(self, *, seq_dim: int | None = None, use_local_output: bool = False) -> None:
        super().__init__()
        self.seq_dim, self.use_local_output = seq_dim, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if not isinstance(module, nn.Embedding):
            raise SpecError(style, f"applies to nn.Embedding, not {type(module).__name__}",
                            "give the style to the embedding")
        if device_mesh.ndim != 1:
            raise SpecError("device_mesh", f"a {device_mesh.ndim}-d mesh", "pass the TP mesh")
        world = device_mesh.size()
        if module.num_embeddings % world:
            raise SpecError(style, f"{module.num_embeddings} embeddings do not split over "
                            f"{world} ranks", f"pad the vocabulary to a multiple of {world}")
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh,
                                                       [Shard(0)]))
        group, rank = device_mesh.get_group(), device_mesh.get_local_rank()
        local_out = self.use_local_output

        def forward(emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            w = _local(emb.weight)
            mine = _local(ids) - rank * w.shape[0]
            outside = (mine < 0) | (mine >= w.shape[0])
            part = nn.functional.embedding(mine.clamp(0, w.shape[0] - 1), w)
            part = part.masked_fill(outside[..., None], 0.0)
            seq_dim = seq_dim_of(part, self.seq_dim)
            y = reduce_scatter(part, group, dim=seq_dim)
            return y if local_out else DTensor.from_local(y, device_mesh, [Shard(seq_dim)],
                                                          run_check=False)

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        mark_plait(module, group)
        return module


class PlaitSequenceParallel(SequenceParallel):
    """PyTorch's `SequenceParallel` (a norm on this rank's sequence shard, its weight
    replicated) with the sequence read from the activations when `sequence_dim` is None: a
    plain tensor input is taken as sharded along the dimension before the hidden one, a
    `DTensor` as it is sharded. With `sequence_dim` given, a `DTensor` sharded along another
    dimension is refused (PyTorch's style would redistribute it: communication outside
    plait, which `overlap_f_b` cannot order)."""

    def __init__(self, *, sequence_dim: int | None = None, use_local_output: bool = False,
                 local: bool = False) -> None:
        super().__init__(sequence_dim=1 if sequence_dim is None else sequence_dim,
                         use_local_output=use_local_output)
        self.sequence_dim, self.local = sequence_dim, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        given = self.sequence_dim
        if self.local:  # plain weights, each gradient summed over the group as it comes
            for p in module.parameters():
                sum_gradient_over(p, device_mesh.get_group())
            module.register_forward_pre_hook(
                lambda mod, args: (_local(args[0]), *args[1:]) if args else args)
            return module

        def prepare(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            x = inputs[0]
            d = sequence_dim(x, given, f"the norm {type(mod).__name__}")
            if isinstance(x, DTensor):
                return x
            return DTensor.from_local(x, mesh, (Shard(d),), run_check=False)

        return distribute_module(module, device_mesh, self._replicate_module_fn, prepare,
                                 functools.partial(self._prepare_output_fn,
                                                   self.use_local_output))


class PlaitFusedColwiseParallel(ParallelStyle):
    """One all-gather feeding several column-parallel linears: the style of a block (a stock
    Llama attention: `q_proj`, `k_proj`, `v_proj`; a gated MLP: `gate_proj`, `up_proj`) whose
    listed `nn.Linear`s all read the block's input, given to the block itself.

    The block's first tensor argument (positional, else the first tensor keyword, as Hugging
    Face passes `hidden_states=`) is this rank's sequence shard (dim `seq_dim`; a `DTensor` is
    taken local). Before the block runs, plait's `all_gather_matmul` gathers it once and
    multiplies it by the listed linears' weight shards, side by side, in one overlapped call
    (the plan's pair `name`, e.g. `qkv` or `fc1`). The block then runs on those products, laid
    side by side: its own reshapes see the whole sequence (its leading dimensions), and each
    listed linear, called on it, returns its columns (this rank's output columns, plus its
    bias shard). Compiled, nothing is kept between the hook and the linears, so the block
    compiles whole under activation checkpointing. A listed linear called on another tensor
    is an error (eagerly checked by identity, compiled by width): the block does not read its
    input the way this style assumes, and nothing but the listed linears may read it.
    Parameters become `DTensor`s, `Shard(0)`, as with `PlaitColwiseParallel`.
    """

    def __init__(self, linears: Sequence[str], *, seq_dim: int | None = None,
                 schedule: ScheduleLike | None = None, plan: PlanLike | None = None,
                 name: str | None = None, local: bool = False) -> None:
        super().__init__()
        if not linears:
            raise SpecError("linears", "no linear named", "name the block's input linears, "
                            "e.g. ('q_proj', 'k_proj', 'v_proj')")
        self.linears, self.seq_dim, self.local = tuple(linears), seq_dim, local
        self.schedule, self.plan, self.name = schedule, plan, name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        lins: list[nn.Linear] = []
        for path in self.linears:
            try:
                lin = module.get_submodule(path)
            except AttributeError:
                lin = None
            if not isinstance(lin, nn.Linear):
                raise SpecError("linears", f"{type(module).__name__} has no nn.Linear {path!r}",
                                "name the block's own input linears")
            lins.append(_shard_linear(type(self).__name__, lin, device_mesh, 0, self.local))
        group, world = device_mesh.get_group(), device_mesh.size()
        widths = [_local(lin.weight).shape[0] for lin in lins]
        total = sum(widths)
        shape = (total, lins[0].in_features)
        schedule, backward = pick_schedules(self.name, self.schedule, self.plan, world, shape)
        style, block_name, names = type(self).__name__, type(module).__name__, self.linears

        def gather(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            pos = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
            kw = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            if pos is None and kw is None:
                raise SpecError(style, f"{block_name} was called without a tensor input",
                                "call the block on its input")
            x = args[pos] if pos is not None else kwargs[kw]  # type: ignore[index]
            # the weight shards side by side: one GEMM (and one dual pair) for all of them
            w = torch.cat([_local(lin.weight) for lin in lins]).T
            seq_dim = sequence_dim(x, self.seq_dim, f"{style} of {block_name}")
            _, (y,) = all_gather_matmul(_local(x), [w], group, gather_dim=seq_dim,
                                        schedule=schedule, backward_schedule=backward,
                                        return_gathered=False)
            y = y.contiguous()  # gathering a later dimension returns PyTorch's strided view
            if not torch.compiler.is_compiling():
                products[:] = [y]  # eager: the linears check they read exactly this
            if pos is not None:
                return (*args[:pos], y, *args[pos + 1:]), kwargs
            return args, {**kwargs, str(kw): y}

        def done(block: nn.Module, args: Any, output: Any) -> None:
            if not torch.compiler.is_compiling():
                products.clear()

        products: list[torch.Tensor] = []  # eager only: the products of the call under way
        offset = 0
        for lin, width in zip(lins, widths, strict=True):
            lin.forward = types.MethodType(  # type: ignore[method-assign]
                _columns_of(offset, width, total, products, style, block_name, names), lin)
            offset += width
        module.register_forward_pre_hook(gather, with_kwargs=True)
        module.register_forward_hook(done)
        mark_plait(module, group)
        return module


def _columns_of(start: int, width: int, total: int, products: list[torch.Tensor], style: str,
                block: str, names: tuple[str, ...]
                ) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
    """A fused linear's forward (`_columns` for its columns): a function, not a
    `functools.partial`, which Dynamo before torch 2.13 cannot trace inside a checkpoint."""
    def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return _columns(lin, x, start=start, width=width, total=total, products=products,
                        style=style, block=block, names=names)
    return forward


def _columns(lin: nn.Linear, x: torch.Tensor, *, start: int, width: int, total: int,
             products: list[torch.Tensor], style: str, block: str, names: tuple[str, ...]
             ) -> torch.Tensor:
    """A fused linear's output: its columns of the products laid side by side (a view), plus
    its bias shard. Called on anything but the block's products (eagerly: exactly them;
    compiled, where nothing is kept between the hook and the linears: their width), it
    raises."""
    eager = not torch.compiler.is_compiling()
    if x.shape[-1] != total or (eager and not (products and x is products[0])):
        raise SpecError(style, f"{block} called one of {', '.join(names)} on a tensor other "
                        "than the block's products (its gathered input times the listed "
                        "weights)", "give this style only to blocks whose listed linears "
                        "read the block's input, and nothing else reads it")
    y = x[..., start:start + width]
    return y if lin.bias is None else y + _local(lin.bias)


class LlamaNames(NamedTuple):
    """Where a Llama implementation keeps its modules: the embedding, final norm and output
    head, the decoder layers (a pattern), and per layer its two norms, the attention block
    with its input linears and output linear, the MLP block with its input linears (gate, up)
    and output linear. Pass one to `llama_plan`/`llama_block_plan` for a layout of your own
    (`LLAMA_NAMES["torchtitan"]._replace(head="lm_head")`, say). The embedding, final norm
    and head are None where a pipeline stage holds none (torchtitan sets them to None in the
    stages it splits)."""

    embed: str | None
    norm: str | None
    head: str | None
    layers: str
    norm1: str
    norm2: str
    attn: str
    qkv: tuple[str, ...]
    out: str
    mlp: str
    up: tuple[str, ...]
    down: str


LLAMA_NAMES = {
    "hf": LlamaNames("model.embed_tokens", "model.norm", "lm_head", "model.layers.*",
                     "input_layernorm", "post_attention_layernorm",
                     "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
                     "mlp", ("gate_proj", "up_proj"), "down_proj"),
    "torchtitan": LlamaNames("tok_embeddings", "norm", "output", "layers.*",
                             "attention_norm", "ffn_norm",
                             "attention", ("wq", "wk", "wv"), "wo",
                             "feed_forward", ("w1", "w3"), "w2"),
    # torchtitan's 2026 decoders (0.3.0 among them): Q, K and V under the attention's
    # `qkv_linear` (a `QKVLinear`), the head `lm_head`
    "torchtitan-2026": LlamaNames("tok_embeddings", "norm", "lm_head", "layers.*",
                                  "attention_norm", "ffn_norm", "attention",
                                  ("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"), "wo",
                                  "feed_forward", ("w1", "w3"), "w2"),
    # the same with a `FusedQKVLinear`: one `wqkv` whose rows are whole KV groups (each
    # group's query heads, its key, its value), so a column shard holds whole groups
    "torchtitan-2026-fused-qkv": LlamaNames("tok_embeddings", "norm", "lm_head", "layers.*",
                                            "attention_norm", "ffn_norm", "attention",
                                            ("qkv_linear.wqkv",), "wo",
                                            "feed_forward", ("w1", "w3"), "w2"),
}


ENDS = ("plait", "pytorch")


def llama_plan(names: str | LlamaNames | nn.Module = "hf", *, schedule: ScheduleLike | None = None,
               plan: PlanLike | None = None, ends: str = "plait", seq_dim: int | None = None,
               local: bool = False, local_logits: bool = False) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of a Llama (Hugging Face's `LlamaForCausalLM` module
    names, or torchtitan's with `names="torchtitan"`) under tensor and sequence parallelism
    with plait's overlap, as torchtitan lays it out: the embedding's output and the residual
    stream sharded along the sequence (dim 1, `DTensor`s), every block as `llama_block_plan`
    says, and the output head vocabulary-parallel (compute the loss under
    `torch.distributed.tensor.parallel.loss_parallel()`). `schedule` for every pair, or
    `plan` (a `plait explore --json` file or a mapping) for each its own.

    `names`: a layout of `LLAMA_NAMES`, a `LlamaNames`, or the model itself (its layout read
    from its modules, `llama_names_of`).

    `ends`: "plait" (the embedding by `PlaitEmbeddingParallel`, the head by
    `PlaitColwiseParallel` under `schedule`, else `seq/sm`: every stage of a pipeline then
    communicates through plait alone, and overlaps under `overlap_f_b`), or "pytorch" (PyTorch's
    own `RowwiseParallel` and `ColwiseParallel`, as torchtitan has them).

    A pipeline stage (a model whose embedding, final norm or head torchtitan's split set to
    None, and which holds some of the blocks) is planned for what it holds. `seq_dim`: where
    the sequence lies in the activations; by default read from them (the dimension before the
    hidden one: batched `(batch, sequence, hidden)` and flattened tokens alike). PyTorch's
    own ends (`ends="pytorch"`) need it fixed: 1 unless given.

    `local`: the blocks hold plain parameters (each rank's shard; a norm's weight replicated,
    its gradient summed over the group as it comes) and pass plain tensors (this rank's
    sequence shard) from block to block: no `DTensor` inside a block, which activation
    checkpointing + `torch.compile` of blocks calling 4-D SDPA needs (PyTorch saves a
    `DeviceMesh` among the region's tensors otherwise, and fails). The embedding and the head
    keep theirs: the head's output stays vocabulary-parallel for `loss_parallel`.

    `local_logits`: the head hands its vocabulary shard as a plain tensor, what torchtitan's
    `cross_entropy_loss` takes under its default `spmd_types` backend (inside its TP mesh,
    with `global_vocab_size`); by default a `DTensor` (`Shard(-1)`), what PyTorch's
    `loss_parallel` and torchtitan's `partial_dtensor` backend take."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if ends not in ENDS:
        raise SpecError("ends", f"{ends!r}", f"use one of {', '.join(ENDS)}")
    n = _llama_names(names)
    ours = ends == "plait"
    out: dict[str, ParallelStyle] = {}
    if n.embed is not None:
        out[n.embed] = PlaitEmbeddingParallel(seq_dim=seq_dim, use_local_output=local) \
            if ours else RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1 if seq_dim is None else seq_dim),
                use_local_output=local)
    out |= {f"{n.layers}.{k}": v for k, v in llama_block_plan(
        n, schedule=schedule, plan=plan, seq_dim=seq_dim, local=local).items()}
    if n.norm is not None:
        out[n.norm] = PlaitSequenceParallel(sequence_dim=seq_dim)
    if n.head is not None:
        out[n.head] = PlaitColwiseParallel(seq_dim=seq_dim, schedule=schedule,
                                           use_local_output=local_logits) if ours else \
            ColwiseParallel(input_layouts=Shard(1 if seq_dim is None else seq_dim),
                            output_layouts=Shard(-1), use_local_output=local_logits)
    return out


def torchtitan_tensor_parallel(model: nn.Module, **plan: Any) -> None:
    """Make torchtitan's own TP step plait's: torchtitan 0.3.0's `parallelize_llama` applies
    tensor parallelism by calling `model.parallelize(parallel_dims)`; after this, that call
    applies `llama_plan(model, **plan)` on `parallel_dims.get_mesh("tp")` instead, and the rest
    of torchtitan's path (activation checkpointing, compile, FSDP2) runs as it does."""
    from torch.distributed.tensor.parallel import parallelize_module

    def parallelize(parallel_dims: Any) -> None:
        parallelize_module(model, parallel_dims.get_mesh("tp"), llama_plan(model, **plan))

    object.__setattr__(model, "parallelize", parallelize)


def llama_block_plan(names: str | LlamaNames | nn.Module = "hf", *,
                     schedule: ScheduleLike | None = None, plan: PlanLike | None = None,
                     seq_dim: int | None = None, local: bool = False
                     ) -> dict[str, ParallelStyle]:
    """The plan of one Llama block (a `LlamaDecoderLayer`, or torchtitan's `TransformerBlock`
    with `names="torchtitan"`, or the block itself: its layout read from its modules), keyed
    by its module names, for `parallelize_module(block,
    tp_mesh, ...)` as torchtitan parallelizes each block: its input and output sharded along
    the sequence (dim 1, `DTensor`s), norms `SequenceParallel`, one all-gather feeding Q, K
    and V (the plan's pair `qkv`) and one feeding gate and up (`fc1`), the output projections
    reduce-scattered (`out_proj`, `fc2`). Its only communication is plait's (the norms'
    weight gradients stay `Partial` through the backward), so a pipeline stage of such blocks
    can run under `plait.pipelining.overlap_f_b`. `seq_dim`: where the sequence lies in the
    blocks' activations (1 for (batch, sequence, hidden); 0 for flattened tokens); by default
    read from them (the dimension before the hidden one). `local`: plain parameters and
    tensors, no `DTensor` in the block (see `llama_plan`)."""
    n = _llama_names(names)
    pick: dict[str, Any] = {"schedule": schedule, "plan": plan, "local": local}
    return {
        n.norm1: PlaitSequenceParallel(sequence_dim=seq_dim, local=local),
        n.attn: PlaitFusedColwiseParallel(n.qkv, seq_dim=seq_dim, name="qkv", **pick),
        f"{n.attn}.{n.out}": PlaitRowwiseParallel(seq_dim=seq_dim, name="out_proj",
                                                  use_local_output=False, **pick),
        n.norm2: PlaitSequenceParallel(sequence_dim=seq_dim, local=local),
        n.mlp: PlaitFusedColwiseParallel(n.up, seq_dim=seq_dim, name="fc1", **pick),
        f"{n.mlp}.{n.down}": PlaitRowwiseParallel(seq_dim=seq_dim, name="fc2",
                                                  use_local_output=False, **pick),
    }


# Where each part of a Llama may live, as the layouts above name it. Fused projections are
# listed only where a column shard holds whole units (torchtitan's `wqkv` by KV group, its
# `w13` interleaving gate and up): a weight that stacks Q, K and V (or gate and up) one after
# the other cannot be column-sharded as it is, so it is not recognized.
_WHERE: dict[str, tuple[Any, ...]] = {
    "embed": ("model.embed_tokens", "tok_embeddings"),
    "norm": ("model.norm", "norm"),
    "head": ("lm_head", "output"),
    "layers": ("model.layers", "layers"),
    "norm1": ("input_layernorm", "attention_norm"),
    "norm2": ("post_attention_layernorm", "ffn_norm"),
    "attn": ("self_attn", "attention"),
    "qkv": (("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"),
            ("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"), ("qkv_linear.wqkv",),
            ("wqkv",)),
    "out": ("o_proj", "wo"),
    "mlp": ("mlp", "feed_forward"),
    "up": (("gate_proj", "up_proj"), ("w1", "w3"), ("w13",)),
    "down": ("down_proj", "w2"),
}


def llama_names_of(model: nn.Module) -> LlamaNames:
    """The `LlamaNames` of a live Llama, read from its own modules (its first block for the
    per-block names; given one block, its own names, the model's ends None): any layout of
    `LLAMA_NAMES`, mixed as the model has them (torchtitan's interleaved `w13` beside a fused
    `wqkv`, say). A part found under none of the known names is refused, naming what was looked
    for.
    """
    def find(root: nn.Module, field: str) -> Any:
        for candidate in _WHERE[field]:
            paths = candidate if isinstance(candidate, tuple) else (candidate,)
            if all(_has(root, path) for path in paths):
                return candidate
        if field in _STAGE_MAY_LACK and any(_set_to_none(root, c) for c in _WHERE[field]):
            return None  # a pipeline stage without it
        tried = " | ".join(c if isinstance(c, str) else "+".join(c) for c in _WHERE[field])
        raise SpecError("names", f"{type(model).__name__} has no {field} module among "
                        f"{tried}", "pass a LlamaNames naming its modules")

    whole = not _is_block(model)  # else one block, as torchtitan parallelizes each
    block, layers = model, ""
    if whole:
        layers = find(model, "layers")
        blocks = list(model.get_submodule(layers).children())
        if not blocks:
            raise SpecError("names", f"{type(model).__name__}.{layers} holds no blocks",
                            "pass a model with its decoder layers, or a LlamaNames")
        block, layers = blocks[0], f"{layers}.*"
    attn, mlp = find(block, "attn"), find(block, "mlp")
    ends: tuple[str | None, str | None, str | None] = (None, None, None)
    if whole:
        ends = (find(model, "embed"), find(model, "norm"), find(model, "head"))
    return LlamaNames(*ends, layers, find(block, "norm1"), find(block, "norm2"), attn,
                      find(block.get_submodule(attn), "qkv"),
                      find(block.get_submodule(attn), "out"), mlp,
                      find(block.get_submodule(mlp), "up"),
                      find(block.get_submodule(mlp), "down"))


_STAGE_MAY_LACK = ("embed", "norm", "head")  # a pipeline stage may hold none of these


def _is_block(model: nn.Module) -> bool:
    """Whether `model` is one decoder block (its attention and MLP are its own children)."""
    return not any(_has(model, path) for path in _WHERE["layers"]) and \
        any(_has(model, a) for a in _WHERE["attn"]) and any(_has(model, m) for m in _WHERE["mlp"])


def _set_to_none(root: nn.Module, path: str) -> bool:
    """Whether `path` names an attribute that holds None (torchtitan's split of a stage)."""
    parent, _, last = path.rpartition(".")
    try:
        owner = root.get_submodule(parent) if parent else root
    except AttributeError:
        return False
    return (last in owner.__dict__ and owner.__dict__[last] is None) or (
        last in getattr(owner, "_modules", {}) and owner._modules[last] is None)


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _llama_names(names: str | LlamaNames | nn.Module) -> LlamaNames:
    if isinstance(names, LlamaNames):
        return names
    if isinstance(names, nn.Module):
        return llama_names_of(names)
    if names not in LLAMA_NAMES:
        raise SpecError("names", f"{names!r} is not a known Llama layout",
                        f"use one of {', '.join(LLAMA_NAMES)}, or a LlamaNames of your own")
    return LLAMA_NAMES[names]
