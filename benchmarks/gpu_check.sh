#!/usr/bin/env bash
# Every GPU check in one run, sized for a lent GPU machine's budget (at most about 11 minutes: calibration
# (about 2 min), 3 x 90 s of runs, 100 s of serving, 2 x 60 s under the other allocator settings, 70 s of fit
# check, 75 s of tests; trim the runs' limits if the budget is tighter): calibration, measured
# cells with their projected twins (peak, reserved and step-time errors), the projected largest batch
# measured (it must run, 10% more must not), then the tests that skip without CUDA (2:4
# semi-structured kernels, int4 tinygemm, fp8, autocast lists).
# Here:   bash benchmarks/gpu_vendor.sh
# Device: run(command="OUT=$OUT bash benchmarks/gpu_check.sh", carry=[".gpu_vendor"], timeout_s=600)
# $OUT gets two files (the device returns at most 8): summary.txt, written as it goes, and
# gpu_check.tgz with every log and results folder (from $WORK).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
WORK=${WORK:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".:.gpu_vendor${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1                # a step killed by its timeout keeps what it printed
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the machine's own pytest plugins would load into the carried pytest
step() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" . 2>/dev/null; }
trap pack EXIT

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/summary.txt"
$PY -m harness.cli env 2>&1 | tee "$WORK/env.txt" | head -20

# The device's achievable matmul rates, bandwidth and per-op costs, as a profile overlay (kept in the
# tarball; copy it into a --profiles folder to project this GPU with it).
step "calibrate"
timeout -k 5 150 $PY -m harness.cli calibrate --out "$WORK/calibration" 2>&1 | tee -a "$OUT/summary.txt" | tail -3

# One run per workload, each under its own limit: a run attaches the twins' errors when it ends, so a
# limit that cuts one run short loses only that workload's errors.
for workload in gpt bert resnet50; do
  step "measured cells and projected twins: $workload"
  generation=(); [ "$workload" = gpt ] && generation=(--gen-len 32)  # gpt's inference is a generation
  timeout -k 5 90 $PY -m harness.cli run --scale standard --workload "$workload" "${generation[@]}" \
    --technique baseline,amp-bf16,checkpointing --steps 10 --repeats 2 --warmup 2 --cell-timeout 60 \
    --out "$WORK/bench-$workload" > "$WORK/run-$workload.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  tail -3 "$WORK/run-$workload.txt"
done
# The allocator model's other settings: one training cell each (the setting must be in the
# environment before the cell's process starts; the rows record the setting the allocator reports).
for conf in expandable_segments:True backend:cudaMallocAsync; do
  name=${conf//[:]/-}
  step "allocator $conf: gpt train amp-bf16"
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout -k 5 60 $PY -m harness.cli run --scale standard --workload gpt \
    --technique amp-bf16 --mode train --steps 10 --repeats 2 --warmup 2 --cell-timeout 50 \
    --out "$WORK/bench-alloc-$name" > "$WORK/run-alloc-$name.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
done
# Serving: measured decode (tokens/s, bandwidth use) of gpt2-124m and a 7B shape (random weights) in bf16,
# int8 and int4 weights, eager and compiled, each with its projected twin (issue: LLM serving, point 7).
step "serving: gpt2-124m and gpt-7b decode"
timeout -k 5 100 $PY -m harness.cli run --workload gpt --size gpt2-124m,gpt-7b --mode infer --batch-size 1 \
  --prompt-len 512 --gen-len 64 --steps 10 --repeats 1 --warmup 1 --cell-timeout 45 \
  --technique bf16-weights,bf16-weights+compile,bf16-weights+group-quant+compile,bf16-weights+group-quant-int4+compile \
  --out "$WORK/bench-serving" > "$WORK/run-serving.txt" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
$PY - "$WORK/bench-serving" <<'PYEOF' 2>&1 | tee -a "$OUT/summary.txt"
import sys
from harness.records import read_results
frame = read_results(sys.argv[1])
columns = ["size", "technique", "source", "status", "decode_ms_per_token_p50", "decode_tokens_s",
           "decode_bandwidth_util", "ttft_ms", "kv_cache_bytes", "params_bytes"]
print(frame[frame["gpu"] != "cpu"][columns].to_string(index=False))
PYEOF
$PY benchmarks/twin_errors.py "$WORK"/bench-* 2>&1 | tee -a "$OUT/summary.txt"
# The twins join a copy of the ledger (merge it here with `headroom ledger add` on the unpacked folders).
cp harness/data/ledger.csv "$WORK/ledger.csv"
$PY -m harness.cli ledger add "$WORK"/bench-* --ledger "$WORK/ledger.csv" 2>&1 | tee -a "$OUT/summary.txt"

step "fit: the projected largest batch against the device"
timeout -k 5 70 $PY benchmarks/fit_check.py > "$WORK/fit-check.txt" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
grep -v "^W[0-9]" "$WORK/fit-check.txt" | tail -8 | tee -a "$OUT/summary.txt"

step "tests that need CUDA"
timeout -k 5 75 $PY -m pytest -q -rs -p no:cacheprovider tests/test_sparsity.py tests/test_quantization.py \
  tests/test_fp8.py tests/test_autocast_policy.py > "$WORK/pytest.txt" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
tail -25 "$WORK/pytest.txt" | tee -a "$OUT/summary.txt"
step "done"
