#!/usr/bin/env bash
# Every GPU check in one run, under 8 minutes by construction (each step has its own limit; they sum to
# 475 s, 7.9 min): a quick calibration (50 s), measured cells with their projected twins for each workload
# (50 + 45 + 45 s: peak, reserved and step-time errors), the allocator settings as techniques (50 s), the
# fragmentation workload under each setting (45 s), measured decode of served decoders (65 s), FSDP and
# its CPU offload on one GPU (35 s), the projected largest batch measured (45 s: it must run, 10% more
# must not), then every test marked `gpu` (45 s).
# Here:   nox -s gpu-check   (or: bash benchmarks/gpu_vendor.sh, then on the device machine)
# Device: run(command="OUT=$OUT bash benchmarks/gpu_check.sh", carry=[".gpu_vendor"], timeout_s=540)
# $OUT gets two files (the device returns at most 8): summary.txt, written as it goes, and
# gpu_check.tgz with every log and results folder (from $WORK).
# SMOKE=1 runs the same steps on smoke sizes with limits 8x longer, on any machine (4.5 to 6 minutes on a
# 2-core CPU): it checks the script's plumbing (arguments, columns, the ledger merge) before device time
# is spent on it, and measures no GPU (`nox -s gpu-check-smoke`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
WORK=${WORK:-/tmp/gpu_check}
PY=${PYTHON:-python3}
if [ "${SMOKE:-0}" = 1 ]; then
  SCALE=smoke; SIZE=smoke; SERVED=smoke; PROMPT=16; GEN=8; FACTOR=8  # smoke decoders hold 64 positions
else
  SCALE=standard; SIZE=gpt2-124m; SERVED=gpt2-124m,gpt-7b; PROMPT=512; GEN=32; FACTOR=1
fi
limit() { echo $(( $1 * FACTOR )); }  # a step's (or a cell's) seconds
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".:.gpu_vendor${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1                # a step killed by its timeout keeps what it printed
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the machine's own pytest plugins would load into the carried pytest
SUMMARY="$OUT/summary.txt"
source benchmarks/check_steps.sh
pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" . 2>/dev/null; }
trap pack EXIT

step "device"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$SUMMARY"
else
  echo "no nvidia-smi: no NVIDIA GPU measured here" | tee -a "$SUMMARY"
fi
$PY -m harness.cli env 2>&1 | tee "$WORK/env.txt" | head -20

# The device's achievable matmul rates, bandwidth and per-op costs, as a profile overlay (kept in the
# tarball; copy it into a --profiles folder to project this GPU with it).
step "calibrate"
timeout -k 5 "$(limit 50)" $PY -m harness.cli calibrate --quick --out "$WORK/calibration" 2>&1 | tee -a "$SUMMARY" | tail -3
status $?

# One run per workload, each under its own limit: a run attaches the twins' errors when it ends, so a
# limit that cuts one run short loses only that workload's errors.
for workload in gpt bert resnet50; do
  step "measured cells and projected twins: $workload"
  generation=(); [ "$workload" = gpt ] && generation=(--gen-len "$GEN")  # gpt's inference is a generation
  seconds=45; [ "$workload" = gpt ] && seconds=50  # its served cells also decode
  timeout -k 5 "$(limit $seconds)" $PY -m harness.cli run --scale "$SCALE" --workload "$workload" "${generation[@]}" \
    --technique baseline,amp-bf16,checkpointing --steps 10 --repeats 2 --warmup 2 --cell-timeout "$(limit 30)" \
    --out "$WORK/bench-$workload" > "$WORK/run-$workload.txt" 2>&1
  status $?
  tail -3 "$WORK/run-$workload.txt"
done
# The allocator settings as techniques: each cell's process restarts with its PYTORCH_CUDA_ALLOC_CONF, and
# the row records the setting the allocator reports (its twin is compared with that setting's projection).
step "allocator settings: gpt train amp-bf16 under expandable segments and cudaMallocAsync"
timeout -k 5 "$(limit 50)" $PY -m harness.cli run --scale "$SCALE" --workload gpt --mode train \
  --technique amp-bf16+alloc-expandable,amp-bf16+alloc-async --steps 10 --repeats 2 --warmup 2 \
  --cell-timeout "$(limit 22)" \
  --out "$WORK/bench-alloc" > "$WORK/run-alloc.txt" 2>&1
status $?
# The fragmentation workload (a length drawn per step) under each setting: its measured reserved peak over the
# loop against the allocator model's replay of the loop (C4).
step "fragmentation workload: $SIZE variable-length loop under native, expandable segments, cudaMallocAsync"
timeout -k 5 "$(limit 45)" $PY -m harness.cli run --workload fragmentation --size "$SIZE" --mode train \
  --technique amp-bf16,amp-bf16+alloc-expandable,amp-bf16+alloc-async --steps 10 --repeats 1 --warmup 0 \
  --cell-timeout "$(limit 14)" --out "$WORK/bench-fragmentation" > "$WORK/run-fragmentation.txt" 2>&1
status $?
# Serving: measured decode (tokens/s, bandwidth use) of gpt2-124m and a 7B shape (random weights) in bf16,
# int8 and int4 weights, eager and compiled, each with its projected twin (issue: LLM serving, point 7).
step "serving: $SERVED decode"
timeout -k 5 "$(limit 65)" $PY -m harness.cli run --workload gpt --size "$SERVED" --mode infer --batch-size 1 \
  --prompt-len "$PROMPT" --gen-len $((2 * GEN)) --steps 10 --repeats 1 --warmup 1 --cell-timeout "$(limit 30)" \
  --technique bf16-weights,bf16-weights+compile,bf16-weights+group-quant+compile,bf16-weights+group-quant-int4+compile \
  --out "$WORK/bench-serving" > "$WORK/run-serving.txt" 2>&1
status $?
$PY - "$WORK/bench-serving" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import os
import sys
from harness.records import read_results
frame = read_results(sys.argv[1])
if os.environ.get("SMOKE") != "1":
    frame = frame[frame["gpu"] != "cpu"]  # the device's rows and their twins
columns = ["size", "technique", "source", "status", "decode_ms_per_token_p50", "decode_tokens_s",
           "decode_bandwidth_util", "ttft_ms", "kv_cache_bytes", "params_bytes"]
print(frame[columns].to_string(index=False))
PYEOF
# What one GPU can run of the sharding techniques (FSDP2 over one rank, its CPU offload, bf16 gathers), each
# against its projection: the communication-free part of the parallel issue's checks.
step "sharding on one GPU: fsdp, cpu-offload, fsdp:mp=bf16 at world size 1"
timeout -k 5 "$(limit 35)" $PY -m harness.cli run --workload gpt --size "$SIZE" --mode train --world-size 1 \
  --technique fsdp+amp-bf16,cpu-offload+amp-bf16,fsdp:mp=bf16+amp-bf16 --steps 10 --repeats 1 --warmup 1 \
  --cell-timeout "$(limit 11)" --out "$WORK/bench-sharding" > "$WORK/run-sharding.txt" 2>&1
status $?

$PY benchmarks/twin_errors.py "$WORK"/bench-* 2>&1 | tee -a "$SUMMARY"
# The twins join a copy of the ledger (merge it here with `headroom ledger add` on the unpacked folders).
cp harness/data/ledger.csv "$WORK/ledger.csv"
$PY -m harness.cli ledger add "$WORK"/bench-* --ledger "$WORK/ledger.csv" 2>&1 | tee -a "$SUMMARY"

step "fit: the projected largest batch against the device"
timeout -k 5 "$(limit 45)" $PY benchmarks/fit_check.py > "$WORK/fit-check.txt" 2>&1
status $?
grep -v "^W[0-9]" "$WORK/fit-check.txt" | tail -8 | tee -a "$SUMMARY"

step "tests that need CUDA (marked gpu)"
timeout -k 5 "$(limit 45)" $PY -m pytest -q -rs -p no:cacheprovider -m gpu tests/ \
  > "$WORK/pytest.txt" 2>&1
status $?
tail -25 "$WORK/pytest.txt" | tee -a "$SUMMARY"
end_steps
