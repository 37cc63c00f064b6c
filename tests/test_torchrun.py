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


def _torchrun(*args: str, cwd: Path | None = None, timeout: float = 120) -> str:
    """Run `args` on two torchrun ranks; return stdout, failing with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    # --standalone: the rendezvous binds a port the OS picks, so parallel tests never collide.
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", *args], capture_output=True,
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
