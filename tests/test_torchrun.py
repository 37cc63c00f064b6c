"""plait under torchrun: independent processes, as users run them (gloo here; NCCL on GPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # every test here runs forked ranks

EXAMPLES = Path(__file__).parents[1] / "examples"


def _torchrun(*args: str, cwd: Path | None = None, timeout: float = 120, nproc: int = 2) -> str:
    """Run `args` on `nproc` torchrun ranks; return stdout, failing with its output if it
    fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, also on a machine with GPUs
    # --standalone: the rendezvous binds a port the OS picks, so parallel tests never collide.
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), *args], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=cwd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


def test_ops_under_torchrun():
    assert _torchrun(str(Path(__file__).with_name("torchrun_case.py"))).count(" ok ") == 2


def test_example_under_torchrun(tmp_path):
    out = _torchrun(str(EXAMPLES / "sp_mlp.py"), "--schedule", "fine/sm/c2/peer/M",
                    "--steps", "2", "--profile", str(tmp_path))
    assert "loss" in out and "mm_rs.bwd" in out and "collective(gloo)" in out
    # each rank's trace: plait analyze sees its gloo transfers and the two steps
    from plait.analyze.analysis import analyze

    for rank in (0, 1):
        (t,) = analyze([tmp_path / f"rank{rank}.json"], None).traces
        assert t.trace.rank == rank and t.exposure[0].steps == 2
        kinds = {r.kind for r in t.collectives}
        assert {"all_gather", "reduce_scatter"} <= kinds, kinds


def test_expert_parallel_example_under_torchrun():
    out = _torchrun(str(EXAMPLES / "ep_moe.py"), "--schedule", "fine/sm/c2/peer/M",
                    "--experts", "2")
    assert "loss" in out and "choices dropped 0" in out  # dropless by default
    assert out.count("collective(gloo)") == 4  # dispatch, combine and both backwards


def test_profile_under_torchrun(tmp_path):
    """`plait profile` joins torchrun's ranks; rank 0 writes the calibration."""
    out = tmp_path / "cal.yaml"
    _torchrun("-m", "plait", "profile", "--repeats", "1", "-o", str(out), cwd=tmp_path,
              timeout=180)
    doc = yaml.safe_load(out.read_text())
    assert doc["meta"]["mode"] == "2 cpu ranks"
    assert doc["meta"]["command"].startswith("torchrun --nproc-per-node 2 -m plait profile")
    assert doc["params"]["sm_link_fraction"] > 0 and doc["gpu"]["dma"]["bytes_per_s"] > 0


def test_bench_under_torchrun(tmp_path):
    out = tmp_path / "bench.json"
    _torchrun("-m", "plait", "bench", "--shape", "256x32x64", "--schedules", "fine/dma/c2/g1/M",
              "--warmup", "1", "--repeats", "1", "--json", str(out), "--trace",
              str(tmp_path / "t.json"))
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"seq/sm", "fine/dma/c2/g1/M"}
    assert rows["fine/dma/c2/g1/M"]["engine"].startswith("peer_copy")


def test_hugging_face_llama_trains_with_plait_under_tp_and_fsdp2(tmp_path):
    """examples/train_llama.py on 4 ranks, a 2x2 mesh (TP with plait x FSDP2), fp32: the first
    step's gradients of plait and of PyTorch's own TP styles against the unsharded model, the
    loss curves of both, and a checkpoint resumed mid-run (the example's own checks, whose
    figures are asserted here at fp32's tolerances)."""
    pytest.importorskip("transformers")
    out = _torchrun(str(EXAMPLES / "train_llama.py"), "--dtype", "fp32", "--steps", "6",
                    "--schedule", "fine/dma/c2/g1/M", "--time-schedules", "",
                    "--out", str(tmp_path), nproc=4, timeout=300)
    assert "checks: gradients (plait) ok, gradients (plain) ok, loss curves ok, resume ok" in out
    assert "plait step 0: loss" in out and "plain step 5: loss" in out  # each step logged
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["mesh"] == {"dp": 2, "tp": 2}
    assert res["grad_error_plait"]["max_relative"] < 1e-5
    assert res["grad_error_plait"]["parameters"] == 21  # every parameter of the model
    assert res["loss_max_difference"] < 1e-5 and res["resume"]["max_difference"] == 0.0
    assert res["loss"]["plait"]["last"] < res["loss"]["plait"]["first"]  # it learns
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_llama_trains_from_a_plan_for_its_shapes_and_refuses_one_for_others(tmp_path):
    """A plan from `plait explore -m examples/tiny_llama.json --tp 2` runs the example (bf16
    autocast); llama3-8b's plan is refused with one line and exit status 2."""
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from plait.cli.main import app

    plans = {}
    for model in (str(EXAMPLES / "tiny_llama.json"), "llama3-8b"):
        plans[model] = tmp_path / f"{Path(model).stem}.json"
        res = CliRunner().invoke(app, ["explore", "-m", model, "--tp", "2", "--seq-len", "64",
                                       "--json", str(plans[model])])
        assert res.exit_code == 0, res.output
    out = _torchrun(str(EXAMPLES / "train_llama.py"), "--steps", "4", "--time-schedules", "",
                    "--plan", str(plans[str(EXAMPLES / "tiny_llama.json")]),
                    "--out", str(tmp_path / "run"), nproc=4, timeout=300)
    assert "checks: gradients (plait) ok" in out and "resume ok" in out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, also on a machine with GPUs
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", str(EXAMPLES / "train_llama.py"),
                          "--plan", str(plans["llama3-8b"]), "--steps", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-2000:]
    assert "llama3-8b" in errors[0] and "N=" in errors[0] and "plait explore -m" in errors[0]


def test_tune_under_torchrun(tmp_path):
    """`plait tune` joins torchrun's ranks (separate processes: their own hash seeds and
    imports still agree on every candidate); rank 0 writes the plan, the cache is filled."""
    plan, cache = tmp_path / "plan.json", tmp_path / "cache.json"
    _torchrun("-m", "plait", "tune", "-m", str(EXAMPLES / "tiny_llama.json"), "--tp", "2",
              "--seq-len", "64", "--dtype", "fp32", "--calls", "1", "--cache", str(cache),
              "--json", str(plan), cwd=tmp_path, timeout=180)
    doc = json.loads(plan.read_text())
    assert len(doc["plan"]) == 10 and doc["measurement_calls"] > 0
    assert json.loads(cache.read_text())["entries"]
