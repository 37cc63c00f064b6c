"""`plait plan`: the layout space, the memory and step models, the search and its command."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.cli.main import app
from plait.planner.plan.memory import GiB, local_params, memory, params_of, saved_bytes
from plait.planner.plan.search import parse_layout, plan
from plait.planner.plan.space import Layout, layouts
from plait.planner.plan.step import Job
from plait.spec.hardware import load_hardware
from plait.spec.model import load_model
from plait.workload.operators import CollectiveKind


def _job(model: str = "llama3-8b", hw: str = "h100", gpus: int = 8, batch: int = 16,
         seq: int = 8192) -> Job:
    cluster = load_hardware(hw)
    return Job(load_model(model), cluster, gpus, seq, batch, cluster.gpu.memory_bytes)


def test_parameter_counts_are_the_published_ones():
    # Llama-3-8B: 8.03 B (Meta's model card), Llama-3-70B: 70.6 B, Mixtral 8x7B: 46.7 B
    assert params_of(load_model("llama3-8b")).total(32) == pytest.approx(8.03e9, rel=2e-3)
    assert params_of(load_model("llama3-70b")).total(80) == pytest.approx(70.55e9, rel=2e-3)
    assert params_of(load_model("mixtral-8x7b")).total(32) == pytest.approx(46.7e9, rel=3e-3)


def test_every_layout_uses_the_gpus_and_the_batch_exactly():
    job = _job("llama3-70b", gpus=64, batch=128)
    seen = list(layouts(job.model, job.cluster, 64, 8192, 128))
    assert len(seen) > 100
    for lay in seen:
        assert lay.gpus == 64
        assert lay.dp * lay.micro_batch * lay.micro_batches == 128
        assert lay.tp <= job.cluster.gpus_per_node and job.model.heads % lay.tp == 0
        assert lay.pp == 1 or lay.micro_batches >= lay.pp


def test_nvl72_lets_tensor_parallelism_past_eight():
    job = _job("llama3-70b", "gb200-nvl72", gpus=64, batch=64)
    assert max(lay.tp for lay in layouts(job.model, job.cluster, 64, 8192, 64)) == 64
    assert max(lay.tp for lay in layouts(job.model, load_hardware("h100"), 64, 8192, 64)) == 8


def test_memory_falls_with_checkpointing_and_sharding():
    model = load_model("llama3-70b")
    base = Layout(tp=8, pp=2, dp=4, micro_batches=8, schedule="1F1B")
    by_ac = [memory(model, Layout(**{**_fields(base), "ac": ac}), 8192).activations
             for ac in ("none", "selective", "full")]
    assert by_ac[0] > by_ac[1] > by_ac[2]
    z1 = memory(model, base, 8192)
    z3 = memory(model, Layout(**{**_fields(base), "zero": 3}), 8192)
    assert z3.params + z3.grads + z3.optimizer < z1.params + z1.grads + z1.optimizer
    # 1F1B's first stage holds pp micro-batches; co-execution one more
    coexec = memory(model, Layout(**{**_fields(base), "overlap": "coexec"}), 8192)
    assert coexec.activations == pytest.approx(z1.activations * 3 / 2, rel=0.2)


def test_model_state_is_megatrons_and_fsdps_bytes_per_parameter():
    # bf16 weights, fp32 gradients: 6 + 12/d bytes (Megatron-LM's distributed optimizer),
    # 16/d under FSDP2; a pipeline's FSDP keeps its stage gathered with unsharded gradients
    model = load_model("llama3-8b")
    n = params_of(model).total(model.layers)
    z1 = memory(model, Layout(dp=8), 8192)
    assert z1.params + z1.grads + z1.optimizer == pytest.approx(n * (6 + 12 / 8), rel=1e-9)
    z3 = memory(model, Layout(dp=8, zero=3), 8192)
    assert z3.params + z3.grads + z3.optimizer == pytest.approx(n * 16 / 8, rel=1e-9)
    piped = memory(model, Layout(pp=2, dp=4, micro_batches=4, zero=3, schedule="1F1B"), 8192)
    assert piped.buffers >= n / 2 * 6 > z3.buffers


def test_fused_and_transformer_engine_layers_save_what_their_kernels_keep():
    model = load_model("llama3-70b")  # h 8192, 64/8 heads of 128, SwiGLU 28672
    tokens, tp = 8192, 4
    shard, h, q, kv, f = tokens // tp, 8192, 2048, 256, 7168
    attention = tokens * (q + 2 * kv) * 2 + tokens * q * 2 + 16 * tokens * 4
    fused = (2 * (shard * h * 2 + shard * 4 + tokens * h * 2) + attention
             + tokens * f * 3 * 2)
    assert saved_bytes(model, tokens, tp, "none", stack="fused") == fused
    te_fp8 = (2 * (shard * h * 2 + shard * 4 + shard * h) + attention + tokens * q
              + tokens * f * (4 + 1))
    assert saved_bytes(model, tokens, tp, "none", stack="te", fp8=True) == te_fp8
    eager = saved_bytes(model, tokens, tp, "none")
    assert te_fp8 < saved_bytes(model, tokens, tp, "none", stack="te") < fused < eager
    # full checkpointing keeps the block's input; torchtitan's op-level SAC matmul outputs
    assert saved_bytes(model, tokens, tp, "full", stack="te", fp8=True) == \
        saved_bytes(model, tokens, tp, "full")
    assert saved_bytes(model, tokens, tp, "selective", stack="fused") == \
        saved_bytes(model, tokens, tp, "selective")
    # Megatron-LM's selective recomputation drops what the attention kernel keeps for its
    # backward: its log-sum-exp, and its output where the linear caches an FP8 copy
    for fp8 in (False, True):
        kept = saved_bytes(model, tokens, tp, "none", stack="te", fp8=fp8)
        assert kept - saved_bytes(model, tokens, tp, "selective", stack="te", fp8=fp8) == \
            16 * tokens * 4 + (tokens * q * 2 if fp8 else 0)


def test_megatrons_selective_recomputation_runs_the_attention_forward_again():
    """Korthikanti et al.: on Megatron-LM's stack selective recomputation recomputes the core
    attention; with a fused attention kernel that is the kernel's forward, a few percent of a
    step, against full recomputation's whole forward (29% slower on their 530B GPT-3)."""
    from plait.cost.gemm import attention_time
    from plait.workload.operators import Attention

    job = _job("llama3-70b", gpus=64, batch=128)
    lay = Layout(tp=8, pp=4, dp=2, micro_batches=64, schedule="1F1B", ac="selective")
    lt = job.layer(lay)
    attn = [op for op in job._explored[lay.shape][0].layer.forward if isinstance(op, Attention)]
    assert attn and lt.recompute_selective == pytest.approx(
        sum(attention_time(op, job.cluster) for op in attn))
    assert 0 < lt.recompute_selective < 0.25 * lt.compute_fwd


@pytest.mark.parametrize(("model", "gpus", "batch", "layout"), [
    ("llama3-70b", 64, 128, "tp=4,pp=8,vp=5,dp=2,micro_batches=64,schedule=interleaved"),
    ("llama3-405b", 1024, 512, "tp=8,pp=8,vp=8,cp=2,dp=8,micro_batches=64,schedule=interleaved"),
    ("gpt3-175b", 512, 2048,
     "tp=4,pp=8,vp=6,dp=16,micro_batch=2,micro_batches=64,schedule=interleaved"),
])
def test_nvidias_published_fp8_layouts_fit_an_80_gb_h100(model, gpus, batch, layout):
    """Megatron-Bridge 25.11 and NeMo 24.12 ran these on DGX H100 (bench/plan_fidelity.py)."""
    cluster = load_hardware("h100")
    seq = 2048 if model == "gpt3-175b" else 8192
    job = Job(load_model(model), cluster, gpus, seq, batch, cluster.gpu.memory_bytes, "fp8")
    assert job.stack == "te"
    assert job.memory(Layout(**parse_layout(layout))).total <= cluster.gpu.memory_bytes  # type: ignore[arg-type]


def test_data_parallel_reduces_fp32_gradients_and_its_hidden_collectives_slow_compute():
    job = _job("llama3-8b", gpus=128, batch=256)
    lay = Layout(dp=128, micro_batch=2, ac="selective", zero=3)
    p = job.predict(lay, ("plain",))
    n = params_of(job.model).total(job.model.layers)
    ag = job.collective_s(CollectiveKind.AG, n * 2, 128, 1)
    rs = job.collective_s(CollectiveKind.RS, n * 4, 128, 1)
    assert rs > 1.9 * ag
    assert p.parts["dp_comm"] == pytest.approx(2 * ag + rs)
    hidden = p.parts["dp_comm"] - p.parts["dp_exposed"]
    slow = job.cluster.params.gemm_slowdown_sm_comm
    assert p.parts["dp_contention"] == pytest.approx(slow * hidden)
    assert p.step_s == pytest.approx(sum(p.parts[k] for k in (
        "pipeline", "dp_exposed", "dp_contention", "optimizer", "sync")))
    # the same layout on 8 GPUs (NVLink) hides less communication for less time
    small = _job("llama3-8b").predict(Layout(dp=8, micro_batch=2, ac="selective", zero=3),
                                      ("plain",))
    assert small.parts["dp_contention"] < p.parts["dp_contention"] / 5
    assert small.tokens_per_s_per_gpu > p.tokens_per_s_per_gpu


def test_fsdp_in_a_pipeline_gathers_once_and_reduces_after_the_last_backward():
    job = _job("llama3-70b", gpus=64, batch=64)
    lay = Layout(tp=8, pp=2, dp=4, micro_batches=16, ac="full", zero=3, schedule="1F1B")
    p = job.predict(lay, ("plain",))
    n = local_params(job.model, lay).total  # a stage of one TP rank
    rs = job.collective_s(CollectiveKind.RS, n * 4, 4, 8)
    assert p.parts["dp_comm"] < 2 * rs  # once a step, not once a micro-batch
    assert p.parts["dp_exposed"] >= rs  # all of it after the stage's last backward


@pytest.mark.parametrize(("schedule", "pp", "vp", "m"), [
    ("1F1B", 4, 1, 16), ("1F1B", 8, 1, 8), ("interleaved", 4, 2, 16), ("interleaved", 8, 4, 32),
    ("DualPipeV", 4, 2, 16), ("DualPipeV", 8, 2, 64)])
def test_in_flight_micro_batches_are_the_simulated_peak(schedule, pp, vp, m):
    from plait.planner.plan.memory import in_flight
    from plait.sim.pipeline import Costs, dualpipe_v, interleaved_1f1b, simulate

    lists = dualpipe_v(pp, m) if schedule == "DualPipeV" else interleaved_1f1b(pp, vp, m)
    run = simulate(lists, Costs(lambda _s: 1.0, lambda _s: 2.0, lambda _s: 0.6))
    chunks = max(run.peak_activations)  # stage-micro-batches held, in chunks of one rank
    assert in_flight(Layout(pp=pp, vp=vp, micro_batches=m, schedule=schedule)) == chunks / vp


def _fields(lay: Layout) -> dict[str, object]:
    return {f: getattr(lay, f) for f in Layout.__slots__}  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_bound_never_exceeds_the_prediction(data):
    """Branch and bound is exact only if every layout's bound is below its prediction."""
    job = _job("llama3-70b", gpus=64, batch=64)
    all_layouts = list(layouts(job.model, job.cluster, 64, 8192, 64))
    lay = data.draw(st.sampled_from(all_layouts))
    assert job.bound_s(lay) <= job.predict(lay).step_s * (1 + 1e-9)


def test_the_search_ranks_what_fits_best_first_and_prunes_by_bound():
    r = plan(_job("llama3-70b", gpus=64, batch=128), keep=5)
    steps = [p.step_s for p in r.ranked]
    assert len(steps) == 5 and steps == sorted(steps)
    assert all(p.fits and p.memory.total <= 81559 * 2**20 for p in r.ranked)
    assert r.chosen is r.ranked[0]
    assert 0 < r.predicted < r.fitting <= r.considered and r.pruned > 0
    # what overlap gives is the same layout run plainly; what it hides is no longer exposed
    assert all(p.plain_step_s >= p.step_s for p in r.ranked)
    job = r.job
    for p in r.ranked:
        plain = job.predict(p.layout, ("plain",))
        assert p.exposed_comm_s <= plain.exposed_comm_s * (1 + 1e-9)


def test_exhaustive_and_bounded_search_agree_on_the_best():
    job = _job(gpus=8, batch=8)
    bounded = plan(job, keep=3)
    everything = plan(job, keep=10**6)
    assert everything.pruned == 0
    assert [p.layout for p in bounded.ranked] == [p.layout for p in everything.ranked[:3]]


def test_eager_kernels_cost_more_than_fused_ones_by_their_traffic():
    from plait.planner.plan.eager import eager_bytes

    lay = Layout(tp=2, dp=4, micro_batches=2)
    fused, eager = _job(), _job()
    eager.kernels = "eager"
    lf, le = fused.layer(lay), eager.layer(lay)
    assert le.fwd["plain"] > lf.fwd["plain"] and le.bwd["plain"] > lf.bwd["plain"]
    # the difference is the eager traffic less the fused kernels' (at the HBM rate)
    c = fused.cluster
    bw = c.gpu.hbm_bytes_per_s * c.params.hbm_fraction
    assert le.recompute_selective > eager_bytes(fused.model, 8192, 2)[0] / bw
    assert eager.predict(lay).step_s > fused.predict(lay).step_s


def test_fp8_training_pays_its_casts_and_bf16_none():
    lay = Layout(tp=4, dp=2, micro_batches=2)
    bf16 = _job()
    cluster = load_hardware("h100")
    fp8 = Job(load_model("llama3-8b"), cluster, 8, 8192, 16, cluster.gpu.memory_bytes, "fp8")
    assert bf16.fp8_casts_s(lay) == (0.0, 0.0)
    fwd, bwd = fp8.fp8_casts_s(lay)
    assert 0 < fwd < bwd  # the outputs' gradients (q, k, v, gate and up) outnumber the inputs
    twice = Layout(tp=4, dp=2, micro_batch=2, micro_batches=1)
    launches = 4 * cluster.gpu.launch_overhead_s  # a cast per linear
    assert fp8.fp8_casts_s(twice)[0] - launches == pytest.approx(2 * (fwd - launches),
                                                                 rel=1e-3)


def test_flash_attention_2_is_slower_than_cudnns_as_measured():
    """FlashAttention-2's fitted rates against cuDNN's, at the FlashAttention-3 paper's 16k
    points: 335 vs 539 TFLOP/s forward (causal), 322 vs 516 backward."""
    from plait.cost.gemm import attention_time
    from plait.workload.operators import Attention

    h100 = load_hardware("h100")
    for backward, causal, fa2, cudnn in ((False, True, 335, 539), (True, False, 322, 516)):
        a = Attention("attn", 16384, 16384, 16, 128, causal=causal, backward=backward)
        rate = {k: a.flops / (attention_time(a, h100.with_attention(k))
                              - h100.gpu.launch_overhead_s) / 1e12 for k in ("fa2", "cudnn")}
        assert rate["fa2"] == pytest.approx(fa2, rel=0.1)
        assert rate["cudnn"] == pytest.approx(cudnn, rel=0.1)
    assert h100.with_attention("cudnn") is h100


def test_the_torchtitan_settings_say_when_torchtitan_cannot_run_the_overlap():
    from plait.planner.plan.torchtitan import torchtitan_settings

    dpv = Layout(tp=8, pp=2, vp=2, dp=4, micro_batches=8, schedule="DualPipeV",
                 overlap="coexec", zero=3)
    one = Layout(tp=8, pp=2, dp=4, micro_batches=8, schedule="1F1B", overlap="coexec", zero=3)
    assert torchtitan_settings(dpv, 32, 40)["realizable"]
    settings = torchtitan_settings(one, 32, 40)
    assert not settings["realizable"] and "schedule=DualPipeV" in settings["plait"][0]
    assert settings["parallelism"]["pipeline_parallel_schedule"] == "1F1B"


def test_a_pinned_layout_is_evaluated_the_same_way():
    r = plan(_job("llama3-70b", gpus=64, batch=128), keep=50,
             fixed=parse_layout("tp=8,pp=2,ac=full"))
    assert r.ranked and all((p.layout.tp, p.layout.pp, p.layout.ac) == (8, 2, "full")
                            for p in r.ranked)


def test_a_pinned_overlap_is_the_only_one_tried():
    """`overlap=ficco` in --layout: every layout runs plait's schedule per pair, even where
    plain PyTorch TP would be faster; co-execution is pinned only where it can run."""
    job = _job("llama3-70b", gpus=64, batch=128)
    r = plan(job, keep=20, fixed=parse_layout("tp=8,pp=2,ac=full,overlap=ficco"))
    assert r.ranked and {p.layout.overlap for p in r.ranked} == {"ficco"}
    lay = Layout(tp=8, pp=2, dp=4, micro_batches=32, ac="full", schedule="1F1B")
    assert job.predict(lay, ("plain",)).layout.overlap == "plain"
    coexec = plan(job, keep=20, fixed=parse_layout("tp=8,ac=full,overlap=coexec"))
    assert all(p.layout.overlap == "coexec" and p.layout.micro_batches >= 2
               for p in coexec.ranked)


def test_a_measured_step_fits_the_clock_that_predicts_it():
    """A job whose part runs at 0.6 of its clock measures some tokens/s; fitting the preset
    (clock 1) to that measurement recovers 0.6, and the fitted job predicts the measurement."""
    from plait.planner.plan.calibrate import at_clock, fit_clock

    job = _job("llama3-70b", gpus=64, batch=128)
    lay = Layout(tp=8, pp=2, dp=4, micro_batches=32, ac="full", schedule="1F1B",
                 overlap="ficco")
    truth = at_clock(job, 0.6).predict(lay, ("ficco",)).tokens_per_s_per_gpu
    fit, fitted = fit_clock(job, lay, "ficco", truth)
    assert fit.clock_fraction == pytest.approx(0.6, rel=5e-3)
    assert fit.preset_clock_fraction == 1.0 and fit.ratio == pytest.approx(1 / 0.6, rel=0.2)
    assert fit.after.tokens_per_s_per_gpu == pytest.approx(truth, rel=2e-3)
    assert fitted.predict(lay, ("ficco",)).tokens_per_s_per_gpu == fit.after.tokens_per_s_per_gpu
    assert "clock 0.60" in fitted.cluster.name
    from plait.errors import InfeasibleError

    with pytest.raises(InfeasibleError, match="faster than plait predicts"):
        fit_clock(job, lay, "ficco", 3 * fit.before.tokens_per_s_per_gpu)


def test_the_saved_calibration_closes_the_loop(tmp_path):
    """plan -> run -> measure -> calibrate: the file `--save-calibration` writes, given back
    as `--calibration`, predicts the measured step for the measured layout."""
    cal = tmp_path / "fit.yaml"
    base = ["plan", "-m", "llama3-8b", "-H", "h100-500w", "--gpus", "8", "--global-batch", "16",
            "--kernels", "eager", "--attention", "fa2", "--layout",
            "dp=8,micro_batch=2,ac=selective,zero=3,overlap=plain"]
    res = runner.invoke(app, [*base, "--measured", "5762", "--save-calibration", str(cal),
                              "--json", str(tmp_path / "fit.json")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "fit.json").read_text())
    assert doc["measured"]["clock_fraction"]["preset"] == pytest.approx(0.715)
    assert doc["measured"]["ratio"] > 1 and doc["chosen"]["tokens_per_s_per_gpu"] == \
        pytest.approx(5762, rel=2e-3)
    res = runner.invoke(app, [*base, "--calibration", str(cal), "--json", "-"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    assert again["chosen"]["tokens_per_s_per_gpu"] == pytest.approx(5762, rel=2e-3)
    assert "fit.yaml" in again["hardware"]
    # the calibration records the stack it was fitted under and applies it: without
    # --kernels/--attention the next plan runs eager kernels and FlashAttention-2, as fitted
    # (it ranked fused kernels against an eager measurement)
    layout = base.index("--layout")
    res = runner.invoke(app, [*base[:9], *base[layout:layout + 2], "--calibration", str(cal),
                              "--json", "-"])
    assert res.exit_code == 0, res.output
    applied = json.loads(res.stdout)
    assert (applied["kernels"], applied["attention"]) == ("eager", "fa2")
    assert applied["chosen"]["tokens_per_s_per_gpu"] == pytest.approx(5762, rel=2e-3)
    res = runner.invoke(app, [*base[:9], "--calibration", str(cal), "--kernels", "fused"])
    assert "fitted under" in res.output and "'kernels': 'fused'" in res.output


def test_a_model_too_big_for_the_gpus_says_what_the_smallest_layout_needs():
    r = plan(_job("llama3-405b", gpus=8, batch=8))
    assert not r.ranked and r.too_big and r.too_big[0].memory.total > 80 * GiB


runner = CliRunner()


def test_the_command_writes_the_ranking_and_the_chosen_plan_as_json(tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "-m", "llama3-8b", "--gpus", "8", "--global-batch", "16",
                              "--top", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    keys = {"tp", "pp", "vp", "cp", "ep", "dp", "micro_batch", "micro_batches", "ac", "step_s",
            "mfu", "tokens_per_s_per_gpu", "memory_gib", "fits", "overlap_gain"}
    assert len(doc["layouts"]) == 3 and all(keys <= set(lay) for lay in doc["layouts"])
    assert doc["chosen"]["step_s"] == doc["layouts"][0]["step_s"]
    assert doc["chosen"]["torchtitan"]["parallelism"]["tensor_parallel_degree"] == \
        doc["chosen"]["tp"]
    assert "Megatron-LM" in doc["mfu_convention"]


def test_the_ranking_fits_an_80_column_terminal_with_every_layout_named(tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "-m", "llama3-8b", "--gpus", "8", "--global-batch", "16",
                              "--top", "3", "--json", str(out)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    for lay in json.loads(out.read_text())["layouts"]:
        label = " ".join(f"{k}{lay[k]}" for k in ("tp", "cp", "pp", "ep") if lay[k] > 1)
        assert f"{label} dp{lay['dp']}".strip() in res.output
    assert "left out to fit 80 columns" in res.output


@pytest.mark.parametrize(("argv", "field"), [
    (["--layout", "tp=x"], "layout.tp"), (["--layout", "color=1"], "layout"),
    (["--gpus", "0"], "gpus"), (["--dtype", "int4"], "dtype"),
    (["--attention", "fa9"], "attention"), (["--kernels", "jit"], "kernels"),
    (["-m", "no-such-model"], "model"), (["--layout", "overlap=fast"], "layout.overlap"),
    (["--layout", "dp=8", "--measured", "5000"], "layout"),
    (["--layout", "dp=8,overlap=plain", "--measured", "-1"], "measured"),
    (["--layout", "tp=3,overlap=plain", "--measured", "5000"], "layout.tp"),
    (["--save-calibration", "x.yaml"], "save-calibration"),
])
def test_bad_input_is_one_line_naming_the_field(argv, field):
    res = runner.invoke(app, ["plan", *argv])
    assert res.exit_code == 2
    assert f"{field}:" in res.output and "Traceback" not in res.output


def test_checkpointing_some_layers_costs_and_saves_in_proportion():
    """Megatron-LM's recompute_num_layers: full checkpointing on k of a rank's n layers
    recomputes k forwards and saves k layers' worth of activations, the rest as without it."""
    from dataclasses import replace

    from plait.planner.plan.space import stage_layers

    job = _job("llama3-70b", gpus=64, batch=128)
    none = Layout(tp=8, pp=4, dp=2, micro_batches=64, schedule="1F1B")
    full = replace(none, ac="full")
    n, k = stage_layers(job.model, none), 5
    part = replace(full, ac_layers=k)
    assert n == 20 and part.ac_label == "ful5" and full.ac_label == "ful"

    def pipe(lay: Layout) -> float:
        return job.pipeline_s(lay, "plain", None)

    assert pipe(part) - pipe(none) == pytest.approx(k / n * (pipe(full) - pipe(none)))
    assert pipe(replace(full, ac_layers=n)) == pytest.approx(pipe(full))
    acts = {lay.ac_label: job.memory(lay).activations for lay in (none, part, full)}
    moment = saved_bytes(job.model, 8192, 8, "none", 2, job.stack)  # the layer recomputed
    assert acts["ful5"] - moment == pytest.approx(
        k / n * (acts["ful"] - moment) + (n - k) / n * acts["non"])
    assert acts["ful"] < acts["ful5"] < acts["non"]


def test_the_search_checkpoints_the_fewest_layers_that_fit():
    """Each layer checkpointed costs time and saves memory: the plan's full-checkpointing
    layouts recompute the fewest of their layers that fit, and none where none fits."""
    from dataclasses import replace

    cluster = load_hardware("h100")
    job = Job(load_model("llama3-70b"), cluster, 64, 8192, 128, 40 * GiB)
    r = plan(job, keep=30)
    partial = [p.layout for p in r.ranked if p.layout.ac == "full" and p.layout.ac_layers]
    assert partial, [p.layout.ac_label for p in r.ranked]
    for lay in partial:
        assert job.memory(lay).total <= job.memory_bytes
        fewer = (replace(lay, ac_layers=lay.ac_layers - 1) if lay.ac_layers > 1
                 else replace(lay, ac="none", ac_layers=0))
        assert job.memory(fewer).total > job.memory_bytes, lay


def test_torchtitan_checkpoints_every_nth_layer_for_a_partial_plan():
    from plait.planner.plan.torchtitan import torchtitan_settings

    lay = Layout(tp=8, pp=4, dp=2, micro_batches=64, schedule="1F1B", ac="full", ac_layers=5)
    s = torchtitan_settings(lay, 128, 20)
    assert s["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "4"}
    assert "5 of 20" in s["plait"][0] and "recompute_num_layers=5" in s["plait"][0]
    assert torchtitan_settings(lay, 128, 5)["activation_checkpoint"] == {"mode": "full"}


def test_a_pinned_ac_layers_is_run_as_given_and_wrong_ones_named():
    from plait.errors import SpecError

    job = _job("llama3-8b", batch=128)
    r = plan(job, keep=5, fixed=parse_layout("dp=8,zero=3,ac_layers=5"))
    assert r.ranked and all(p.layout.ac == "full" and p.layout.ac_layers == 5 for p in r.ranked)
    for bad in ("ac_layers=-1", "ac=selective,ac_layers=3"):
        with pytest.raises(SpecError, match="ac_layers"):
            parse_layout(bad)


def test_pytorch_async_tp_is_an_overlap_a_layout_can_name():
    """torchtitan's async TP (PyTorch's own executor on each TP pair): it hides some of the
    TP communication plain TP exposes, plait's schedule per pair hides more; torchtitan's
    settings switch it on."""
    from plait.planner.plan.torchtitan import torchtitan_settings

    cluster = load_hardware("h100-500w")
    job = Job(load_model("llama3-70b"), cluster, 256, 8192, 512, cluster.gpu.memory_bytes,
              "fp8", attention="fa2")
    lay = Layout(tp=8, dp=32, micro_batch=16, ac="full", zero=3)
    plain, async_tp, ficco = (job.predict(lay, ("plain", o)) for o in ("plain", "asynctp",
                                                                         "ficco"))
    assert async_tp.layout.overlap == "asynctp" and ficco.layout.overlap == "ficco"
    assert ficco.step_s < async_tp.step_s < plain.step_s
    assert async_tp.exposed_comm_s < plain.exposed_comm_s
    assert parse_layout("tp=8,overlap=asynctp") == {"tp": 8, "overlap": "asynctp"}
    s = torchtitan_settings(async_tp.layout, 512, 80)
    assert s["parallelism"]["enable_async_tensor_parallel"] and s["realizable"]


def test_the_flop_conventions_are_the_stacks_own_formulas():
    """Megatron-LM's `num_floating_point_operations` (12 B s L h^2 [(1 + g/a + s/h) q/h +
    3/2 ffn/h] + 6 B s h V, SwiGLU), torchtitan's `6 N + 12 L h q t` (N: every parameter but
    the embedding's: norms, the final norm's h included), and the causal count, which
    performs half the attention scores."""
    job = _job("llama3-70b", gpus=64, batch=128)
    m, s = job.model, job.seq_len
    h, a, g, L, f, V = m.hidden, m.heads, m.kv_heads, m.layers, m.ffn, m.vocab
    q = a * m.head_dim
    megatron = 12 * s * L * h * h * ((1 + g / a + s / h) * q / h + 1.5 * f / h) + 6 * s * h * V
    assert job.flops_per_token("megatron") * s == pytest.approx(megatron, rel=1e-12)
    params = params_of(m)
    titan = 6 * (params.total(L) - params.embedding + h) + 12 * L * a * m.head_dim * s
    assert job.flops_per_token("torchtitan") == pytest.approx(titan, rel=1e-12)
    assert job.flops_per_token("megatron") - job.flops_per_token("causal") == \
        pytest.approx(6 * L * s * q)
    assert job.flop_convention == "megatron"  # the default stack is Megatron-LM's
    titan_job = Job(m, job.cluster, 64, s, 128, job.memory_bytes, attention="fa2")
    assert titan_job.flop_convention == "torchtitan"


def test_the_file_plait_plan_writes_is_a_plan_the_layers_run(tmp_path):
    """`plait plan --json` wrote a file `load_plan` refused ("no 'plan' mapping") and the
    examples' --plan died on (its "model" a name): it now carries the chosen layout's
    schedules, group and pair shapes as `plait explore --json` does, and the model."""
    from plait.errors import SpecError
    from plait.nn import load_plan

    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "-m", "examples/tiny_llama.json", "-H", "cpu",
                              "--memory-gib", "16", "--gpus", "2", "--global-batch", "4",
                              "--seq-len", "256", "--layout", "tp=2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    plan = load_plan(out)
    assert {k: str(v) for k, v in plan.schedules.items()} == doc["chosen"]["plan"]
    assert doc["model"]["hidden"] == 64 and doc["parallel"]["tp"] == 2
    fc1 = next(p for p in doc["pairs"] if p["name"] == "fc1")
    shape = (fc1["gemm"]["n"], fc1["gemm"]["k"])
    assert str(plan.pick("fc1", False, 2, shape)) == doc["plan"]["fc1"]
    with pytest.raises(SpecError, match="group of 2 ranks"):
        plan.pick("fc1", False, 4, shape)
