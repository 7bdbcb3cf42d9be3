"""How fast projection answers: GPT-3 175B training under amp-bf16 (target < 10 s), and the default
projection matrix: every workload at its canonical size x every technique x train/infer x every
GPU profile (target < 2 minutes). Prints wall times and the status counts.
Usage: python benchmarks/projection_speed.py
"""

from __future__ import annotations

import time
from collections import Counter

from harness.cell import Cell
from harness.plan import expand
from harness.profiles import load_profiles
from harness.runner import RunnerOptions, run_cell
from suites.techniques import technique_names
from suites.workloads import WORKLOADS


def main() -> None:
    profiles = load_profiles()
    started = time.perf_counter()
    options = RunnerOptions(run_id="speed")
    record = run_cell(Cell("gpt", "gpt3-175b", "train", "amp-bf16", "h100-sxm", 1, source="projected"), profiles,
                      options)[0]
    elapsed = time.perf_counter() - started
    print(f"gpt3-175b train amp-bf16 on h100-sxm: {elapsed:.1f} s (target < 10 s): {record.status}, "
          f"peak {record.peak_allocated_bytes / 2**30:,.0f} GiB -> {'PASS' if elapsed < 10 else 'FAIL'}")

    gpus = [p for p in profiles.values() if p.vendor != "cpu"]
    cells = expand(list(WORKLOADS), technique_names(), gpus, ["train", "infer"], scale="standard", source="projected")
    started = time.perf_counter()
    statuses = Counter()
    for cell in cells:
        statuses[run_cell(cell, profiles, options)[0].status] += 1
    elapsed = time.perf_counter() - started
    print(f"default matrix: {len(cells)} cells ({len(WORKLOADS)} workloads at canonical sizes x "
          f"{len(technique_names())} stacks x 2 modes x {len(gpus)} GPUs) in {elapsed:.1f} s "
          f"(target < 120 s): {dict(statuses)} -> {'PASS' if elapsed < 120 else 'FAIL'}")


if __name__ == "__main__":
    main()
