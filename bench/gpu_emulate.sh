#!/usr/bin/env bash
# Steps 3-4 of bench/gpu_check.sh alone (a calibration, then the emulated link predicted against
# measured, by the preset and by the calibration), for a short device lease:
#   run(command="bash bench/gpu_emulate.sh", carry=[".whl"], timeout_s=200)
source bench/gpu_env.sh
{
timeout 60 python3 -m plait profile --local --device cuda --dtypes bf16 -H h200 \
  -o "$OUT/h200.yaml" 2>&1 | tail -2
timeout 60 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --json "$OUT/emulate_link.json" 2>&1 | tail -16
timeout 60 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --calibration "$OUT/h200.yaml" --json "$OUT/emulate_link_calibrated.json" 2>&1 | tail -16
} 2>&1 | tee "$OUT/log.txt"
