"""A calibration re-derived from the items it measured, by today's `calibration_from` (when the
derivation changed, the measurement stands): the same meta, `derived` saying so.

    python bench/recalibrate.py IN.yaml OUT.yaml

    python bench/recalibrate.py bench/results/gpu_h200/h200.yaml data/calibrations/h200.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from plait.measure import profile
from plait.spec.hardware import load_hardware


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    doc = yaml.safe_load(args.source.read_text())
    meta, items = doc["meta"], doc["measurements"]["items"]
    local = str(meta.get("mode", "")).startswith("one device")
    # The device only names the machine in the meta, which is the source's: "cpu" asks
    # nothing of a GPU this machine may not have.
    plan = profile.ProfilePlan(quick=meta["quick"], ranks=meta["ranks"], local=local,
                               device="cpu")
    base = load_hardware(meta["hardware_base"].split("-")[0])
    derived = profile.calibration_from(items, plan, base, meta["command"])
    derived["meta"] = {**meta, "derived": f"re-derived from {args.source.name}'s measured "
                       "items by python bench/recalibrate.py"}
    args.out.write_text(yaml.safe_dump(derived, sort_keys=False))
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v:.4g}" for k, v in derived["params"].items()
                                            if isinstance(v, float)))


if __name__ == "__main__":
    main()
