"""The GPU measurement script's calibration output is a valid calibration (checked on CPU with
made-up measurements, so the GPU session's one run cannot fail on the file format)."""

import sys
from pathlib import Path

import yaml

from plait.spec.calibration import load_calibration
from plait.spec.hardware import load_hardware

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import gpu_measure


def test_calibration_from_gpu_measurements_loads(tmp_path):
    result = {"device": "NVIDIA H200", "torch": "2.11.0", "date": "2026-11-30",
              "contention": {"gemm": {"alone_ms": 1.0},
                             "d2d_copy_engine": {"with_gemm_ms": 1.05, "gb_per_s_alone": 2000},
                             "sm_copy_kernel": {"with_gemm_ms": 1.3, "gb_per_s_alone": 3000},
                             "h2d_copy_engine": {"with_gemm_ms": 1.01, "gb_per_s_alone": 50}}}
    grid = [["bf16", m, n, k, 1e-12 * m * n * k] for m in gpu_measure.GRID
            for n in gpu_measure.GRID for k in gpu_measure.GRID]
    p = tmp_path / "h200.yaml"
    p.write_text(yaml.safe_dump(gpu_measure.calibration(result, grid), sort_keys=False))
    c = load_calibration(p).apply(load_hardware("h200"))
    assert c.gpu.dma.bytes_per_s == 2e12
    assert abs(c.params.gemm_slowdown_sm_comm - (1 - 1 / 1.3)) < 1e-3
    assert len(c.params.gemm_measured) == 27
