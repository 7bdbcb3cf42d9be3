#!/usr/bin/env bash
# The fine-tuning issue's GPU checks, apart from gpu_check.sh (which they would push past 8 minutes): 305 s
# in all (a cold torch.compile of the training step takes about a minute, so each cell gets 75 s), then
# fused attention's measured share of the matmul rate against the speed model's assumption (20 s),
# int4 tinygemm's against bf16's (20 s: a cold torch and torchao import, CUDA start-up, the quantisation),
# and ResNet-50's inference kernels, fp32 and bf16, with the layout transposes the model charges (25 s).
# gpt2-124m training at its standard batch, each cell with its projected twin:
#   amp-bf16 (eager, the reference), amp-bf16+compile (target: at least 40% MFU on an H100/H200),
#   fp8+compile (torchao float8 training, as it is meant to run), amp-bf16+optim-offload (torchao's CPU
#   offload optimizer: host bytes, step time over the host link).
# Device: run(command="OUT=$OUT bash benchmarks/gpu_check_training.sh", carry=[".gpu_vendor"], timeout_s=320)
# $OUT gets summary-training.txt and gpu_check_training.tgz (every log and the results folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
WORK=${WORK:-/tmp/gpu_check_training}
PY=${PYTHON:-python3}
SIZE=${SIZE:-gpt2-124m}  # SIZE=smoke runs the same plumbing on a CPU in seconds
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".:.gpu_vendor${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary-training.txt"
source benchmarks/check_steps.sh
trap 'tar czf "$OUT/gpu_check_training.tgz" -C "$WORK" . 2>/dev/null' EXIT

step "$SIZE training: eager, optimizer offload, compiled, fp8 compiled (warm-up holds the compilation)"
timeout -k 5 225 $PY -m harness.cli run --workload gpt --size "$SIZE" --mode train \
  --technique amp-bf16,amp-bf16+optim-offload,amp-bf16+compile,fp8+compile --steps 10 --repeats 1 --warmup 3 \
  --cell-timeout 75 --out "$WORK/bench-training" > "$WORK/run-training.txt" 2>&1
status $?
$PY - "$WORK/bench-training" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import sys
from harness.records import read_results
frame = read_results(sys.argv[1])
columns = ["technique", "source", "status", "step_time_ms_p50", "mfu", "warmup_s", "peak_allocated_bytes",
           "host_bytes", "step_time_error_vs_measured", "peak_error_vs_measured"]
print(frame[[c for c in columns if c in frame.columns]].to_string(index=False))
PYEOF
step "fused attention's share of the matmul rate, measured and as the speed model assumes it"
timeout -k 5 20 $PY benchmarks/attention_share.py 2>&1 | tee -a "$SUMMARY"
status $?
step "int4 tinygemm against bf16 by row count, measured and as the speed model assumes it"
timeout -k 5 20 $PY benchmarks/tinygemm_share.py 2>&1 | tee -a "$SUMMARY"
status $?
step "ResNet-50 inference kernels: convolutions and layout transposes, measured and as the speed model charges them"
timeout -k 5 25 $PY benchmarks/conv_kernels.py 2>&1 | tee -a "$SUMMARY"
status $?
end_steps
