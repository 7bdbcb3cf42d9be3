"""Projected speed against published measurements (reference/calibration.md), with the errors.

Each row projects a published single-GPU configuration as closely as the suite's workloads allow
and prints projected vs published throughput and the relative error. The roofline's efficiency
factors (harness/project/roofline.py) are judged by these errors; `--fit` searches a grid of
factors for the set with the smallest mean absolute log error over these rows and prints it.
Usage: python benchmarks/projection_calibration.py [--fit]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import warnings
from typing import NamedTuple

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project
from harness.project.roofline import EFFICIENCY, estimate
from suites.techniques import parse_stack
from suites.workloads import WORKLOADS


class Published(NamedTuple):
    label: str
    workload: str
    size: str
    stack: str
    gpu: str
    batch: int
    seq_len: int | None
    value: float  # samples/s, or tokens/s when per_token
    per_token: bool
    source: str
    tf32: bool = False  # the published run enabled TF32 matmuls
    accumulation: bool = False  # many micro-batches per optimizer step: the optimizer's cost is amortised away
    caveat: str = ""    # why the row cannot be compared like for like (kept out of the fit)


ROWS = [
    Published("ResNet-50 TF32 b256", "resnet50", "resnet50", "baseline", "a100-sxm4-80gb", 256, None, 938, False,
              "NVIDIA DeepLearningExamples RN50 v1.5, NGC 21.03", tf32=True),
    Published("ResNet-50 AMP b256", "resnet50", "resnet50", "amp-fp16", "a100-sxm4-80gb", 256, None, 2470, False,
              "NVIDIA DeepLearningExamples RN50 v1.5 (channels-last), NGC 21.03"),
    Published("BERT-large FP16 s128", "bert", "bert-large", "amp-fp16", "a100-sxm4-80gb", 64, 128, 580, False,
              "NVIDIA DeepLearningExamples BERT pretraining phase 1, NGC 21.11", accumulation=True),
    Published("BERT-large TF32 s128", "bert", "bert-large", "baseline", "a100-sxm4-80gb", 64, 128, 317, False,
              "NVIDIA DeepLearningExamples BERT pretraining phase 1, NGC 21.11", tf32=True,
              accumulation=True),
    Published("BERT-large FP16 s512", "bert", "bert-large", "amp-fp16", "a100-sxm4-80gb", 16, 512, 210, False,
              "NVIDIA DeepLearningExamples BERT pretraining phase 2, NGC 21.11", accumulation=True),
    Published("Llama-2 13B bf16 s4096", "gpt", "gpt-13b", "amp-bf16", "a100-sxm4-80gb", 1, 4096, 2162, True,
              "torchtitan docs/performance.md (FSDP, per GPU, no checkpointing)",
              caveat="FSDP over 64 GPUs shards the optimizer step 64 ways; one GPU pays all of it"),
]


def projections(profiles):
    out = []
    for row in ROWS:
        spec = WORKLOADS[row.workload].sizes[row.size]
        if row.seq_len:
            spec = dataclasses.replace(spec, seq_len=row.seq_len)
        cell = Cell(row.workload, row.size, "train", parse_stack(row.stack).name, row.gpu, row.batch, "projected")
        out.append((row, project(cell.resolve(profiles, spec=spec))))
    return out


def throughput(row: Published, trace, profile, efficiency) -> float:
    # BERT pre-training accumulates over many micro-batches (global batch 65,536 / 32,768 in phases
    # 1 / 2), so its optimizer step is a negligible share of the published throughput.
    phases = ("forward", "backward") if row.accumulation else ("forward", "backward", "optimizer")
    time = estimate(trace, profile, efficiency, tf32_matmul=row.tf32, phases=phases)
    samples = row.batch / time.step_s
    return samples * row.seq_len if row.per_token else samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    profiles = load_profiles()
    projected = projections(profiles)
    print(f"efficiency factors: {EFFICIENCY}")
    print(f"{'configuration':26} {'GPU':16} {'published':>10} {'projected':>10} {'error':>8}")
    errors = []
    for row, projection in projected:
        value = throughput(row, projection.trace, profiles[row.gpu], EFFICIENCY)
        error = value / row.value - 1
        if not row.caveat:
            errors.append(error)
        unit = "tok/s" if row.per_token else "samples/s"
        note = f"  (not like for like: {row.caveat})" if row.caveat else ""
        print(f"{row.label:26} {row.gpu:16} {row.value:10,.0f} {value:10,.0f} {error:+8.1%}  {unit}{note}")
    print(f"like-for-like rows: mean |error| {sum(map(abs, errors)) / len(errors):.1%}, "
          f"worst {max(errors, key=abs):+.1%}")
    projected = [(r, p) for r, p in projected if not r.caveat]
    if args.fit:
        grid = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
        best = None
        for matmul, attention, conv, memory in itertools.product(grid, grid, grid, grid):
            factors = {"matmul": matmul, "attention": attention, "conv": conv, "memory": memory}
            loss = sum(abs(math.log(throughput(r, p.trace, profiles[r.gpu], factors) / r.value))
                       for r, p in projected) / len(projected)
            if best is None or loss < best[0]:
                best = (loss, factors)
        print(f"best grid factors {best[1]}: mean |log error| {best[0]:.3f}")


if __name__ == "__main__":
    main()
