# Sourced by bench/gpu_check.sh and bench/gpu_emulate.sh: $OUT made, the carried wheels (.whl,
# from bench/gpu_wheels.sh) installed beside the device image's packages, plait from src/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
