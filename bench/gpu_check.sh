#!/usr/bin/env bash
# GPU acceptance check: one command, under 8 minutes on one H100 or H200, everything under $OUT
# (8 files). On the device machine, from the repo root, after `bash bench/gpu_wheels.sh` here:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Elsewhere: OUT=out/gpu bash bench/gpu_check.sh
#  1. the real CUDA tests (`-m cuda`, skipped on CPU CI), counted apart from the CPU stand-ins
#     of the CUDA paths (tests/test_cuda_paths.py): a one-GPU group, FP8 ops against
#     torch._scaled_mm, a stream per stage, and several ranks sharing the GPU
#     (tests/test_cuda_ranks.py, TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1): every /dma
#     schedule through the copy engine on 2 and 4 processes, alternating streams with a slow
#     rank, a late rank, no host sync, CUDA-graph capture, OVERLAP_F_B between two ranks
#  2. the copy engine and OVERLAP_F_B under the CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1)
#  3. the whole suite on this machine, CUDA visible (forked ranks must still work)
#  4. plait profile --local on the GPU -> $OUT/gpu.yaml (a calibration)
#  5. plait bench --emulate-link, predicted against measured: the preset, then the calibration
#  6. plait doctor
# Files: log.txt (every step), cuda_tests.txt, sanitizer.txt, suite.txt, gpu.yaml,
#        emulate_link.json, emulate_link_calibrated.json, doctor.json
source bench/gpu_env.sh

step() { echo; echo "== $1 [$(date +%T)]"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,sys;print('python',sys.version.split()[0],'torch',torch.__version__,
'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version())"
step "1 real CUDA tests (-m cuda), then the CPU stand-ins"
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 timeout 240 python3 -m pytest -q -p no:cacheprovider \
  -m cuda -rs -s > "$OUT/cuda_tests.txt" 2>&1
grep -E "CUDA graph|passed|failed|error" "$OUT/cuda_tests.txt" | tail -8
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py 2>&1 | tail -1 \
  | sed 's/^/CPU stand-ins of the CUDA paths: /'
step "2 stream sanitizer over the copy engine and OVERLAP_F_B"
TORCH_CUDA_SANITIZER=1 TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 timeout 150 python3 -m pytest \
  -q -p no:cacheprovider tests/test_cuda_ranks.py tests/test_overlap_f_b_runtime.py -m cuda \
  -k "every_dma or alternating or overlap_f_b or stream_per_stage" > "$OUT/sanitizer.txt" 2>&1
grep -ciE "data race|CSANError" "$OUT/sanitizer.txt" | sed 's/^/sanitizer findings: /'
tail -1 "$OUT/sanitizer.txt"
step "3 whole suite, CUDA visible"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -rs > "$OUT/suite.txt" 2>&1
tail -25 "$OUT/suite.txt"
step "4 profile --local"
PRESET=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && echo h100 || echo h200)
timeout 90 python3 -m plait profile --local --device cuda --dtypes bf16 -H "$PRESET" \
  -o "$OUT/gpu.yaml" 2>&1 \
  | tail -4
step "5 emulated link: preset, then calibration"
timeout 80 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --json "$OUT/emulate_link.json" 2>&1 | tail -16
timeout 80 python3 -m plait bench --emulate-link --shape 16384x4096x8192 --ranks 8 \
  --calibration "$OUT/gpu.yaml" --json "$OUT/emulate_link_calibrated.json" 2>&1 | tail -16
step "6 doctor"
timeout 30 python3 -m plait doctor --json "$OUT/doctor.json" 2>&1 | tail -20
step "done"
} 2>&1 | tee "$OUT/log.txt"
