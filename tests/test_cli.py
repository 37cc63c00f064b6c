"""The command line: default run, outputs, and clean errors."""

import json

import pytest
import torch
from typer.testing import CliRunner

from plait.cli.main import app

runner = CliRunner()


def test_default_explore_writes_json_trace_and_plot(tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["explore", "--json", str(out), "--trace", str(tmp_path / "t.json"),
                              "--plot", str(tmp_path / "p.png"), "--pair", "qkv"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "llama3-70b" in text and "step speedup" in text and "vs megatron" in text
    data = json.loads(out.read_text())
    assert data["hardware"] == "h100-8" and len(data["pairs"]) == 10
    # training: speedups are against Megatron-LM's own backward overlaps, and say so
    assert data["baseline"] == data["step_speedup"]["vs"] == "megatron"
    phases = data["totals"]["megatron"]["phases"]
    assert set(phases) == {"forward", "backward"}
    assert phases["backward"]["exposed_comm_s"] <= phases["backward"]["comm_s"]
    assert (data["totals"]["megatron"]["layer_backward_s"]
            < data["totals"]["sequential"]["layer_backward_s"])
    assert set(data["plan"]) == {p["name"] for p in data["pairs"]}
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stack_that_keeps_gathered_inputs_has_no_regathers_and_a_sequential_baseline(
        tmp_path):
    """--keep-gathered: the layer as PyTorch's DTensor TP (torchtitan) and plait's runtime run
    it. No weight-gradient re-gathers to overlap, and speedups against vanilla TP (sequential),
    in explore and coexec plan alike."""
    base = ["-m", "llama3-8b", "-H", "h100", "--seq-len", "4096"]
    out = {}
    for flag in ("--regather", "--keep-gathered"):
        path = tmp_path / f"{flag}.json"
        res = runner.invoke(app, ["explore", *base, flag, "--json", str(path)])
        assert res.exit_code == 0, res.output
        out[flag] = json.loads(path.read_text())
    kept, megatron = out["--keep-gathered"], out["--regather"]
    assert {p["name"] for p in megatron["pairs"]} - {p["name"] for p in kept["pairs"]} == {
        "qkv_wgrad", "fc1_wgrad"}
    assert kept["parallel"]["regather"] is False and megatron["parallel"]["regather"] is True
    assert kept["baseline"] == kept["step_speedup"]["vs"] == "sequential"
    assert megatron["baseline"] == "megatron"
    assert (kept["totals"]["sequential"]["layer_backward_s"]
            < megatron["totals"]["sequential"]["layer_backward_s"])  # two all-gathers fewer
    res = runner.invoke(app, ["explore", *base, "--keep-gathered", "--fast", "--why"])
    text = " ".join(res.output.split())
    assert "gathered inputs kept" in text
    assert "candidates simulated)" in text and "qkv_wgrad" not in text  # --why, per pair
    path = tmp_path / "coexec.json"
    res = runner.invoke(app, ["coexec", "plan", *base, "--keep-gathered", "--json", str(path)])
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    steps = {v["name"]: v["step_s"] for v in data["variants"]}
    assert data["baseline"] == "sequential" and all(
        v["speedup_vs_baseline"] == pytest.approx(steps["sequential"] / v["step_s"])
        for v in data["variants"])
    assert "speedup vs sequential" in " ".join(res.output.split())
    path = tmp_path / "run.json"  # and the co-execution runtime runs that layer
    res = runner.invoke(app, ["coexec", "run", "--keep-gathered", "--layers", "2", "--hidden",
                              "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                              "--seq-len", "32", "--repeats", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    run = json.loads(path.read_text())
    assert set(run["runs"]["ficco"]["fused"]).isdisjoint({"qkv_wgrad", "fc1_wgrad"})
    losses = {r["loss"] for r in run["measured"].values()}
    assert max(losses) - min(losses) <= 1e-5 * max(map(abs, losses))
    assert "gathered inputs kept" in " ".join(res.output.split())


def test_bad_input_exits_2_with_named_field():
    res = runner.invoke(app, ["explore", "--tp", "3"])
    assert res.exit_code == 2
    assert "parallel.tp" in res.output and "Fix:" in res.output
    res = runner.invoke(app, ["explore", "--hardware", "tpu"])
    assert res.exit_code == 2 and "unknown hardware preset" in res.output
    res = runner.invoke(app, ["explore", "--pair", "nope"])
    assert res.exit_code == 2 and "qkv" in res.output
    res = runner.invoke(app, ["explore", "--tp", "8", "--dp", "2"])
    assert res.exit_code == 2 and "--nodes" in res.output


def test_json_to_stdout_and_presets():
    res = runner.invoke(app, ["explore", "-m", "llama3-8b", "-H", "h100", "--seq-len", "2048",
                              "--json", "-"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["model"]["name"] == "llama3-8b"
    res = runner.invoke(app, ["presets"])
    assert res.exit_code == 0 and "mixtral-8x7b" in res.output and "MI300X" in res.output


@pytest.mark.slow
def test_bench_runs_schedules_on_local_ranks(tmp_path):
    out, trace = tmp_path / "b.json", tmp_path / "t.json"
    res = runner.invoke(app, ["bench", "--shape", "64x8x16", "--warmup", "0",
                              "--repeats", "1", "--schedules", "fine/dma/c2/g1/M,p2p/sm/M",
                              "--json", str(out), "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = {r["schedule"]: r for r in data["rows"]}
    assert set(rows) == {"seq/sm", "fine/dma/c2/g1/M", "p2p/sm/M"}  # seq/sm always measured
    assert rows["fine/dma/c2/g1/M"]["engine"].startswith("peer_copy")
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows.values())
    assert json.loads(trace.read_text())["traceEvents"]
    res = runner.invoke(app, ["bench", "--shape", "63x8x8", "--ranks", "2"])
    assert res.exit_code == 2 and "multiple of 2" in res.output
    res = runner.invoke(app, ["bench", "--shape", "63x8"])
    assert res.exit_code == 2 and "MxNxK" in res.output


@pytest.mark.slow
def test_profile_writes_a_calibration_that_loads_and_resumes(tmp_path, monkeypatch):
    import yaml

    from plait.measure import profile as prof
    from plait.spec.calibration import load_calibration
    from plait.spec.hardware import load_hardware

    tiny = prof.ProfilePlan(quick=True, ranks=2, repeats=1)
    monkeypatch.setattr(prof.ProfilePlan, "grid", property(lambda self: ((64, 128), (32,), (64,))))
    monkeypatch.setattr(prof.ProfilePlan, "split_shapes", property(lambda self: ((64, 32, 64),)))
    monkeypatch.setattr(prof.ProfilePlan, "transfer_kb", property(lambda self: (16, 64)))
    monkeypatch.setattr(prof.ProfilePlan, "contention_kb", property(lambda self: (16,)))
    monkeypatch.setattr(prof, "SPLITS", (2, 4))
    out = tmp_path / "cal.yaml"
    partial = tmp_path / "cal.yaml.partial.json"
    done = {k: 1e-3 for k in tiny.items() if k.startswith("gemm/")}
    partial.write_text(json.dumps(done))  # an interrupted run: GEMMs already measured
    res = runner.invoke(app, ["profile", "-o", str(out), "--repeats", "1", "--plot",
                              str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    assert "resuming: 2 items" in res.output and not partial.exists()
    doc = yaml.safe_load(out.read_text())
    assert doc["meta"]["command"].startswith("plait") and doc["meta"]["versions"]["torch"]
    assert [row[4] for row in doc["params"]["gemm_measured"]] == [1e-3, 1e-3]  # kept, not redone
    cal = load_calibration(out).apply(load_hardware("cpu"))
    assert cal.params.gemm_measured and cal.gpu.dma.command_overhead_s >= 0
    assert (tmp_path / "plots" / "decomposition_loss.png").exists()
    assert (tmp_path / "plots" / "contention.png").exists()


def _tiny_profile(monkeypatch):
    from plait.measure import profile as prof

    monkeypatch.setattr(prof.ProfilePlan, "grid", property(lambda self: ((64, 128), (32,), (64,))))
    monkeypatch.setattr(prof.ProfilePlan, "split_shapes", property(lambda self: ((64, 32, 64),)))
    monkeypatch.setattr(prof.ProfilePlan, "contention_kb", property(lambda self: (4096,)))
    monkeypatch.setattr(prof, "SPLITS", (2, 4))


@pytest.mark.slow
def test_local_profile_on_the_cpu(tmp_path, monkeypatch):
    """One device in-process: GEMMs, splits and contention with a copier thread; no links."""
    import yaml

    from plait.spec.calibration import load_calibration
    from plait.spec.hardware import load_hardware

    _tiny_profile(monkeypatch)
    out = tmp_path / "local.yaml"
    res = runner.invoke(app, ["profile", "--local", "--device", "cpu", "-o", str(out),
                              "--repeats", "1", "--plot", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(out.read_text())
    assert doc["meta"]["mode"] == "one device (local)" and doc["meta"]["ranks"] == 1
    items = doc["measurements"]["items"]
    assert sorted(k.split("/")[0] for k in items) == ["contention"] + ["gemm"] * 2 + \
        ["split"] * 4
    assert "sm_link_fraction" not in doc["params"] and not doc["gpu"]  # no link measured
    assert 0.0 <= doc["params"]["gemm_slowdown_dma"] <= 0.95
    cal = load_calibration(out).apply(load_hardware("cpu"))
    assert len(cal.params.gemm_measured) == 2
    assert (tmp_path / "plots" / "contention.png").exists()


def test_profile_device_errors():
    res = runner.invoke(app, ["profile", "--device", "cuda"])
    assert res.exit_code == 2 and "--local" in res.output
    res = runner.invoke(app, ["profile", "--local", "--device", "tpu"])
    assert res.exit_code == 2 and "cpu, cuda or cuda:N" in res.output


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (single-GPU profile)")
def test_local_profile_on_a_gpu(tmp_path, monkeypatch):
    import yaml

    _tiny_profile(monkeypatch)
    out = tmp_path / "gpu.yaml"
    res = runner.invoke(app, ["profile", "--local", "--device", "cuda", "--dtypes", "bf16",
                              "-H", "h200", "-o", str(out), "--repeats", "2"])
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(out.read_text())
    assert {k.split("/")[1] for k in doc["measurements"]["items"]
            if k.startswith("contention/")} == {"dma", "d2d", "sm"}
    assert "gemm_slowdown_sm_comm" in doc["params"] and "gemm_slowdown_dma" in doc["params"]
    assert 0 < doc["params"]["host_call_s"] < 1e-3  # one eager launch: microseconds


def test_a_gpu_profile_measures_host_issue_and_calibrates_it(tmp_path, monkeypatch):
    """The host item is a GPU's only (a CPU runs its ops in the issuing thread), and the
    calibration carries what it measured as `host_call_s`."""
    from plait.measure import profile as prof
    from plait.spec.calibration import load_calibration
    from plait.spec.hardware import load_hardware

    assert prof.HOST_ITEM not in prof.ProfilePlan(local=True, device="cpu").items()
    gpu = prof.ProfilePlan(local=True, device="cuda")
    assert prof.HOST_ITEM in gpu.items()
    monkeypatch.setattr(prof, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    doc = prof.calibration_from({prof.HOST_ITEM: 7e-6}, gpu, load_hardware("h100"), "plait")
    assert doc["params"]["host_call_s"] == 7e-6
    (tmp_path / "cal.json").write_text(json.dumps(doc))
    cal = load_calibration(tmp_path / "cal.json").apply(load_hardware("h100"))
    assert cal.params.host_call_s == 7e-6


@pytest.mark.slow
def test_coexec_plan_and_run(tmp_path):
    res = runner.invoke(app, ["coexec", "plan", "-m", "llama3-8b", "-H", "mi300x",
                              "--seq-len", "4096", "--json", str(tmp_path / "p.json"),
                              "--trace", str(tmp_path / "t.json"), "--plot",
                              str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "p.json").read_text())
    names = [v["name"] for v in data["variants"]]
    assert names == ["sequential", "megatron", "intra-batch overlap (FiCCO)", "co-execution",
                     "co-execution + FiCCO"]
    steps = {v["name"]: v["step_s"] for v in data["variants"]}
    assert steps["co-execution"] < steps["megatron"] < steps["sequential"]
    assert data["baseline"] == "megatron" and all(
        v["speedup_vs_baseline"] == pytest.approx(steps["megatron"] / v["step_s"])
        for v in data["variants"])
    assert (tmp_path / "p.png").exists() and json.loads((tmp_path / "t.json").read_text())
    res = runner.invoke(app, ["coexec", "run", "--layers", "2", "--hidden", "32", "--heads",
                              "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "40",
                              "--seq-len", "16", "--micro-batches", "2", "--repeats", "1",
                              "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    run = json.loads((tmp_path / "r.json").read_text())["measured"]
    for name in ("ficco", "coexec", "coexec+ficco"):  # FiCCO units, co-executed or not
        assert run["plain"]["loss"] == pytest.approx(run[name]["loss"], rel=1e-5), name
    # MoE layers, expert-parallel over the ranks: the same four runs, FiCCO on all-to-alls
    res = runner.invoke(app, ["coexec", "run", "--layers", "2", "--hidden", "32", "--heads",
                              "4", "--kv-heads", "2", "--ffn", "32", "--vocab", "40",
                              "--seq-len", "32", "--micro-batches", "2", "--repeats", "1",
                              "--experts", "4", "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert "MoE: 4 experts top-2" in res.output
    run = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert set(run) == {"plain", "ficco", "coexec", "coexec+ficco"}
    for name in ("ficco", "coexec", "coexec+ficco"):
        assert run["plain"]["loss"] == pytest.approx(run[name]["loss"], rel=1e-5), name
    res = runner.invoke(app, ["coexec", "run", "--micro-batches", "1"])
    assert res.exit_code == 2 and "two micro-batches" in res.output


@pytest.mark.slow
def test_coexec_profile_measures_block_costs_and_plans_from_them(tmp_path):
    out = tmp_path / "c.json"
    res = runner.invoke(app, ["coexec", "profile", "--hidden", "32", "--heads", "4",
                              "--kv-heads", "2", "--ffn", "64", "--seq-len", "16",
                              "--repeats", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    table = json.loads(out.read_text())
    assert "F|qkv,attn" in table["solo"] and "qkv|fc2_dgrad" in table["pair"]
    assert "ag_attn|ag_mlp_dy" not in table["pair"]  # both on the TP group: never measured
    res = runner.invoke(app, ["coexec", "run", "--layers", "2", "--hidden", "32", "--heads",
                              "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "40",
                              "--seq-len", "16", "--micro-batches", "2", "--repeats", "1",
                              "--costs", str(out), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r.json").read_text())["costs"] == "measured"
    kept = tmp_path / "kept.json"  # the layer that keeps its gathered inputs, measured
    shape = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq-len",
             "16", "--repeats", "1"]
    res = runner.invoke(app, ["coexec", "profile", *shape, "--keep-gathered", "-o", str(kept)])
    assert res.exit_code == 0, res.output
    table = json.loads(kept.read_text())
    assert table["meta"]["regather"] is False
    assert not any("ag_attn_x" in key for key in (*table["solo"], *table["pair"]))
    run = ["coexec", "run", "--layers", "2", "--vocab", "40", "--micro-batches", "2", *shape,
           "--costs", str(kept)]
    res = runner.invoke(app, [*run, "--keep-gathered"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, run)  # a table of the other layer: one line naming the fix
    assert res.exit_code == 2 and "--keep-gathered" in res.output
    assert "Traceback" not in res.output


@pytest.mark.slow
@pytest.mark.parametrize(("op", "experts"), [("a2a", 1), ("mm_a2a", 1), ("a2a", 2)])
def test_bench_measures_expert_parallel_pairs(tmp_path, op, experts):
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "--op", op, "--shape", "64x8x16", "--warmup", "0",
                              "--repeats", "1", "--schedules", "fine/dma/c2/g1/M",
                              "--experts", str(experts),
                              "--json", str(out), "--trace", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    rows = {r["schedule"]: r for r in doc["rows"]}
    assert set(rows) == {"seq/sm", "fine/dma/c2/g1/M"} and doc["spec"]["experts"] == experts
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows.values())


def test_bench_experts_need_an_expert_pair_and_whole_rows():
    res = runner.invoke(app, ["bench", "--op", "ag", "--experts", "2"])
    assert res.exit_code == 2 and "experts" in res.output
    res = runner.invoke(app, ["bench", "--op", "a2a", "--shape", "60x8x16", "--experts", "4"])
    assert res.exit_code == 2 and "multiple of 8" in res.output


@pytest.mark.slow
def test_bench_validate_reports_prediction_and_pick_accuracy(tmp_path, monkeypatch):
    from plait.measure import validate

    monkeypatch.setattr(validate, "HELD_OUT", (("ag", 64, 8, 16), ("rs", 64, 16, 8),
                                               ("a2a", 64, 8, 16), ("mm_a2a", 64, 16, 8)))
    monkeypatch.setattr(validate, "SCHEDULES", ("seq/sm", "seq/dma", "fine/dma/c2/g1/M"))
    out, plot = tmp_path / "v.json", tmp_path / "v.png"
    res = runner.invoke(app, ["bench", "--validate", "--repeats", "1", "--warmup", "0",
                              "--json", str(out), "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["summary"]["runs"] == 12 and len(doc["shapes"]) == 4
    assert all(0 <= doc["summary"][k] <= 1 for k in ("pick_exact", "pick_within_5pct",
                                                     "heuristic_within_5pct"))
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in doc["rows"])
    assert plot.exists()


@pytest.mark.slow
def test_bench_emulate_link(tmp_path):
    out = tmp_path / "e.json"
    res = runner.invoke(app, ["bench", "--emulate-link", "--shape", "256x16x64", "--ranks", "4",
                              "--warmup", "0", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert set(r["measured_s"]) == set(r["predicted_s"]) and r["link_bytes_per_s"] > 0


def test_explore_json_is_a_plan_file_for_the_parallel_linears(tmp_path):
    from plait.errors import SpecError
    from plait.nn import load_plan

    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["explore", "-m", "llama3-8b", "-H", "h100", "--seq-len", "2048",
                              "--json", str(out)])
    assert res.exit_code == 0
    plan = load_plan(out)
    assert {"qkv", "fc1", "out_proj", "fc2", "qkv_dgrad"} <= set(plan.schedules)
    assert plan.shapes["fc1"] == (8, 2 * 14336 // 8, 4096)  # ranks, N and K per rank
    (tmp_path / "bad.json").write_text("{\"pairs\": []}")
    with pytest.raises(SpecError, match="plait explore --json"):
        load_plan(tmp_path / "bad.json")
    with pytest.raises(SpecError, match="cannot read"):
        load_plan(tmp_path / "missing.json")


def test_version_and_json_to_stdout_is_clean():
    """`--json -` leaves standard output to the JSON document alone (tables go to stderr)."""
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip().startswith("plait ")
    for argv in (["explore", "--fast", "--json", "-"], ["coexec", "plan", "--json", "-"]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 0, res.output
        assert isinstance(json.loads(res.stdout), dict), argv


@pytest.mark.parametrize(("argv", "field"), [
    (["--ranks", "0"], "ranks"), (["--ranks", "-1"], "ranks"), (["--repeats", "0"], "repeats"),
    (["--warmup", "-1"], "warmup"), (["--dtype", "bf32"], "dtype"), (["--dtype", "int8"], "dtype"),
    (["--timeout", "nan"], "timeout"), (["--shape", "513x64x256"], "shape"),
    (["--shape", "64x8x16", "--schedules", "fine/dma/c64/g1/M"], "schedules"),
])
def test_bench_bad_options_are_one_line_naming_the_field(argv, field):
    """These gave tracebacks (from every rank, for an infeasible schedule)."""
    res = runner.invoke(app, ["bench", *argv])
    assert res.exit_code == 2, res.output
    assert f"error: {field}" in res.output and "Traceback" not in res.output


def test_more_bad_input_is_one_line():
    res = runner.invoke(app, ["explore", "--pair", "qkv", "--json", "/proc/none/x.json"])
    assert res.exit_code == 2 and "--json" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["coexec", "plan", "--micro-batches", "1"])
    assert res.exit_code == 2 and "micro_batches" in res.output
    from plait.errors import SpecError
    from plait.schedule.schedule import Schedule

    with pytest.raises(SpecError):  # g0 used to run as one piece per peer
        Schedule.parse("fine/sm/c4/g0/M")


def test_unreadable_and_unwritable_files_are_one_line(tmp_path, monkeypatch):
    """These were tracebacks: an unwritable --plot, a missing or list-shaped --costs, a corrupt
    .partial.json, a non-UTF-8 model file."""
    res = runner.invoke(app, ["explore", "--plot", "/proc/none/x.png"])
    assert res.exit_code == 2 and "--plot" in res.output
    listed = tmp_path / "costs.json"
    listed.write_text("[1]")
    for costs in (tmp_path / "missing.json", listed):
        res = runner.invoke(app, ["coexec", "run", "--costs", str(costs)])
        assert res.exit_code == 2 and "costs" in res.output, res.output
    out = tmp_path / "cal.yaml"
    (tmp_path / "cal.yaml.partial.json").write_text("[1, 2]")
    res = runner.invoke(app, ["profile", "-o", str(out)])
    assert res.exit_code == 2 and "resume" in res.output, res.output
    model = tmp_path / "m.json"
    model.write_bytes(b"\xff\xfe")
    res = runner.invoke(app, ["explore", "-m", str(model)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_bench_names_what_its_measurements_cannot_say():
    from plait.measure.bench import BenchResult, BenchRow, BenchSpec, contradictions

    res = BenchResult(BenchSpec("ag", 64, 8, 16, 2), "cpu", gemm_s=1.0, comm_s=1.0,
                      comm_by_engine_s={}, predicted_gemm_s=1.0, predicted_comm_s=1.0)
    res.rows = [BenchRow("fine/dma/c2/g1/M", "dma", 0.5, 1.0, 2.0, 1.0, 0.01),
                BenchRow("fine/dma/c4/g1/M", "dma", 1.02, 1.0, 1.0, 0.0, 0.2)]
    notes = contradictions(res)
    assert any("below the ideal bound" in n for n in notes)
    res.rows[0] = BenchRow("fine/dma/c2/g1/M", "dma", 1.0, 1.0, 1.0, 0.0, 0.3)
    assert any("within the noise" in n for n in contradictions(res))


def test_coexec_plan_takes_the_layouts_explore_takes():
    for extra in (["--cp", "2", "--tp", "4"], ["--no-sp"], ["--dp", "2", "--nodes", "2"]):
        res = runner.invoke(app, ["coexec", "plan", "-m", "llama3-8b", "--seq-len", "4096",
                                  "--json", "-", *extra])
        assert res.exit_code == 0, (extra, res.output)
        doc = json.loads(res.stdout)
        assert doc["parallel"]["cp"] == (2 if "--cp" in extra else 1)
        assert doc["parallel"]["sp"] == ("--no-sp" not in extra)
    res = runner.invoke(app, ["coexec", "plan", "--dp", "2"])
    assert res.exit_code == 2 and "--nodes" in res.output


def test_presets_show_prints_every_number_with_its_source():
    res = runner.invoke(app, ["presets", "--show", "h100"], env={"COLUMNS": "300"})
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "H100 SXM5 data sheet" in text and "estimate:" in text
    assert "no source recorded" not in text
    res = runner.invoke(app, ["presets", "--show", "tpu"])
    assert res.exit_code == 2 and "--show" in res.output


def test_the_cli_reference_lists_every_command_and_option() -> None:
    import typer

    from plait.cli.main import app
    from plait.cli.reference import markdown_reference

    text = markdown_reference(app)
    root = typer.main.get_command(app)
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        subs = getattr(command, "commands", {name: command})
        for sub_name, sub in subs.items():
            path = f"plait {name}" if sub is command else f"plait {name} {sub_name}"
            assert f"## `{path}`" in text, path
            for p in sub.params:
                if p.param_type_name == "option" and not p.hidden:
                    assert f"`{', '.join(p.opts)}" in text or p.opts[0] in text, (path, p.opts)


def _one_line_error(argv: list[str], field: str) -> None:
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"error: {field}" in text and "Fix:" in text and "Traceback" not in text, text


def test_a_capacity_factor_beyond_every_token_is_refused_by_name():
    """1e308 overflowed to a traceback; any factor that gives an expert more rows than there
    are tokens is impossible."""
    moe = ["explore", "-m", "mixtral-8x7b", "--tp", "1", "--ep", "8", "--dp", "8"]
    _one_line_error([*moe, "--capacity-factor", "1e308"], "parallel.capacity_factor")
    _one_line_error([*moe, "--capacity-factor", "4.5"], "parallel.capacity_factor")
    assert runner.invoke(app, [*moe, "--capacity-factor", "4", "--json", "-"]).exit_code == 0


def test_profile_without_ranks_or_repeats_is_one_line():
    _one_line_error(["profile", "--ranks", "0"], "ranks")
    _one_line_error(["profile", "--repeats", "0"], "repeats")
    _one_line_error(["profile", "--timeout", "-1"], "timeout")


def test_a_bench_shape_larger_than_memory_is_refused_before_any_rank_starts():
    _one_line_error(["bench", "--shape", "1000000000x1000000x1000"], "shape")
    from plait.errors import SpecError
    from plait.measure.bench import check_memory

    check_memory("ag", 4096, 256, 2048, 2, 1, "fp32", available=2**30)  # 72 MiB: fits
    with pytest.raises(SpecError, match="GiB"):
        check_memory("ag", 4096, 256, 2048, 2, 1, "fp32", available=2**20)


@pytest.mark.parametrize(("field", "value"), [
    ("topology.link_bytes_per_s", 1e-300), ("gpu.hbm_bytes_per_s", 1.0),
    ("topology.latency_s", 1e300), ("gpu.dma.bytes_per_s", 10.0),
    # counts the simulator holds a queue or a route for: 10**9 copy engines grew to 23.7 GB
    ("gpu.dma.engines", 10**9), ("gpu.compute_units", 10**9), ("gpus_per_node", 10**7),
])
def test_hardware_beyond_physics_is_refused_instead_of_printing_nan(tmp_path, field, value):
    """A link of 1e-300 B/s printed `speedup nanx`: bandwidths below 1 MB/s and fixed costs
    above a second are typos, named as such."""
    import yaml

    from plait.spec.hardware import load_hardware

    doc = load_hardware("h100").model_dump()
    *path, last = field.split(".")
    node = doc
    for key in path:
        node = node[key]
    node[last] = value
    spec = tmp_path / "cluster.yaml"
    spec.write_text(yaml.safe_dump(doc))
    _one_line_error(["explore", "-m", "llama3-8b", "-H", str(spec)], f"hardware.{field}")


def test_exploring_reports_progress_once_per_pair():
    """A large group can take long: the explorer says after each pair that it is done, and
    the CLI draws that as a progress bar."""
    from plait.planner.explore import explore
    from plait.spec.hardware import load_hardware
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import load_model

    done: list[str] = []
    e = explore(load_model("llama3-8b"), ParallelSpec(tp=8, seq_len=4096),
                load_hardware("h100"), progress=done.append)
    assert done == [r.pair.name for r in e.pairs]


def test_the_validation_table_never_cuts_the_schedules_it_is_for():
    """At 80 columns `bench --validate` cut the measured best to `fine/dma/c…`: less important
    columns are left out (and named) instead."""
    from rich.console import Console

    from plait.report.bench import validation_table

    best = "fine/dma/c2/peer/M"
    shapes = [{"shape": "ag 1536x96x768", "measured_best": best, "measured_best_s": 0.0123,
               "predicted_best": "fine/sm/c4/g2/M", "predicted_best_measured_s": 0.0131,
               "exact": False, "within_5pct": False, "median_abs_error": 0.31}]
    summary = {"runs": 14, "median_abs_error": 0.12, "p90_abs_error": 0.3, "pick_exact": 0.7,
               "pick_within_5pct": 0.9, "heuristic_within_5pct": 0.9, "repeat_within_5pct": 0.7}
    console = Console(width=80, record=True)
    console.print(validation_table({"shapes": shapes, "summary": summary},
                                    "predicted (cpu-2) vs measured, 2 ranks", 80))
    text = console.export_text()
    assert best in text and "fine/sm/c4/g2/M" in text and "…" not in text
    assert "left out to fit 80 columns" in " ".join(text.split())


def test_doctor_checks_the_environment_and_says_what_it_could_not_check():
    from plait.measure.doctor import environment_checks

    bad = environment_checks({"CUDA_LAUNCH_BLOCKING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                              "NCCL_P2P_DISABLE": "0"})
    assert {c.name: c.status for c in bad} == {"CUDA_LAUNCH_BLOCKING": "fail",
                                               "CUDA_DEVICE_MAX_CONNECTIONS": "warn"}
    (fine,) = environment_checks({"CUDA_DEVICE_MAX_CONNECTIONS": "32"})
    assert fine.status == "ok" and "CUDA_DEVICE_MAX_CONNECTIONS" in fine.means
    _, policy = environment_checks({"NCCL_CTA_POLICY": "2"})
    assert policy.name == "NCCL_CTA_POLICY" and "--expect-copy-engines" in policy.means
    res = runner.invoke(app, ["doctor", "--json", "-"],
                        env={"TORCH_NCCL_ENABLE_TIMING": "1"})
    assert res.exit_code == 0, res.output
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["TORCH_NCCL_ENABLE_TIMING"]["status"] == "warn"
    assert checks["gloo"]["status"] == "ok"
    if not torch.cuda.is_available():  # a CPU machine says what it could not check
        assert all(checks[n]["status"] == "not checked"
                   for n in ("GPUs", "driver", "peer access", "multicast (NVLS)"))
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0 and "plait doctor" in res.output


def test_doctor_says_where_auto_keeps_its_decisions(tmp_path, monkeypatch):
    from plait.measure.doctor import tuning_cache_check

    assert tuning_cache_check().found == "off"  # the suite's cache is off
    path = tmp_path / "cache.json"
    monkeypatch.setenv("PLAIT_TUNING_CACHE", str(path))
    check = tuning_cache_check()
    assert check.status == "ok" and "0 decisions" in check.found
    path.write_text("{torn")
    check = tuning_cache_check()
    assert check.status == "warn" and "unreadable" in check.means


@pytest.mark.slow
def test_tune_fills_the_cache_writes_a_plan_and_starts_tuned_the_second_time(tmp_path):
    from plait.nn import load_plan
    from plait.schedule.schedule import as_choice

    cache, plan = tmp_path / "cache.json", tmp_path / "plan.json"
    args = ["tune", "-m", "examples/tiny_llama.json", "--tp", "2", "--seq-len", "64",
            "--dtype", "fp32", "--calls", "1", "--cache", str(cache)]
    res = runner.invoke(app, [*args, "--json", str(plan)])
    assert res.exit_code == 0, res.output
    doc = json.loads(plan.read_text())
    names = {p["name"] for p in doc["pairs"]}
    assert {"qkv", "fc2", "fc1_dgrad", "qkv_wgrad"} <= names
    for p in doc["pairs"]:
        assert p["candidates"][0]["schedule"] == "seq/sm"
        assert all(c["measured_s"] > 0 and c["predicted_s"] > 0 for c in p["candidates"])
        assert p["choice"] in {c["schedule"] for c in p["candidates"]}
    assert doc["measurement_calls"] > 0 and doc["prediction"]["candidates"] > 0
    loaded = load_plan(plan)  # what plan= takes
    assert loaded.schedules == {p["name"]: as_choice(p["choice"]) for p in doc["pairs"]}
    assert loaded.shapes["fc1"][0] == 2
    again = runner.invoke(app, [*args, "--json", "-"])
    assert again.exit_code == 0, again.output
    second = json.loads(again.stdout)
    assert second["measurement_calls"] == 0 and second["plan"] == doc["plan"]
    assert {p["source"] for p in second["pairs"]} == {"cache"}
    res = runner.invoke(app, ["tune", "-m", "examples/tiny_llama.json", "--tp", "2",
                              "--ranks", "3"])
    assert res.exit_code == 2 and "start 2 ranks" in res.output
    res = runner.invoke(app, ["tune", "-m", "examples/tiny_llama.json", "--tp", "2",
                              "--candidates", "-1"])
    assert res.exit_code == 2 and "candidates" in res.output


@pytest.mark.parametrize("argv", [[], ["plan"], ["explore"], ["tune"], ["doctor"], ["analyze"],
                                  ["coexec"], ["coexec", "run"], ["profile"], ["bench"]])
def test_every_help_fits_80_columns_and_flows_its_sentences(argv):
    """`plait --help` broke descriptions where the docstring's lines broke ("micro-batches,"
    then "activation checkpointing" on a line of its own); every help fits 80 columns."""
    res = runner.invoke(app, [*argv, "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    if not argv:
        flat = " ".join(line.strip("│ ") for line in res.output.splitlines())
        assert "micro-batches, activation checkpointing) and its overlap" in " ".join(
            flat.split())
        assert not any(line.rstrip("│ ").endswith("micro-batches,")
                       for line in res.output.splitlines())


def test_doctor_names_every_variable_whole_at_80_columns():
    """The environment row split names mid-word (`CUDA_DEVICE_MAX_CONN`/`ECTIONS`)."""
    res = runner.invoke(app, ["doctor"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    for name in ("CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE"):
        assert name in res.output, name
    assert max(len(line) for line in res.output.splitlines()) <= 80


def test_long_work_says_what_it_does_where_no_bar_is_drawn():
    """`plait tune` printed nothing for two minutes in a job's log (its bar draws only on a
    terminal): there, progress is lines, at the start, every tenth of the work and the end."""
    import io

    from rich.console import Console

    from plait.cli.common import progress_bar

    out = io.StringIO()
    with progress_bar(Console(file=out, width=80), "tuning 10 pairs", 20) as done:
        for i in range(20):
            done(f"pair {i}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "tuning 10 pairs: started, 20 steps"
    assert lines[-1].startswith("tuning 10 pairs: done, 20 steps in")
    assert 10 <= len(lines) <= 12 and "2/20" in lines[1] and "(pair 1)" in lines[1]
