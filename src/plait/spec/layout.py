"""The execution: how a model is parallelized (`ParallelSpec`) and the checks that it can be."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from plait.errors import SpecError
from plait.spec.dtypes import DTYPE_BYTES
from plait.spec.model import ModelSpec

ModelDType = Literal["fp32", "bf16", "fp16", "fp8"]  # what a modelled step may compute in


class ParallelSpec(BaseModel):
    """Parallel layout of one training (or prefill) step, Megatron conventions."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tp: int = Field(default=8, gt=0, description="Tensor-parallel group size")
    sp: bool = Field(default=True, description="Sequence parallelism inside the TP group")
    cp: int = Field(default=1, gt=0, description="Context-parallel group size")
    ep: int = Field(default=1, gt=0, description="Expert-parallel group size")
    pp: int = Field(default=1, gt=0, description="Pipeline-parallel stages")
    virtual_stages: int = Field(
        default=1, gt=0, description="Model chunks per pipeline rank: 1 for 1F1B, v > 1 for "
        "interleaved 1F1B (its bubble is 1/v of 1F1B's)")
    dp: int = Field(default=1, gt=0, description="Data-parallel replicas")
    micro_batch: int = Field(default=1, gt=0, description="Sequences per micro-batch")
    seq_len: int = Field(default=8192, gt=0, description="Tokens per sequence")
    num_micro_batches: int = Field(default=1, gt=0, description="Micro-batches per step per stage")
    dtype: ModelDType = Field(default="bf16", description="One of fp32, bf16, fp16, fp8")
    capacity_factor: float = Field(
        default=1.0, ge=1.0, description="MoE rows per expert as a multiple of balanced routing "
        "(capacity padding, or the imbalance a dropless layer pads to), at least 1")
    regather: bool = Field(
        default=True, description="The backward re-gathers each column-parallel linear's input "
        "for its weight gradient (Megatron-LM); false: it keeps the forward's gathered input "
        "(PyTorch's DTensor TP as torchtitan runs it, and plait's own runtime)")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def world(self) -> int:
        """GPUs used by one model replica times data-parallel replicas (EP reuses DP x CP x TP)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def bubble_slots(self) -> float:
        """Idle micro-batch slots of a pipelined step per stage: (pp - 1) / v for 1F1B (v = 1)
        and interleaved 1F1B (Narayanan et al., SC'21); 0 without pipelining."""
        return (self.pp - 1) / self.virtual_stages

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one CP rank (the GEMM M dimension inside a TP group)."""
        return self.micro_batch * self.seq_len // self.cp


def check_shardable(model: ModelSpec, par: ParallelSpec) -> None:
    """Raise `SpecError` naming the field and the fix when `model` cannot be laid out as `par`."""
    tp = par.tp
    if model.heads % tp:
        raise SpecError("parallel.tp", f"heads={model.heads} of {model.name} is not divisible by "
                        f"tp={tp}", f"choose tp among {_divisors(model.heads)}")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise SpecError("parallel.tp", f"kv_heads={model.kv_heads} neither divides nor is "
                        f"divisible by tp={tp}",
                        f"choose tp among {_divisors(model.kv_heads)} or a multiple of "
                        f"{model.kv_heads}")
    if model.ffn % tp:
        raise SpecError("parallel.tp", f"ffn={model.ffn} is not divisible by tp={tp}",
                        f"choose tp among {_divisors(model.ffn, limit=64)}")
    if model.moe and model.moe.expert_ffn % tp:
        raise SpecError("parallel.tp", f"moe.expert_ffn={model.moe.expert_ffn} is not divisible "
                        f"by tp={tp}", f"choose tp among {_divisors(model.moe.expert_ffn, 64)}")
    if par.seq_len % par.cp:
        raise SpecError("parallel.seq_len", f"seq_len={par.seq_len} is not divisible by "
                        f"cp={par.cp}", f"use a multiple of {par.cp}")
    if par.sp and par.tokens % tp:
        raise SpecError("parallel.seq_len", f"{par.tokens} tokens per CP rank are not divisible "
                        f"by tp={tp} (sequence parallelism shards tokens)",
                        f"use a seq_len that is a multiple of {tp * par.cp} or pass --no-sp")
    if model.layers % par.pp:
        raise SpecError("parallel.pp", f"layers={model.layers} is not divisible by pp={par.pp}",
                        f"choose pp among {_divisors(model.layers)}")
    chunks = par.pp * par.virtual_stages
    if par.virtual_stages > 1 and model.layers % chunks:
        raise SpecError("parallel.virtual_stages", f"layers={model.layers} do not split into "
                        f"pp x virtual_stages = {chunks} equal chunks",
                        f"choose virtual_stages so that pp x it divides {model.layers}")
    if par.virtual_stages > 1 and par.num_micro_batches % par.pp:
        raise SpecError("parallel.num_micro_batches", f"interleaved 1F1B runs micro-batches "
                        f"in groups of pp={par.pp}; {par.num_micro_batches} is not a multiple",
                        f"use --micro-batches {par.pp * max(1, par.num_micro_batches // par.pp)}")
    if par.ep > 1 and model.moe is None:
        raise SpecError("parallel.ep", f"ep={par.ep} but {model.name} has no experts",
                        "set ep=1 or pick an MoE model")
    if model.moe and model.moe.experts % par.ep:
        raise SpecError("parallel.ep", f"experts={model.moe.experts} is not divisible by "
                        f"ep={par.ep}", f"choose ep among {_divisors(model.moe.experts)}")
    if model.moe and par.capacity_factor > model.moe.experts / model.moe.top_k:
        most = model.moe.experts / model.moe.top_k
        raise SpecError("parallel.capacity_factor", f"{par.capacity_factor:g} would give an "
                        f"expert more rows than there are tokens (each token picks "
                        f"{model.moe.top_k} of {model.moe.experts} experts)",
                        f"use a capacity factor between 1 and {most:g}")
    if par.ep > par.dp * par.cp * par.tp:
        raise SpecError("parallel.ep", f"ep={par.ep} exceeds the dp*cp*tp={par.dp * par.cp * tp} "
                        "ranks it is carved from", "lower ep or raise dp")


def _divisors(n: int, limit: int = 1024) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
