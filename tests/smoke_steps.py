"""A few training steps of gpt smoke under a stack on the CPU, for tests comparing stacks' losses."""

from __future__ import annotations

import torch

from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run, parse_stack
from suites.workloads.gpt import WORKLOAD


def smoke_losses(stack: str, steps: int = 3, batch_size: int = 2) -> tuple[list[float], Step]:
    """The losses of `steps` steps on one fixed batch from seed 0's initialisation, and the step."""
    spec = WORKLOAD.size("smoke")
    torch.manual_seed(0)
    run = Run(workload=WORKLOAD, size=spec, mode="train", profile=load_profiles()["cpu"], model=WORKLOAD.build(spec),
              batch_size=batch_size)
    parse_stack(stack).apply(run)
    step = Step(run, torch.device("cpu"))
    batch = WORKLOAD.batch(spec, batch_size, torch.Generator().manual_seed(0))
    return [float(step(batch)) for _ in range(steps)], step
