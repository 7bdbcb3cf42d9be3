#!/usr/bin/env bash
# Builds .gpu_vendor/: the pure-Python packages the lent GPU machine lacks (it has torch, torchvision,
# pandas, jinja2, matplotlib, pyarrow and nvidia-ml-py but no network): rich for the CLI, pytest and
# hypothesis for the GPU-only tests, torchao (Python only; its compiled kernels target another torch)
# for fp8 and int4. Carry it to the device with run(..., carry=[".gpu_vendor"]); about 22 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_vendor
python3 -m pip install --quiet --no-deps --target .gpu_vendor rich markdown-it-py mdurl pygments \
  pytest pluggy iniconfig packaging hypothesis attrs sortedcontainers "torchao>=0.18,<0.19"
find .gpu_vendor -name "__pycache__" -prune -exec rm -rf {} +
find .gpu_vendor/torchao -name "*.so" -delete
du -sh .gpu_vendor
