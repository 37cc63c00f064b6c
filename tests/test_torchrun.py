"""The ops under torchrun: independent processes, as users run them."""

import json
import os
import subprocess
import sys
from pathlib import Path

from plait.runtime.launch import free_port


def test_ops_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    case = Path(__file__).with_name("torchrun_case.py")
    port = str(free_port())
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", port, str(case)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count(" ok ") == 2


def test_example_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    example = Path(__file__).parents[1] / "examples" / "sp_mlp.py"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(example), "--schedule",
                          "fine/sm/c2/peer/M"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "loss" in res.stdout and "mm_rs.bwd" in res.stdout and "collective(gloo)" in res.stdout


def test_profile_under_torchrun(tmp_path):
    """`plait profile` joins torchrun's ranks (gloo here, NCCL on GPUs); rank 0 writes."""
    import yaml

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = tmp_path / "cal.yaml"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "plait", "profile",
                          "--repeats", "1", "-o", str(out)], capture_output=True, text=True,
                         timeout=180, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = yaml.safe_load(out.read_text())
    assert doc["meta"]["mode"] == "2 cpu ranks"
    assert doc["meta"]["command"].startswith("torchrun --nproc-per-node 2 -m plait profile")
    assert doc["params"]["sm_link_fraction"] > 0 and doc["gpu"]["dma"]["bytes_per_s"] > 0


def test_bench_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "plait", "bench", "--shape",
                          "256x32x64", "--schedules", "fine/dma/c2/g1/M", "--warmup", "1",
                          "--repeats", "1", "--json", str(out), "--trace",
                          str(tmp_path / "t.json")], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"seq/sm", "fine/dma/c2/g1/M"}
    assert rows["fine/dma/c2/g1/M"]["engine"].startswith("peer_copy")


def test_expert_parallel_example_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    example = Path(__file__).parents[1] / "examples" / "ep_moe.py"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(example), "--schedule",
                          "fine/sm/c2/peer/M"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "loss" in res.stdout and "tokens dropped" in res.stdout
    assert res.stdout.count("collective(gloo)") == 4  # dispatch, combine and both backwards
