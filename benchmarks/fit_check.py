"""The fit answer against the device: project the largest batch that fits this machine's GPU
(`--max-batch`), then measure the cell at that batch and at 10% more, each in its own process.

PASS when the projected answer runs and the larger batch (at least 10% more, and projected not to
fit) runs out of memory; the measured peak reserved at the answer is printed against the projected
one (projected / measured - 1; the answer is the largest batch projected to fit without the allocator
freeing its cache and retrying, so its measured allocator retries should be 0).
Usage: python benchmarks/fit_check.py [--workload gpt] [--size gpt2-124m] [--technique amp-bf16]
Needs a CUDA GPU with a profile; elsewhere it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from harness.cell import Cell
from harness.measure.local import MeasureSettings
from harness.profiles import detect_local, load_profiles
from harness.project import batch_step, max_batch, project, smallest_batch
from harness.runner import RunnerOptions, run_isolated


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--size", default="gpt2-124m")
    parser.add_argument("--technique", default="amp-bf16")
    parser.add_argument("--mode", default="train")
    args = parser.parse_args(argv)
    profiles = load_profiles()
    local = detect_local(profiles)
    if local.vendor == "cpu":
        print("fit check skipped: no CUDA GPU here (the host CPU has no memory size to fit in)")
        return 0
    cell = Cell(args.workload, args.size, args.mode, args.technique, local.id, 1).resolve(profiles)
    if cell.unsupported:
        print(f"fit check skipped: {cell.unsupported}")
        return 0
    stack = cell.stack
    started = time.perf_counter()
    step = batch_step(stack)
    best = max_batch(cell, step=step, smallest=smallest_batch(stack, cell.workload, args.mode))
    if best == 0:
        print(f"FAIL: no batch of {args.workload} {args.size} {args.technique} fits {local.id}: nothing to bracket")
        return 1
    projected = project(cell.with_batch(best)).memory
    print(f"{local.id}: projected largest batch {best} for {args.workload} {args.size} {args.technique} "
          f"{args.mode} ({time.perf_counter() - started:.1f} s): allocated {projected.peak_allocated / 2**20:,.0f} "
          f"MiB, reserved unconstrained {projected.reserved['native'] / 2**20:,.0f} MiB, + "
          f"{projected.overhead / 2**20:,.0f} MiB context, of {projected.capacity / 2**20:,.0f} MiB, without "
          "cache-freeing retries")
    # The larger batch: at least 10% more, and one the projection itself says does not fit (fit is not
    # monotonic in the batch: the allocator's size classes change the fragmentation).
    over = math.ceil(best * 1.1 / step) * step
    while project(cell.with_batch(over)).memory.fits:
        over += step
    options = RunnerOptions(run_id="fit-check", cell_timeout_s=30,
                         settings=MeasureSettings(warmup=1, steps=10, repeats=1))
    statuses = {}
    for batch in (best, over):
        record = run_isolated(cell.with_batch(batch), options)
        statuses[batch] = record.status
        detail = (f"peak reserved {record.peak_reserved_bytes / 2**20:,.0f} MiB, "
                  f"{record.alloc_retries} allocator retries" if record.peak_reserved_bytes else record.reason[:200])
        print(f"measured at batch {batch}: {record.status} ({detail})")
        if batch == best and record.peak_allocated_bytes:
            print(f"  projected / measured - 1 at the answer: peak allocated "
                  f"{projected.peak_allocated / record.peak_allocated_bytes - 1:+.1%}, peak reserved "
                  f"{projected.reserved['native'] / record.peak_reserved_bytes - 1:+.1%}")
    passed = statuses[best] == "ok" and statuses[over] == "oom"
    print(f"{'PASS' if passed else 'FAIL'}: batch {best} {statuses[best]}, batch {over} {statuses[over]} "
          "(expected ok, then oom)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
