"""A small Llama-style model built from explicit-operator layers, sharded for TP + SP, plus a
plain single-process torch reference of the same model (for equivalence tests).

Every rank can build every rank's weight shards from the seed, so the reference sees exactly
the weights the ranks hold. Embedding, final norm, LM head and the norm gains are replicated
across the TP group (their gradients are summed over it at the end of a step); the attention and
MLP weights are column/row shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.measure.coexec.units import attention, rms_norm
from plait.measure.coexec.values import LayerParams
from plait.spec.layout import ParallelSpec
from plait.spec.model import ModelSpec
from plait.workload.operators import Layer
from plait.workload.transformer import LayerShape, build_layer, layer_shape


def _rand(seed: int, *shape: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)



@dataclass
class ShardedModel:
    spec: ModelSpec
    parallel: ParallelSpec
    rank: int
    layers: list[LayerParams]
    embed: torch.Tensor  # (vocab, H), replicated
    g_final: torch.Tensor
    head: torch.Tensor  # (H, vocab), replicated
    shape: LayerShape
    grads: dict[str, torch.Tensor]  # replicated parameters' gradients

    @property
    def layer(self) -> Layer:
        """The one description of its layers' operators (`build_layer`)."""
        return build_layer(self.spec, self.parallel)

    def accumulate(self, name: str, g: torch.Tensor) -> None:
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g.clone()


def expert_weights(spec: ModelSpec, par: ParallelSpec, seed: int, layer: int, expert: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s (H, 2 F) gate|up and (F, H) weights, the same on every rank."""
    h, s = spec.hidden, layer_shape(spec, par)
    base = seed * 100_003 + layer * 1009 + 50_000 + expert * 31
    return (_rand(base, h, 2 * s.expert_ffn, dtype=dtype, scale=h ** -0.5),
            _rand(base + 1, s.expert_ffn, h, dtype=dtype, scale=s.expert_ffn ** -0.5))


def layer_shard(spec: ModelSpec, par: ParallelSpec, seed: int, layer: int, rank: int,
                dtype: torch.dtype) -> LayerParams:
    """Rank `rank`'s weights of one layer: its TP shards (rank mod TP) of attention and dense
    MLP; for an expert-parallel MoE layer the router (replicated) and its local experts
    (EP rank `rank`: experts rank x E_local ..)."""
    s = layer_shape(spec, par)
    h, hd = spec.hidden, spec.head_dim
    base = seed * 100_003 + layer * 1009
    r = base + (rank % par.tp) * 17
    qkv_n = s.qkv_width
    if s.experts:
        mine = [expert_weights(spec, par, seed, layer, rank * s.local_experts + e, dtype)
                for e in range(s.local_experts)]
        w1, w2 = torch.stack([a for a, _ in mine]), torch.stack([b for _, b in mine])
        wr: torch.Tensor | None = _rand(base + 7, h, s.experts, dtype=dtype, scale=h ** -0.5)
    else:
        w1 = _rand(r + 5, h, 2 * s.ffn, dtype=dtype, scale=h ** -0.5)
        w2 = _rand(r + 6, s.ffn, h, dtype=dtype, scale=(s.ffn * par.tp) ** -0.5)
        wr = None
    return LayerParams(
        g1=1 + _rand(base + 1, h, dtype=dtype, scale=0.1),
        wqkv=_rand(r + 2, h, qkv_n, dtype=dtype, scale=h ** -0.5),
        wo=_rand(r + 3, s.heads * hd, h, dtype=dtype, scale=(s.heads * hd * par.tp) ** -0.5),
        g2=1 + _rand(base + 4, h, dtype=dtype, scale=0.1),
        w1=w1, w2=w2, wr=wr)


def build_sharded(spec: ModelSpec, par: ParallelSpec, rank: int, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> ShardedModel:
    h, v = spec.hidden, spec.vocab
    return ShardedModel(
        spec, par, rank,
        [layer_shard(spec, par, seed, i, rank, dtype) for i in range(spec.layers)],
        _rand(seed + 7, v, h, dtype=dtype, scale=1.0),
        1 + _rand(seed + 8, h, dtype=dtype, scale=0.1),
        _rand(seed + 9, h, v, dtype=dtype, scale=h ** -0.5),
        layer_shape(spec, par), {})


def batches(spec: ModelSpec, par: ParallelSpec, micro_batches: int, seed: int = 0,
            replica: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) per micro-batch, each (S,) (micro-batch size 1), of data-parallel
    replica `replica`."""
    g = torch.Generator().manual_seed(seed + 11 + 7919 * replica)
    out = []
    for _ in range(micro_batches):
        t = torch.randint(0, spec.vocab, (par.seq_len + 1,), generator=g)
        out.append((t[:-1], t[1:]))
    return out


def reference_step(spec: ModelSpec, par: ParallelSpec, micro_batches: int, seed: int = 0,
                   dtype: torch.dtype = torch.float64) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (summed over micro-batches) and gradients of the unsharded model, torch autograd.

    Gradient names: `embed`, `g_final`, `head`, and `<layer>.<param>.<rank>` for shards,
    `<layer>.g1` / `<layer>.g2` for the replicated gains. An expert-parallel MoE layer (TP 1,
    EP = DP: `moe_reference_step`) names its experts' shards `<layer>.w1.<rank>`, its
    replicated weights `<layer>.wqkv`, `.wo`, `.wr`."""
    if layer_shape(spec, par).experts:
        return moe_reference_step(spec, par, micro_batches, seed, dtype)
    P = par.tp
    shards = [[layer_shard(spec, par, seed, i, r, dtype) for r in range(P)]
              for i in range(spec.layers)]
    full = build_sharded(spec, par, 0, seed, dtype)
    params: dict[str, torch.Tensor] = {"embed": full.embed, "g_final": full.g_final,
                                       "head": full.head}
    for i, layer in enumerate(shards):
        params[f"{i}.g1"], params[f"{i}.g2"] = layer[0].g1, layer[0].g2
        for r, sh in enumerate(layer):
            for n in ("wqkv", "wo", "w1", "w2"):
                params[f"{i}.{n}.{r}"] = getattr(sh, n)
    params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    s = full.shape
    hq, hk = s.q_width, s.kv_width
    total = torch.zeros((), dtype=dtype)
    for tokens, labels in batches(spec, par, micro_batches, seed):
        x = params["embed"][tokens]
        for i in range(spec.layers):
            xn = rms_norm(x, params[f"{i}.g1"])
            y = torch.zeros_like(x)
            for r in range(P):
                q, k, v = (xn @ params[f"{i}.wqkv.{r}"]).split([hq, hk, hk], dim=1)
                y = y + attention(q, k, v, s) @ params[f"{i}.wo.{r}"]
            h1 = x + y
            hn = rms_norm(h1, params[f"{i}.g2"])
            z = torch.zeros_like(h1)
            for r in range(P):
                u = hn @ params[f"{i}.w1.{r}"]
                z = z + (F.silu(u[:, :s.ffn]) * u[:, s.ffn:]) @ params[f"{i}.w2.{r}"]
            x = h1 + z
        logits = rms_norm(x, params["g_final"]) @ params["head"]
        total = total + F.cross_entropy(logits, labels, reduction="sum") / par.seq_len
    total.backward()
    grads = {k: v.grad for k, v in params.items()}
    assert all(g is not None for g in grads.values()), "every parameter takes part in the loss"
    return float(total.detach()), {k: g for k, g in grads.items() if g is not None}


def moe_reference_step(spec: ModelSpec, par: ParallelSpec, micro_batches: int, seed: int = 0,
                       dtype: torch.dtype = torch.float64
                       ) -> tuple[float, dict[str, torch.Tensor]]:
    """`reference_step` of an expert-parallel MoE model (TP 1, EP = DP): every data-parallel
    replica's micro-batches through the unsharded layers, every expert's weights, routed as
    the units route (`experts.route`)."""
    from plait.measure.coexec.experts import experts_mlp

    s = layer_shape(spec, par)
    full = build_sharded(spec, par, 0, seed, dtype)
    params: dict[str, torch.Tensor] = {"embed": full.embed, "g_final": full.g_final,
                                       "head": full.head}
    for i, lp in enumerate(full.layers):
        assert lp.wr is not None
        for n in ("g1", "g2", "wqkv", "wo", "wr"):
            params[f"{i}.{n}"] = getattr(lp, n)
        for e in range(s.experts):
            params[f"{i}.w1.e{e}"], params[f"{i}.w2.e{e}"] = expert_weights(
                spec, par, seed, i, e, dtype)
    params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    hq, hk = s.q_width, s.kv_width
    total = torch.zeros((), dtype=dtype)
    for replica in range(par.ep):
        for tokens, labels in batches(spec, par, micro_batches, seed, replica):
            x = params["embed"][tokens]
            for i in range(spec.layers):
                xn = rms_norm(x, params[f"{i}.g1"])
                q, k, v = (xn @ params[f"{i}.wqkv"]).split([hq, hk, hk], dim=1)
                h1 = x + attention(q, k, v, s) @ params[f"{i}.wo"]
                hn = rms_norm(h1, params[f"{i}.g2"])
                x = h1 + experts_mlp(hn, params[f"{i}.wr"],
                                     [params[f"{i}.w1.e{e}"] for e in range(s.experts)],
                                     [params[f"{i}.w2.e{e}"] for e in range(s.experts)], s)
            logits = rms_norm(x, params["g_final"]) @ params["head"]
            total = total + F.cross_entropy(logits, labels, reduction="sum") / par.seq_len
    total.backward()
    grads: dict[str, torch.Tensor] = {k: v.grad for k, v in params.items()
                                      if v.grad is not None}
    out = {k: g for k, g in grads.items() if ".e" not in k}
    for i in range(spec.layers):  # each rank's experts, stacked as it holds them
        for n in ("w1", "w2"):
            for r in range(par.ep):
                out[f"{i}.{n}.{r}"] = torch.stack(
                    [grads.get(f"{i}.{n}.e{e}", torch.zeros_like(params[f"{i}.{n}.e{e}"]))
                     for e in range(r * s.local_experts, (r + 1) * s.local_experts)])
    return float(total.detach()), out
