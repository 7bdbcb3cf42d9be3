"""How much the harness adds to the step time it reports, against a bare hand-written loop.

For each workload's smoke size (train), one model and one AdamW optimizer in one process, and
rounds that alternate A and B back to back so machine drift hits both alike:
A = the harness's timing path (`time_steps` over the `Step` the cells run), its p50;
B = the same steps written out by hand (zero_grad, loss, backward, step), timed with perf_counter, its p50.
Prints the medians and the median per-round ratio A/B (target <= 1.02).
Usage: python benchmarks/harness_overhead.py [--rounds 15] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from harness.measure.timing import time_steps
from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run
from suites.workloads import WORKLOADS


def bare_p50_ms(model, optimizer, workload, batch, steps: int) -> float:
    """The training step written out by hand: no harness code at all."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, batch)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cpu = load_profiles()["cpu"]
    device = torch.device("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} alternating rounds x {args.steps} steps each")
    print(f"{'workload':10} {'bare p50 ms':>12} {'harness p50 ms':>15} {'ratio':>7}")
    worst = 0.0
    for name, workload in WORKLOADS.items():
        spec = workload.sizes["smoke"]
        torch.manual_seed(0)
        run = Run(workload=workload, size=spec, mode="train", profile=cpu, model=workload.build(spec),
                  batch_size=spec.batch_size)
        step = Step(run, device)
        batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(0))
        for _ in range(3):
            step(batch)
        ratios, bare_all, harness_all = [], [], []
        for _ in range(args.rounds):
            harness = time_steps(partial(step, batch), args.steps, 1, device).percentile_ms(0.5)
            bare = bare_p50_ms(step.model, step.optimizer, workload, batch, args.steps)
            harness_all.append(harness)
            bare_all.append(bare)
            ratios.append(harness / bare)
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        print(f"{name:10} {statistics.median(bare_all):12.3f} {statistics.median(harness_all):15.3f} {ratio:7.3f}")
    print(f"worst ratio {worst:.3f} (target <= 1.02): {'PASS' if worst <= 1.02 else 'FAIL'}")


if __name__ == "__main__":
    main()
