"""Calibration files: measured values that override a cluster spec's defaults.

Format (YAML or JSON), version 1::

    plait_calibration: 1
    meta:                         # provenance, free-form but these keys are expected
      device: "NVIDIA H200"
      date: "2026-11-30"
      command: "plait profile --quick -o data/calibrations/h200.yaml"
      versions: {torch: "2.13.0", plait: "0.1.0"}
    params:                       # any field of plait.spec.hardware.CostParams
      comm_kernel_overhead_s: 9.0e-6
      gemm_measured: [[bf16, 4096, 4096, 4096, 1.9e-4], [bf16, 8192, 4096, 4096, 3.7e-4]]
    gpu:                          # any field of GpuSpec (partial; dma may be partial too)
      launch_overhead_s: 4.1e-6
      dma: {command_overhead_s: 2.5e-6}
    topology:                     # any field of Topology (partial)
      link_bytes_per_s: 3.9e11
    measurements: {...}           # raw data `plait profile` derived the values from (optional)

Every section but `plait_calibration` is optional. Applying a calibration deep-merges these
sections into the cluster spec and validates the result, so a calibrated spec obeys the same
rules as a preset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from plait.errors import SpecError
from plait.spec.hardware import ClusterSpec, FrozenSpec
from plait.spec.io import read_mapping, validate

CALIBRATION_VERSION = 1


class Calibration(FrozenSpec):
    """A parsed calibration file (see the module docstring for the format)."""

    plait_calibration: int = Field(description=f"Format version; this plait reads "
                                   f"{CALIBRATION_VERSION}")
    meta: dict[str, Any] = Field(default_factory=dict, description="Provenance")
    params: dict[str, Any] = Field(default_factory=dict, description="CostParams overrides")
    gpu: dict[str, Any] = Field(default_factory=dict, description="GpuSpec overrides")
    topology: dict[str, Any] = Field(default_factory=dict, description="Topology overrides")
    measurements: dict[str, Any] = Field(default_factory=dict, description="Raw measurements "
                                         "behind the values (for plots and checks)")

    def apply(self, cluster: ClusterSpec) -> ClusterSpec:
        """`cluster` with this calibration's values merged in (validated)."""
        merged = _deep_merge(cluster.model_dump(),
                             {"params": self.params, "gpu": self.gpu, "topology": self.topology})
        return validate(ClusterSpec, merged, "calibration")


def load_calibration(path: str | Path) -> Calibration:
    data = read_mapping(path, "calibration")
    cal = validate(Calibration, data, "calibration")
    if cal.plait_calibration != CALIBRATION_VERSION:
        raise SpecError("calibration.plait_calibration",
                        f"format version {cal.plait_calibration} is not supported",
                        f"regenerate the file with this plait (version {CALIBRATION_VERSION})")
    return cal


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def save_calibration(doc: dict[str, Any], path: Path, base: ClusterSpec) -> None:
    """Write a calibration document as YAML, then load it back and apply it to `base`: what is
    written must load and validate."""
    import yaml

    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=100, default_flow_style=None))
    load_calibration(path).apply(base)
