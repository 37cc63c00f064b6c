"""The ops under torchrun: independent processes, as users run them."""

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
