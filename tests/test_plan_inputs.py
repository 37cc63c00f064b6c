"""`plait plan` answers every input: a result, or one line naming the field and the fix (exit
2), never a traceback, a hang or nonsense accepted. Each class a new user met has a test."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.cli.main import app
from plait.errors import InfeasibleError, SpecError
from plait.planner.plan.search import check_fixed, parse_layout, plan
from plait.planner.plan.space import divisors
from plait.planner.plan.step import Job
from plait.spec.hardware import load_hardware
from plait.spec.model import load_model

runner = CliRunner()


def _job(model: str = "llama3-8b", gpus: int = 8, batch: int = 16, seq: int = 8192) -> Job:
    cluster = load_hardware("h100")
    return Job(load_model(model), cluster, gpus, seq, batch, cluster.gpu.memory_bytes)


@pytest.mark.parametrize("seq", [8190, 4100, 3])
def test_a_sequence_no_schedule_can_cut_leaves_that_schedule_out_not_the_plan(seq):
    """`--seq-len 8190` ended the whole search: a named tool's schedule (fine/sm/c4) did not
    split out_proj's 8190 rows into 2 shards x 4 sub-chunks."""
    r = plan(_job(seq=seq), keep=3)
    assert r.ranked


def test_a_layout_no_schedule_can_run_is_left_out_and_named(tmp_path):
    """An MoE of 1,024 experts: no schedule cuts an expert's few rows over 8 ranks; the
    layout cannot run, and the plan says so instead of ending."""
    config = tmp_path / "moe.json"
    config.write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 4,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 32000, "num_local_experts": 1024, "num_experts_per_tok": 2}))
    res = runner.invoke(app, ["plan", "-m", str(config), "--seq-len", "1024"],
                        env={"COLUMNS": "200"})
    assert res.exit_code in (0, 1), res.output
    assert "Traceback" not in res.output and "cannot run" in res.output


@pytest.mark.parametrize(("model", "gpus", "batch", "layout", "label"), [
    ("llama3-70b", 64, 512, "tp=4,pp=4,cp=2,vp=5,micro_batch=1", "int.v5"),  # NeMo's 70B
    ("llama3-405b", 576, 252, "tp=8,pp=9,cp=2,vp=7,micro_batch=1", "int.v7"),  # NeMo's 405B
])
def test_published_interleaved_layouts_can_be_entered(model, gpus, batch, layout, label):
    r = plan(_job(model, gpus, batch), keep=3, fixed=parse_layout(layout))
    assert r.ranked
    lay = r.ranked[0].layout
    assert (lay.schedule, f"int.v{lay.vp}") == ("interleaved", label)


def test_a_micro_batch_of_any_size_that_divides_is_accepted():
    r = plan(_job(batch=128, seq=1024), keep=3, fixed=parse_layout("dp=8,micro_batch=8"))
    assert r.ranked and {p.layout.micro_batch for p in r.ranked} == {8}


@pytest.mark.parametrize(("model", "gpus", "batch", "layout", "field"), [
    ("llama3-8b", 8, 16, "tp=3", "layout.tp"),  # 32 heads
    ("llama3-8b", 8, 16, "tp=16", "layout.tp"),  # above the GPUs
    ("llama3-8b", 64, 64, "pp=32", "layout.pp"),  # above half the layers
    ("llama3-8b", 8, 16, "cp=3", "layout.cp"),
    ("llama3-8b", 8, 16, "ep=2", "layout.ep"),  # a dense model
    ("llama3-8b", 8, 16, "dp=3", "layout.dp"),
    ("llama3-8b", 8, 16, "tp=2,micro_batch=3", "layout.micro_batch"),
    ("llama3-70b", 64, 128, "pp=4,vp=8", "layout.vp"),  # 20-layer stages in 8 chunks
    ("llama3-70b", 64, 128, "tp=8,pp=8,ac=full,ac_layers=11", "layout.ac_layers"),
])
def test_an_impossible_layout_names_the_rule_it_breaks(model, gpus, batch, layout, field):
    """Every impossible `--layout` said "choose a global batch divisible by the
    data-parallel size": each now names its own field, its rule and the values that do."""
    job = _job(model, gpus, batch)
    with pytest.raises(SpecError) as err:
        plan(job, keep=1, fixed=parse_layout(layout))
    assert err.value.field == field, err.value
    assert "choose" in err.value.fix or "between" in err.value.fix, err.value
    with pytest.raises(SpecError):  # the check alone says the same
        check_fixed(job, parse_layout(layout))


@pytest.mark.parametrize(("text", "field"), [
    ("ac=FULL", "layout.ac"), ("schedule=1f1b", "layout.schedule"), ("zero=2", "layout.zero"),
    ("tp=2,tp=4", "layout.tp"), ("tp=\uff11", "layout.tp"), ("tp=1_0", "layout.tp"),
    ("tp=0", "layout.tp"), ("tp=-2", "layout.tp"), ("overlap=fast", "layout.overlap"),
])
def test_a_layout_text_is_read_strictly(text, field):
    """Duplicates (the last one won), full-width digits and `1_0` (read as numbers by
    int()), a misspelt word: each one line naming the field."""
    with pytest.raises(SpecError) as err:
        parse_layout(text)
    assert err.value.field == field


@pytest.mark.parametrize(("argv", "field"), [
    (["--memory-gib", "0"], "memory-gib"), (["--memory-gib", "inf"], "memory-gib"),
    (["--layout", "dp=8,overlap=plain", "--measured", "inf"], "measured"),
    (["--layout", "dp=8,overlap=plain", "--measured", "5000", "--save-calibration", "."],
     "save-calibration"),
    (["--json", "/proc/no/such/dir/plan.json"], "json"),
])
def test_bad_options_are_one_line_before_any_work(argv, field):
    res = runner.invoke(app, ["plan", *argv])
    assert res.exit_code == 2, res.output
    assert f"{field}:" in res.output and "Traceback" not in res.output


def _hf(tmp_path, **changes):
    config = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 4,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8}
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(("changes", "field"), [
    ({"model_type": None}, "model.model_type"),
    ({"num_local_experts": "eight"}, "model.num_local_experts"),
    ({"num_local_experts": 0}, "model.num_local_experts"),
    ({"num_key_value_heads": 0}, "model.num_key_value_heads"),
    ({"intermediate_size": 10**24}, "model.intermediate_size"),
    ({"hidden_size": 2**40}, "model.hidden_size"),
])
def test_a_hugging_face_config_is_refused_by_its_own_key(tmp_path, changes, field):
    """A config without `model_type` said `model.layers: Field required`; 0 key/value heads
    or experts were read as other values; a huge dimension overflowed the memory model."""
    with pytest.raises(SpecError) as err:
        load_model(_hf(tmp_path, **changes))
    assert err.value.field == field, err.value


def test_a_config_file_without_a_suffix_is_read(tmp_path):
    path = tmp_path / "mymodel"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024,
                                "num_hidden_layers": 4, "num_attention_heads": 8,
                                "intermediate_size": 4096, "vocab_size": 1000}))
    assert load_model(str(path)).layers == 4


@pytest.mark.parametrize("gpus", ["1000000000", "2147483647"])
def test_a_huge_cluster_is_answered_at_once(gpus):
    """`divisors()` counted to n: a billion GPUs hung the planner."""
    res = runner.invoke(app, ["plan", "--gpus", gpus])
    assert res.exit_code == 2 and "global batch" in res.output


@given(st.integers(1, 20_000))
def test_divisors_are_every_divisor_in_order(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_nothing_fits_exits_1_with_or_without_json_on_stdout():
    for extra in ([], ["--json", "-"]):
        res = runner.invoke(app, ["plan", "-m", "llama3-405b", "--gpus", "8", *extra])
        assert res.exit_code == 1, (extra, res.output)


def test_a_clock_too_low_to_be_a_power_limit_is_refused():
    from plait.spec.hardware import CostParams

    with pytest.raises(ValueError, match="clock_fraction"):
        CostParams(clock_fraction=1e-300)


def test_a_fit_that_does_not_converge_is_not_reported_as_a_fit(monkeypatch):
    """The fit returned its closest clock as a fit whatever its error: a step that jumps
    across the measured one at every clock never converges, and is said so."""
    from dataclasses import replace

    from plait.planner.plan import calibrate
    from plait.planner.plan.search import measured_layout

    job = _job(batch=128)
    lay, _ = measured_layout(job, parse_layout("dp=8,overlap=plain"))
    p = job.predict(lay, ("plain",))
    calls = {"n": 0}

    class Jumping:  # the job at any other clock: 1.3x, then 0.8x the step, and so on
        def predict(self, *a, **k):
            calls["n"] += 1
            return replace(p, step_s=p.step_s * (1.3 if calls["n"] % 2 else 0.8))

    monkeypatch.setattr(calibrate, "at_clock", lambda j, c: Jumping())
    with pytest.raises(InfeasibleError, match="no clock makes"):
        calibrate.fit_clock(job, lay, "plain", p.tokens_per_s_per_gpu * 0.9)
    assert calls["n"] >= 1


# -- --compare: plait's first choice beside the user's layout --------------------------------


def test_a_compared_layout_is_shown_part_by_part_and_the_parts_add_up(tmp_path):
    from plait.planner.plan.compare import PARTS, Comparison, breakdown
    from plait.planner.plan.search import one_layout, predict_given

    job = _job("llama3-70b", 64, 128)
    chosen = plan(job, keep=1).ranked[0]
    given = predict_given(job, one_layout(job, parse_layout(
        "tp=8,pp=4,schedule=1F1B,ac=selective")))
    for p in (chosen, given):
        parts = breakdown(job, p)
        assert list(parts) == list(PARTS) and sum(parts.values()) == pytest.approx(p.step_s)
        assert min(parts.values()) >= -1e-9
    c = Comparison(job, chosen, given)
    assert parts["recompute"] > 0 and not c.tie and c.preferred is chosen
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "-m", "llama3-70b", "--gpus", "64", "--global-batch",
                              "128", "--compare", "tp=8,pp=4,schedule=1F1B,ac=selective",
                              "--json", str(out)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "yours" in res.output and max(len(line) for line in res.output.splitlines()) <= 80
    doc = json.loads(out.read_text())["compare"]
    assert doc["given"]["breakdown_s"]["recompute"] > 0 and doc["preferred"] == "chosen"


def test_steps_within_the_models_error_are_a_tie_that_prefers_memory_headroom():
    from dataclasses import replace

    from plait.planner.plan.compare import RANKING_ERROR, Comparison

    job = _job("llama3-70b", 64, 128)
    chosen = plan(job, keep=1).ranked[0]
    roomy = replace(chosen, step_s=chosen.step_s * (1 + RANKING_ERROR / 2),
                    memory=replace(chosen.memory, activations=0.0))
    c = Comparison(job, chosen, roomy)
    assert c.tie and c.preferred is roomy
    slower = replace(roomy, step_s=chosen.step_s * (1 + 2 * RANKING_ERROR))
    assert Comparison(job, chosen, slower).preferred is chosen


@pytest.mark.parametrize(("argv", "field"), [
    (["--compare", "tp=3"], "compare.tp"), (["--compare", "tp=8,tp=4"], "compare.tp"),
    (["--compare", "tp=8,pp=3"], "compare.pp"),
    (["--headroom-gib", "-1"], "headroom-gib"), (["--headroom-gib", "90"], "headroom-gib"),
])
def test_a_wrong_compare_or_headroom_is_one_line(argv, field):
    res = runner.invoke(app, ["plan", "-m", "llama3-70b", "--gpus", "64", "--global-batch",
                              "128", *argv])
    assert res.exit_code == 2, res.output
    assert f"{field}:" in res.output and "Traceback" not in res.output


def test_headroom_keeps_memory_free_on_every_layout():
    from plait.planner.plan.memory import GiB

    cluster = load_hardware("h100")
    job = Job(load_model("llama3-70b"), cluster, 64, 8192, 128,
              cluster.gpu.memory_bytes - 20 * GiB)
    r = plan(job, keep=10)
    assert r.ranked and all(p.memory.total <= cluster.gpu.memory_bytes - 20 * GiB
                            for p in r.ranked)


def test_a_compared_pipeline_without_a_schedule_runs_megatrons_default():
    from plait.planner.plan.search import one_layout

    job = _job("llama3-70b", 64, 128)
    assert one_layout(job, parse_layout("tp=8,pp=4")).schedule == "1F1B"
    assert one_layout(job, parse_layout("tp=8,pp=4,vp=5")).schedule == "interleaved"


def test_the_ranking_marks_the_layouts_the_model_cannot_tell_from_the_first(tmp_path):
    """llama3-8b on 8 H100s ranked a layout at 76.8 GiB 0.1% above one at 60.3 GiB with
    nothing marking the tie: rows within the model's error of the first are marked, and the
    one keeping the most memory named."""
    from plait.planner.plan.compare import RANKING_ERROR

    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--json", str(out)], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    layouts = json.loads(out.read_text())["layouts"]
    first = layouts[0]["step_s"]
    for lay in layouts:
        assert lay["tie_with_first"] == (lay["step_s"] <= first * (1 + RANKING_ERROR))
    assert layouts[1]["tie_with_first"] and " 2≈ " in res.output
    assert "keeps the most memory free" in res.output
