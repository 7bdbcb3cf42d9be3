"""Every workload x every technique and recipe at smoke size: it runs a real step, or it is
unsupported with a specific reason (never an unexplained crash)."""

from __future__ import annotations

import pytest
import torch

from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run, Unsupported, parse_stack, stack_names
from suites.workloads import WORKLOADS

CPU = load_profiles()["cpu"]
MATRIX = [(w, s) for w in WORKLOADS for s in stack_names()]


@pytest.mark.parametrize("workload_name, stack_name", MATRIX)
def test_every_pair_runs_or_says_why_not(workload_name, stack_name):
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    stack = parse_stack(stack_name)
    reasons = {}
    for mode in ("train", "infer"):
        reason = stack.check(CPU, workload, mode)
        if reason:
            reasons[mode] = reason
            continue
        torch.manual_seed(0)
        run = Run(workload=workload, size=spec, mode=mode, profile=CPU, model=workload.build(spec),
                  batch_size=spec.batch_size)
        try:
            stack.apply(run)
        except Unsupported as exc:
            reasons[mode] = str(exc)
            continue
        out = Step(run, torch.device("cpu"))(workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(0)))
        assert torch.isfinite(out.float()).all(), f"{stack_name} {mode}: non-finite output"
    for mode, reason in reasons.items():
        # A reason names something specific: more than a word, and not an exception's repr.
        assert len(reason) > 20 and "Traceback" not in reason, f"{mode}: {reason!r}"
