#!/usr/bin/env bash
# Every GPU check in one run, sized for a lent GPU machine's budget (about 6 minutes on an H200):
# measured cells with their projected twins (peak, reserved and step-time errors), then the tests
# that skip without CUDA (2:4 semi-structured kernels, int4 tinygemm, fp8, autocast lists).
# Here:   bash benchmarks/gpu_vendor.sh
# Device: run(command="OUT=$OUT bash benchmarks/gpu_check.sh", carry=[".gpu_vendor"], timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=".:.gpu_vendor${PYTHONPATH:+:$PYTHONPATH}"
step() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/summary.txt"
python -m harness.cli env 2>&1 | tee "$OUT/env.txt" | head -20

step "measured cells and projected twins"
timeout 300 python -m harness.cli run --scale standard --workload gpt,bert,resnet50 \
  --technique baseline,amp-bf16,checkpointing --steps 10 --repeats 2 --warmup 2 --cell-timeout 90 \
  --out "$OUT/bench" > "$OUT/run.txt" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
tail -5 "$OUT/run.txt"
python benchmarks/twin_errors.py "$OUT/bench" 2>&1 | tee -a "$OUT/summary.txt"

step "tests that need CUDA"
timeout 120 python -m pytest -q -rs -p no:cacheprovider tests/test_sparsity.py tests/test_quantization.py \
  tests/test_fp8.py tests/test_autocast_policy.py > "$OUT/pytest.txt" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
tail -25 "$OUT/pytest.txt" | tee -a "$OUT/summary.txt"
step "done"
