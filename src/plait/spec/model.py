"""The workload: a transformer's shape (`ModelSpec`), its presets, and Hugging Face configs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plait.errors import SpecError
from plait.spec.io import read_mapping, validate

# The largest size a dimension may have: what a tensor's int32 indexing and a float's
# products of a few of them hold (a larger one is a typo, and would overflow the models)
MAX_DIM = 2**31 - 1


class MoESpec(BaseModel):
    """Mixture-of-experts feed-forward block (every layer is MoE when set)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    experts: int = Field(gt=0, le=MAX_DIM, description="Number of routed experts per layer")
    top_k: int = Field(gt=0, le=MAX_DIM, description="Experts each token is routed to")
    expert_ffn: int = Field(gt=0, le=MAX_DIM,
                            description="FFN (intermediate) size of one expert")

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoESpec:
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        return self


class ModelSpec(BaseModel):
    """A decoder-only transformer (Llama/Mistral/Qwen/GPT style)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    name: str = Field(default="custom", description="A label for reports")
    layers: int = Field(gt=0, le=MAX_DIM, description="Number of transformer layers")
    hidden: int = Field(gt=0, le=MAX_DIM, description="Model (embedding) width")
    heads: int = Field(gt=0, le=MAX_DIM, description="Query attention heads")
    kv_heads: int = Field(gt=0, le=MAX_DIM,
                          description="Key/value heads (grouped-query attention)")
    head_dim: int = Field(default=0, ge=0, le=MAX_DIM,
                          description="Per-head width; 0 means hidden // heads")
    ffn: int = Field(gt=0, le=MAX_DIM, description="Dense MLP intermediate size")
    vocab: int = Field(gt=0, le=MAX_DIM, description="Vocabulary size")
    gated_mlp: bool = Field(default=True, description="True for SwiGLU (gate and up projections)")
    moe: MoESpec | None = Field(default=None, description="Mixture-of-experts block, or null")

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"hidden={self.hidden} is not divisible by heads={self.heads}; set head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        return self

    def with_(self, **changes: Any) -> ModelSpec:
        """A variant of this spec with some fields changed (validated again)."""
        return validate(ModelSpec, {**self.model_dump(), **changes}, "model")


# Presets: each a named function, numbers from the model's published config.json.
def llama3_8b() -> ModelSpec:
    return ModelSpec(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8,
                     ffn=14336, vocab=128256)


def llama3_70b() -> ModelSpec:
    return ModelSpec(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                     ffn=28672, vocab=128256)


def llama3_405b() -> ModelSpec:
    return ModelSpec(name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                     ffn=53248, vocab=128256)


def llama2_7b() -> ModelSpec:
    # meta-llama/Llama-2-7b-hf config.json: a key/value head per query head (no GQA).
    return ModelSpec(name="llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32,
                     ffn=11008, vocab=32000)


def llama2_70b() -> ModelSpec:
    return llama3_70b().with_(name="llama2-70b", vocab=32000)


def gpt3_175b() -> ModelSpec:
    # Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, d_ff = 4 d_model.
    return ModelSpec(name="gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96,
                     ffn=49152, vocab=50257, gated_mlp=False)


def mixtral_8x7b() -> ModelSpec:
    return ModelSpec(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                     ffn=14336, vocab=32000, moe=MoESpec(experts=8, top_k=2, expert_ffn=14336))


def phi35_moe() -> ModelSpec:
    return ModelSpec(name="phi3.5-moe", layers=32, hidden=4096, heads=32, kv_heads=8,
                     ffn=6400, vocab=32064, moe=MoESpec(experts=16, top_k=2, expert_ffn=6400))


def qwen3_14b() -> ModelSpec:
    return ModelSpec(name="qwen3-14b", layers=40, hidden=5120, heads=40, kv_heads=8,
                     head_dim=128, ffn=17408, vocab=151936)


MODEL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3-405b": llama3_405b,
    "llama2-7b": llama2_7b,
    "llama2-70b": llama2_70b,
    "gpt3-175b": gpt3_175b,
    "mixtral-8x7b": mixtral_8x7b,
    "phi3.5-moe": phi35_moe,
    "qwen3-14b": qwen3_14b,
}

# Hugging Face config.json keys -> ModelSpec fields, for the Llama, Mistral/Mixtral, Qwen families.
_HF_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phimoe")


def from_hf_config(config: dict[str, Any], name: str = "hf-model") -> ModelSpec:
    """Build a `ModelSpec` from a Hugging Face `config.json` mapping."""
    family = str(config.get("model_type", ""))
    if family not in _HF_FAMILIES:
        raise SpecError("model.model_type", f"unsupported Hugging Face model_type {family!r}",
                        f"use a config of one of {', '.join(_HF_FAMILIES)} or a plait model spec")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size"):
        if key not in config:
            raise SpecError(f"model.{key}", "missing from the Hugging Face config",
                            "add it or pass a complete config.json")
    # Values go to validation as they are (no int() that would read 8.9 as 8 or fail on a
    # string): a wrong type is a SpecError naming the field.
    heads = config["num_attention_heads"]
    experts_key = next((k for k in ("num_local_experts", "num_experts") if k in config), None)
    moe = None
    if experts_key is not None and config[experts_key] is not None:
        moe = {"experts": config[experts_key], "top_k": config.get("num_experts_per_tok", 2),
               "expert_ffn": config.get("moe_intermediate_size")
               or config["intermediate_size"]}
    act = str(config.get("hidden_act", "silu"))
    names = _HF_NAMES | {"model.moe.experts": f"model.{experts_key}"}
    try:
        return _from_hf(config, name, heads, moe, act)
    except SpecError as exc:  # named as the config names it
        raise SpecError(names.get(exc.field, exc.field), exc.problem, exc.fix) from None


# ModelSpec's fields as a Hugging Face config names them
_HF_NAMES = {"model.layers": "model.num_hidden_layers", "model.hidden": "model.hidden_size",
             "model.heads": "model.num_attention_heads",
             "model.kv_heads": "model.num_key_value_heads", "model.head_dim": "model.head_dim",
             "model.ffn": "model.intermediate_size", "model.vocab": "model.vocab_size",
             "model.moe.top_k": "model.num_experts_per_tok",
             "model.moe.expert_ffn": "model.moe_intermediate_size"}


def _from_hf(config: dict[str, Any], name: str, heads: Any, moe: dict[str, Any] | None,
             act: str) -> ModelSpec:
    return validate(ModelSpec, {
        "name": name,
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads", heads),  # 0 is refused, not replaced
        "head_dim": config.get("head_dim") or 0,
        "ffn": config["intermediate_size"],
        "vocab": config["vocab_size"],
        "gated_mlp": act in ("silu", "swiglu", "gelu_pytorch_tanh", "swish"),
        "moe": moe,
    }, "model")


# torchtitan's Llama model arguments (`TransformerModelArgs`) -> ModelSpec fields.
_TORCHTITAN_KEYS = ("dim", "n_layers", "n_heads", "vocab_size")


def torchtitan_ffn(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None
                   ) -> int:
    """The MLP width torchtitan's Llama `FeedForward` derives from its arguments: 2/3 of
    4 x dim, times `ffn_dim_multiplier`, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def from_torchtitan_args(args: dict[str, Any], name: str = "torchtitan-model") -> ModelSpec:
    """Build a `ModelSpec` from torchtitan's Llama model arguments (`dim`, `n_layers`,
    `n_heads`, `n_kv_heads`, `vocab_size`, `multiple_of`, `ffn_dim_multiplier`), as
    `dataclasses.asdict(model_args)` gives them."""
    for key in _TORCHTITAN_KEYS:
        if key not in args:
            raise SpecError(f"model.{key}", "missing from the torchtitan model arguments",
                            "pass every field of the model's TransformerModelArgs")
    dim, multiple_of, mult = args["dim"], args.get("multiple_of", 256), args.get(
        "ffn_dim_multiplier")
    if not (isinstance(dim, int) and isinstance(multiple_of, int) and multiple_of > 0
            and (mult is None or isinstance(mult, int | float))):
        raise SpecError("model.dim", "dim and multiple_of must be integers (multiple_of > 0), "
                        "ffn_dim_multiplier a number or null",
                        "copy them from the model's TransformerModelArgs")
    return validate(ModelSpec, {
        "name": name, "layers": args["n_layers"], "hidden": dim, "heads": args["n_heads"],
        "kv_heads": args.get("n_kv_heads") or args["n_heads"],
        "ffn": torchtitan_ffn(dim, multiple_of, mult), "vocab": args["vocab_size"],
    }, "model")


def model_spec_of(model: Any, name: str | None = None) -> ModelSpec:
    """The `ModelSpec` of a model instance, described by itself: a Hugging Face model (its
    `config`), a torchtitan Llama of 2025 (its `model_args`) or a torchtitan decoder of 2026
    (its `config` dataclass, the MLP width from its modules)."""
    import dataclasses

    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return from_hf_config(config.to_dict(), name or type(model).__name__)
    args = getattr(model, "model_args", None)
    if args is not None and dataclasses.is_dataclass(args) and not isinstance(args, type):
        return from_torchtitan_args(dataclasses.asdict(args), name or type(model).__name__)
    attention = getattr(getattr(config, "layer", None), "attention", None)
    if config is not None and getattr(attention, "n_heads", None) is not None:
        return _from_decoder_config(model, config, attention, name or type(model).__name__)
    raise SpecError("model", f"{type(model).__name__} has neither a Hugging Face config, "
                    "torchtitan model_args nor a torchtitan decoder config",
                    "pass a ModelSpec, a preset or a config file")


def _from_decoder_config(model: Any, config: Any, attention: Any, name: str) -> ModelSpec:
    """torchtitan's 2026 decoders: `config` (dim, n_layers, vocab_size, and per layer the
    attention's n_heads, n_kv_heads) and the MLP width from the model's own output projection
    (its `w2` or `down_proj`, whose columns are the hidden units)."""
    width = next((m.weight.shape[-1] for n, m in model.named_modules()
                  if n.rsplit(".", 1)[-1] in ("w2", "down_proj")
                  and getattr(m, "weight", None) is not None and m.weight.dim() == 2), None)
    missing = [k for k in ("dim", "n_layers", "vocab_size") if getattr(config, k, None) is None]
    if missing or width is None:
        raise SpecError("model", f"{name}'s config has no {', '.join(missing) or 'MLP'}"
                        if missing else f"{name} has no MLP output projection (w2, down_proj)",
                        "pass a ModelSpec, a preset or a config file")
    return validate(ModelSpec, {
        "name": name, "layers": config.n_layers, "hidden": config.dim,
        "heads": attention.n_heads, "kv_heads": attention.n_kv_heads or attention.n_heads,
        "ffn": int(width), "vocab": config.vocab_size}, "model")


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a Hugging Face `config.json`, torchtitan's model arguments, or a plait
    model spec file (YAML/JSON)."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]()
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        raise SpecError("model", f"unknown model preset {name_or_path!r}",
                        f"use one of {', '.join(MODEL_PRESETS)} or a path to a config file")
    data = read_mapping(path, "model")
    if "model_type" not in data and "num_hidden_layers" in data:
        raise SpecError("model.model_type", f"{path} reads as a Hugging Face config without "
                        "its model_type", f"add \"model_type\" (one of {', '.join(_HF_FAMILIES)})")
    if "model_type" in data:
        # a Hub checkout's config.json is named by its folder; any other file by its own name
        name = path.parent.resolve().name if path.name == "config.json" else path.stem
        return from_hf_config(data, name=name or path.stem)
    if all(key in data for key in _TORCHTITAN_KEYS):
        return from_torchtitan_args(data, name=path.stem)
    return validate(ModelSpec, {"name": path.stem, **data}, "model")
