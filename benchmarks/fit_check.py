"""The fit answer against the device: project the largest batch that fits this machine's GPU
(`--max-batch`), then measure the cell at that batch and at 10% more, each in its own process.

PASS when the projected answer runs and the larger batch runs out of memory; the measured peak
reserved at the answer is printed against the projected one (projected / measured - 1).
Usage: python benchmarks/fit_check.py [--workload gpt] [--size gpt2-124m] [--technique amp-bf16]
Needs a CUDA GPU with a profile; elsewhere it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from harness.cell import MeasureSettings
from harness.plan import Cell
from harness.profiles import detect_local, load_profiles
from harness.project import batch_step, max_batch, project, smallest_batch
from harness.run import RunOptions, run_isolated
from suites.techniques import parse_stack
from suites.workloads import get_workload


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--size", default="gpt2-124m")
    parser.add_argument("--technique", default="amp-bf16")
    parser.add_argument("--mode", default="train")
    args = parser.parse_args(argv)
    local = detect_local(load_profiles())
    if local.vendor == "cpu":
        print("fit check skipped: no CUDA GPU here (the host CPU has no memory size to fit in)")
        return 0
    workload, stack = get_workload(args.workload), parse_stack(args.technique)
    spec = workload.size(args.size)
    unsupported = stack.check(local, workload, args.mode)
    if unsupported:
        print(f"fit check skipped: {unsupported}")
        return 0
    started = time.perf_counter()
    step = batch_step(stack)
    best = max_batch(workload, spec, stack, args.mode, local, step=step,
                     smallest=smallest_batch(stack, workload, args.mode))
    if best == 0:
        print(f"FAIL: no batch of {args.workload} {args.size} {args.technique} fits {local.id}: nothing to bracket")
        return 1
    projected = project(workload, spec, stack, args.mode, best, local).memory
    print(f"{local.id}: projected largest batch {best} for {args.workload} {args.size} {args.technique} "
          f"{args.mode} ({time.perf_counter() - started:.1f} s): reserved "
          f"{projected.reserved['native'] / 2**20:,.0f} MiB + {projected.overhead / 2**20:,.0f} MiB context "
          f"of {projected.capacity / 2**20:,.0f} MiB")
    over = math.ceil(best * 1.1 / step) * step
    options = RunOptions(run_id="fit-check", cell_timeout_s=120,
                         settings=MeasureSettings(warmup=1, steps=10, repeats=1))
    statuses = {}
    for batch in (best, over):
        record = run_isolated(Cell(args.workload, args.size, args.mode, stack.name, local.id, batch), options)
        statuses[batch] = record.status
        detail = (f"peak reserved {record.peak_reserved_bytes / 2**20:,.0f} MiB"
                  if record.peak_reserved_bytes else record.reason[:200])
        print(f"measured at batch {batch}: {record.status} ({detail})")
        if batch == best and record.peak_reserved_bytes:
            error = projected.reserved["native"] / record.peak_reserved_bytes - 1
            print(f"  projected / measured peak reserved - 1 at the answer: {error:+.1%}")
    passed = statuses[best] == "ok" and statuses[over] == "oom"
    print(f"{'PASS' if passed else 'FAIL'}: batch {best} {statuses[best]}, batch {over} {statuses[over]} "
          "(expected ok, then oom)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
