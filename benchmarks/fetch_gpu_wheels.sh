#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the wheels benchmarks/gpu_check.sh installs on a
# CUDA machine that cannot reach PyPI (its image may hold an older transformers).
#   bash benchmarks/fetch_gpu_wheels.sh [WHEEL_DIR]   (default .whl, git-ignored)
set -euo pipefail
dir=${1:-.whl}
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" "transformers==5.23.0"
ls -la "$dir"
