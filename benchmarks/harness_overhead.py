"""How much the harness adds to the step time it reports, against a bare hand-written loop.

For each workload's smoke size (train), in one process and interleaved A/B/A/B to cancel drift:
A = `measure_cell` (the harness path: Step object, phase marks off, timed loop) and its reported p50;
B = a hand-written loop of the same steps (zero_grad, forward, loss, backward, AdamW step) on a
model built the same way, timed with perf_counter, its p50. Prints B's p50, A's p50 and A/B
(target <= 1.02). Usage: python benchmarks/harness_overhead.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness.cell import MeasureSettings, measure_cell
from harness.plan import Cell
from harness.profiles import load_profiles
from suites.workloads import WORKLOADS


def bare_loop_p50_ms(workload, spec, steps: int, warmup: int) -> float:
    """The same training steps written out by hand, no harness code at all."""
    torch.manual_seed(0)
    model = workload.build(spec)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(0))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, batch)
        loss.backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cpu = load_profiles()["cpu"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps")
    print(f"{'workload':10} {'bare p50 ms':>12} {'harness p50 ms':>15} {'ratio':>7}")
    worst = 0.0
    for name, workload in WORKLOADS.items():
        spec = workload.sizes["smoke"]
        cell = Cell(name, spec.name, "train", "baseline", "cpu", spec.batch_size)
        ratios, bare_all, harness_all = [], [], []
        for _ in range(args.rounds):
            record = measure_cell(cell, cpu, "overhead", MeasureSettings(warmup=3, steps=args.steps, repeats=1))
            bare = bare_loop_p50_ms(workload, spec, args.steps, warmup=3)
            harness_all.append(record.step_time_ms_p50)
            bare_all.append(bare)
            ratios.append(record.step_time_ms_p50 / bare)
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        print(f"{name:10} {statistics.median(bare_all):12.3f} {statistics.median(harness_all):15.3f} {ratio:7.3f}")
    print(f"worst ratio {worst:.3f} (target <= 1.02): {'PASS' if worst <= 1.02 else 'FAIL'}")


if __name__ == "__main__":
    main()
