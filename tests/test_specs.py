"""Specs: presets, files, and clear errors that name the field and the fix."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.errors import SpecError
from plait.spec.calibration import load_calibration
from plait.spec.hardware import HARDWARE_PRESETS, load_hardware
from plait.spec.layout import ParallelSpec, check_shardable
from plait.spec.model import MODEL_PRESETS, ModelSpec, from_hf_config, load_model


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_model_presets_load_and_shard_tp8(name):
    m = load_model(name)
    assert m.name == name and m.head_dim > 0
    check_shardable(m, ParallelSpec(tp=8, ep=m.moe.experts if m.moe else 1,
                                    dp=m.moe.experts if m.moe else 1))


@pytest.mark.parametrize("name", HARDWARE_PRESETS)
def test_hardware_presets_load(name):
    c = load_hardware(name)
    assert c.gpu.peak_flops and c.topology.link_bytes_per_s > 0


def test_unknown_presets_list_the_choices():
    with pytest.raises(SpecError, match="llama3-70b") as e:
        load_model("llama9")
    assert e.value.field == "model"
    with pytest.raises(SpecError, match="mi300x") as e:
        load_hardware("tpu-v9")
    assert e.value.field == "hardware"


def test_heads_not_divisible_by_tp_names_field_and_fix():
    with pytest.raises(SpecError) as e:
        check_shardable(load_model("llama3-8b"), ParallelSpec(tp=3))
    assert e.value.field == "parallel.tp"
    assert "choose tp among" in e.value.fix


def test_seq_len_not_divisible_under_sp():
    with pytest.raises(SpecError, match="--no-sp") as e:
        check_shardable(load_model("llama3-8b"), ParallelSpec(tp=8, seq_len=8191 * 8 + 4))
    assert e.value.field == "parallel.seq_len"


def test_ep_without_experts_is_rejected():
    with pytest.raises(SpecError, match="no experts"):
        check_shardable(load_model("llama3-8b"), ParallelSpec(tp=1, ep=2, dp=2))


def test_model_file_with_bad_field_names_the_field(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("layers: 2\nhidden: 64\nheads: 4\nkv_heads: 3\nffn: 128\nvocab: 100\n")
    with pytest.raises(SpecError, match="kv_heads"):
        load_model(str(p))
    p.write_text("layers: -2\nhidden: 64\nheads: 4\nkv_heads: 2\nffn: 128\nvocab: 100\n")
    with pytest.raises(SpecError) as e:
        load_model(str(p))
    assert e.value.field == "model.layers"
    p.write_text("layers: 2\nhidden: 64\nheads: 4\nkv_heads: 2\nffn: 128\nvocab: 100\nfoo: 1\n")
    with pytest.raises(SpecError, match="remove it") as e:
        load_model(str(p))
    assert e.value.field == "model.foo"


def test_malformed_and_unsafe_files_are_refused(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_text("gpu: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_hardware(str(p))
    p.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError):
        load_hardware(str(p))
    p.write_text("- a list\n")
    with pytest.raises(SpecError, match="not a mapping"):
        load_hardware(str(p))
    with pytest.raises(SpecError, match="does not exist"):
        load_hardware(str(tmp_path / "missing.json"))
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(SpecError, match="is not a regular file"):  # a folder, /dev/null
        load_hardware(str(tmp_path / "folder.json"))


def test_hardware_file_round_trip(tmp_path):
    h = load_hardware("h100")
    p = tmp_path / "h.json"
    p.write_text(json.dumps(h.model_dump()))
    assert load_hardware(str(p)) == h


def test_mesh_needs_enough_links(tmp_path):
    d = load_hardware("mi300x").model_dump()
    d["topology"]["links_per_gpu"] = 3
    p = tmp_path / "h.json"
    p.write_text(json.dumps(d))
    with pytest.raises(SpecError, match="links"):
        load_hardware(str(p))


def test_unsupported_dtype_names_the_fix():
    with pytest.raises(SpecError, match="--dtype"):
        load_hardware("a100").gpu.flops("fp8")


def test_hf_config_llama_and_mixtral(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
           "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
           "vocab_size": 128256, "hidden_act": "silu"}
    (tmp_path / "llama").mkdir()
    p = tmp_path / "llama" / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.with_(name="llama3-70b") == load_model("llama3-70b")
    moe = from_hf_config({**cfg, "model_type": "mixtral", "num_local_experts": 8,
                          "num_experts_per_tok": 2, "intermediate_size": 14336})
    assert moe.moe is not None and moe.moe.experts == 8 and moe.moe.expert_ffn == 14336
    with pytest.raises(SpecError, match="model_type"):
        from_hf_config({**cfg, "model_type": "bert"})
    with pytest.raises(SpecError) as e:
        from_hf_config({k: v for k, v in cfg.items() if k != "hidden_size"})
    assert e.value.field == "model.hidden_size"


def test_calibration_overrides_and_version(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("plait_calibration: 1\nmeta: {command: test}\nparams: {gemm_peak_fraction: 0.5}\n"
                 "gpu: {dma: {command_overhead_s: 1.0e-6}}\n")
    c = load_calibration(p).apply(load_hardware("mi300x"))
    assert c.params.gemm_peak_fraction == 0.5
    assert c.gpu.dma.command_overhead_s == 1e-6
    assert c.gpu.dma.engines == load_hardware("mi300x").gpu.dma.engines  # partial merge
    p.write_text("plait_calibration: 9\n")
    with pytest.raises(SpecError, match="version"):
        load_calibration(p)
    p.write_text("plait_calibration: 1\nparams: {gemm_peak_fraction: 3}\n")
    with pytest.raises(SpecError, match="gemm_peak_fraction"):
        load_calibration(p).apply(load_hardware("mi300x"))


@given(heads=st.integers(1, 128), tp=st.sampled_from([1, 2, 4, 8, 16]),
       seq=st.integers(1, 4096))
def test_shardable_iff_divisible(heads, tp, seq):
    m = ModelSpec(layers=2, hidden=heads * 8, heads=heads, kv_heads=heads, ffn=64 * 16, vocab=10)
    ok = heads % tp == 0 and seq % tp == 0
    try:
        check_shardable(m, ParallelSpec(tp=tp, seq_len=seq))
        assert ok
    except SpecError as e:
        assert not ok and e.field.startswith("parallel.")


NON_FINITE = [
    ("gpu:\n  launch_overhead_s: .inf\n", "gpu.launch_overhead_s"),
    ("params:\n  gemm_measured: [[bf16, 64, 64, 64, .inf]]\n", "gemm_measured"),
    ("params:\n  gemm_measured: [[bf16, 64, 64, 64, 1.0e-5], [bf16, 128, 64, 64, 2.0e-5], "
     "[bf16, 64, 128, 64, 2.0e-5]]\n", "gemm_measured"),  # an incomplete grid
    ("params:\n  gemm_measured: [[bf16, 64, 64, 64, 0.0]]\n", "gemm_measured"),
    ("params:\n  comm_compute_units: 500\n", "comm_compute_units"),
    ("topology:\n  link_bytes_per_s: .nan\n", "topology.link_bytes_per_s"),
]


@pytest.mark.parametrize(("body", "field"), NON_FINITE)
def test_non_finite_or_impossible_calibration_is_refused_not_looped_on(tmp_path, body, field):
    """These made explore loop forever at 100% CPU (inf - inf in the event loop): now one line
    naming the field, exit 2, within the time bound."""
    import subprocess
    import sys

    cal = tmp_path / "cal.yaml"
    cal.write_text("plait_calibration: 1\n" + body)
    res = subprocess.run([sys.executable, "-m", "plait", "explore", "--calibration", str(cal)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout[-500:] + res.stderr[-500:]
    assert field in res.stderr.replace("\n", "") and "Traceback" not in res.stderr


def test_infinite_peak_in_a_json_hardware_file_is_refused(tmp_path):
    from plait.errors import SpecError
    from plait.spec.hardware import load_hardware

    hw = tmp_path / "hw.json"
    hw.write_text('{"name": "x", "gpu": {"name": "g", "peak_flops": {"bf16": Infinity}, '
                  '"hbm_bytes_per_s": 1e12, "compute_units": 100, "dma": {"engines": 1, '
                  '"bytes_per_s": 1e9, "command_overhead_s": 0}}, '
                  '"topology": {"kind": "switched", "link_bytes_per_s": 1e9}}')
    with pytest.raises(SpecError, match="peak_flops"):
        load_hardware(str(hw))


@pytest.mark.parametrize(("key", "value"), [
    ("num_attention_heads", 8.9), ("num_attention_heads", "32"), ("hidden_size", None),
    ("num_hidden_layers", True), ("vocab_size", [1, 2]), ("intermediate_size", 1e400),
])
def test_hf_config_values_of_the_wrong_type_are_named(key, value):
    """These were read as 8, or raised TypeError/ValueError/OverflowError tracebacks."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 8, "intermediate_size": 128, "vocab_size": 100, key: value}
    with pytest.raises(SpecError, match="model"):
        from_hf_config(config)


def test_a_boolean_is_not_a_layer_count(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text("layers: true\nhidden: 64\nheads: 8\nkv_heads: 8\nffn: 128\nvocab: 100\n")
    with pytest.raises(SpecError, match="layers"):
        load_model(str(spec))


def test_every_number_of_every_hardware_preset_has_a_source():
    """`plait presets --show` prints a source (or `estimate:` and why) for each number; a
    parameter a preset changes from the default carries the preset's own source."""
    from plait.spec.hardware import HARDWARE_PRESETS, CostParams
    from plait.spec.sources import PARAMS, numbers, sources

    defaults = numbers({"params": CostParams().model_dump()})
    for name, make in HARDWARE_PRESETS.items():
        found = numbers(make().model_dump())
        src = sources(name)
        assert set(found) <= set(src), (name, sorted(set(found) - set(src)))
        for path, value in found.items():
            assert src[path].strip(), (name, path)
            if path in defaults and value != defaults[path]:
                assert src[path] != PARAMS[path], (name, path, "changed, default's source")


def test_a_model_is_described_by_itself(tmp_path):
    """torchtitan's model arguments (its FFN width derived as its FeedForward does) and a model
    instance (a Hugging Face model's config, a torchtitan model's model_args) give the spec a
    hand-written config.json gave."""
    import dataclasses
    import json

    import torch

    from plait.errors import SpecError
    from plait.spec.model import from_torchtitan_args, load_model, model_spec_of

    titan_8b = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
                "vocab_size": 128256, "multiple_of": 1024, "ffn_dim_multiplier": 1.3,
                "norm_eps": 1e-5, "rope_theta": 500000}
    path = tmp_path / "llama3_8b_args.json"
    path.write_text(json.dumps(titan_8b))
    want = load_model("llama3-8b")
    assert load_model(str(path)).model_dump() == {**want.model_dump(), "name": "llama3_8b_args"}

    @dataclasses.dataclass
    class TransformerModelArgs:
        dim: int = 8192
        n_layers: int = 80
        n_heads: int = 64
        n_kv_heads: int = 8
        vocab_size: int = 128256
        multiple_of: int = 4096
        ffn_dim_multiplier: float = 1.3

    class Transformer:
        model_args = TransformerModelArgs()

    assert model_spec_of(Transformer()).ffn == load_model("llama3-70b").ffn == 28672
    with pytest.raises(SpecError, match=r"model\.n_heads"):
        from_torchtitan_args({"dim": 64, "n_layers": 2, "vocab_size": 8})
    with pytest.raises(SpecError, match="neither"):
        model_spec_of(object())
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256))
    spec = model_spec_of(hf)
    assert (spec.hidden, spec.ffn, spec.heads, spec.kv_heads, spec.layers) == (64, 128, 4, 2, 2)

    # a torchtitan decoder of 2026: its `config` dataclass, the MLP width from its `w2`
    @dataclasses.dataclass
    class Attention:
        n_heads: int = 4
        n_kv_heads: int | None = 2

    @dataclasses.dataclass
    class Layer:
        attention: Attention = dataclasses.field(default_factory=Attention)

    @dataclasses.dataclass
    class DecoderConfig:
        dim: int = 64
        n_layers: int = 3
        vocab_size: int = 256
        layer: Layer = dataclasses.field(default_factory=Layer)

    decoder = torch.nn.Module()
    decoder.config = DecoderConfig()
    decoder.feed_forward = torch.nn.Module()
    decoder.feed_forward.w2 = torch.nn.Linear(176, 64, bias=False)
    spec = model_spec_of(decoder)
    assert (spec.hidden, spec.ffn, spec.heads, spec.kv_heads, spec.layers, spec.vocab) == (
        64, 176, 4, 2, 3, 256)
    del decoder.feed_forward
    with pytest.raises(SpecError, match="no MLP output projection"):
        model_spec_of(decoder)


def test_one_table_names_the_preset_of_a_device():
    """The tuner and `plait analyze` read a device's preset from one table (they had one each,
    and an L20 was known to one only)."""
    from plait.spec.hardware import DEVICE_PRESETS, HARDWARE_PRESETS, preset_of_device

    assert {preset for _, preset in DEVICE_PRESETS} <= set(HARDWARE_PRESETS)
    for name, want in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                       ("NVIDIA H800", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
                       ("NVIDIA L20", "l20"), ("AMD Instinct MI300X", "mi300x"),
                       ("Tesla V100-SXM2-32GB", None)):
        assert preset_of_device(name) == want, name
