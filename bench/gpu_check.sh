#!/usr/bin/env bash
# GPU check, for a session lent a device (run from the repo root on the device machine):
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   (steps: 150+240+120+60 s at most)
# 1. the GPU-only tests (guarded and skipped on CPU CI); 2. `plait profile --local` on the GPU:
# GEMM grid, decomposition and contention with copy-engine / SM-copy stand-ins, written as a
# calibration file to $OUT; 3. the finer-grain schedules against an emulated link (plait bench
# --emulate-link: host-to-device copies stand in for a GPU-GPU link); 4. a real CUDA/NCCL
# profiler trace read by `plait analyze` (its GPU path is otherwise tested on synthetic
# traces). The device image has torch, typer, rich, numpy, matplotlib and pytest but not
# pydantic: first, here,
# `bash bench/gpu_wheels.sh` fetches its wheels into .whl; carry .whl and this script puts them
# on PYTHONPATH.
# NOTE: written without a device; not yet run on one.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q tests/test_runtime.py tests/test_cli.py tests/test_fp8.py -k "cuda or gpu" \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 240 python3 -m plait profile --local --device cuda --dtypes bf16 -H h200 \
  -o "$OUT/h200.yaml" --plot "$OUT/profile-h200" 2>&1 | tail -5
timeout 120 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --json "$OUT/emulate_link.json" 2>&1 | tail -14
timeout 40 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/trace_check.py --out "$OUT/trace-check" 2>&1 | tail -3
timeout 20 python3 -m plait analyze "$OUT/trace-check" --json "$OUT/analyze.json" 2>&1 | tail -12
# Then, back on the development machine: commit $OUT/h200.yaml as data/calibrations/h200.yaml
# (its meta holds the command) and check it: plait explore -H h200 --calibration
# data/calibrations/h200.yaml
