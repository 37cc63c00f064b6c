#!/usr/bin/env bash
# GPU acceptance check: one command, under 8 minutes on one H200, everything under $OUT (7 files).
# On the device machine, from the repo root, after `bash bench/gpu_wheels.sh` here:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Elsewhere: OUT=out/gpu bash bench/gpu_check.sh
#  1. the GPU tests (guarded, skipped on CPU CI): a one-GPU group, the copy-engine path, FP8
#     ops against torch._scaled_mm, an OVERLAP_F_B step of DualPipeV on one GPU with two
#     strands (a stream per stage; the backward on CUDA's autograd thread), the CUDA-path tests
#  2. the whole suite on this machine, CUDA visible (forked ranks must still work)
#  3. plait profile --local on the GPU -> $OUT/h200.yaml (a calibration)
#  4. plait bench --emulate-link, predicted against measured: the preset, then the calibration
#  5. plait coexec run on CPU ranks started from this GPU machine (co-execution, four ways)
#  6. plait doctor
# Files: log.txt (every step), suite.txt, h200.yaml, emulate_link.json,
#        emulate_link_calibrated.json, emulate_link_calibrated_4096.json, doctor.json
source bench/gpu_env.sh

step() { echo; echo "== $1 [$(date +%T)]"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,sys;print('python',sys.version.split()[0],'torch',torch.__version__,
'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version())"
step "1 GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_paths.py \
  tests/test_runtime.py tests/test_cli.py tests/test_fp8.py tests/test_overlap_f_b_runtime.py \
  -k "cuda or gpu or caller or backend or device or symm or doctor or memory" 2>&1 | tail -15
step "2 whole suite, CUDA visible"
timeout 210 python3 -m pytest -q -p no:cacheprovider -n 12 -rs > "$OUT/suite.txt" 2>&1
tail -25 "$OUT/suite.txt"
step "3 profile --local"
timeout 90 python3 -m plait profile --local --device cuda --dtypes bf16 -H h200 -o "$OUT/h200.yaml" 2>&1 \
  | tail -4
step "4 emulated link: preset, then calibration"
timeout 80 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --json "$OUT/emulate_link.json" 2>&1 | tail -16
timeout 80 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --calibration "$OUT/h200.yaml" --json "$OUT/emulate_link_calibrated.json" 2>&1 | tail -16
timeout 60 python3 -m plait bench --emulate-link --shape 4096x8192x8192 --ranks 8 \
  --calibration "$OUT/h200.yaml" --json "$OUT/emulate_link_calibrated_4096.json" 2>&1 | tail -14
step "5 coexec run on CPU ranks from a GPU machine"
timeout 90 python3 -m plait coexec run --ranks 2 --layers 2 --hidden 256 --ffn 512 --seq-len 256 2>&1 \
  | tail -12
step "6 doctor"
timeout 30 python3 -m plait doctor --json "$OUT/doctor.json" 2>&1 | tail -20
step "done"
} 2>&1 | tee "$OUT/log.txt"
