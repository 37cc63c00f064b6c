#!/usr/bin/env bash
# Fetch, on the development machine, the wheels the GPU device image lacks (it has torch, typer,
# rich, PyYAML, numpy, matplotlib, pytest; not pydantic) into .whl/, pinned as requirements.lock
# pins them, for Python 3.12 on x86-64 Linux. Then run bench/gpu_check.sh with carry=[".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(grep -iE '^(pydantic|pydantic_core|annotated-types|typing-inspection)==' requirements.lock)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
