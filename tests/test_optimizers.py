"""Optimizer implementations as techniques (suites/techniques/optimizers.py): what they change in the
optimizer step's memory and kernels, measured and projected."""

from __future__ import annotations

import pytest
import torch

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import project
from suites.step import Step
from suites.techniques import Run, parse_stack
from suites.workloads.gpt import WORKLOAD

PROFILES = load_profiles()


def _projected(technique: str):
    return project(Cell("gpt", "gpt2-124m", "train", technique, "h100-sxm", 1, source="projected").resolve(PROFILES))


def test_fused_adamw_drops_the_foreach_steps_parameter_sized_temporary():
    foreach, fused = _projected("baseline"), _projected("optim-fused")
    params = foreach.trace.params_bytes
    saved = foreach.trace.phase_peaks["optimizer"] - fused.trace.phase_peaks["optimizer"]
    assert saved == pytest.approx(params, rel=0.01)  # the sqrt(exp_avg_sq) temporary of every parameter
    assert fused.memory.optimizer == foreach.memory.optimizer  # the same two moments per parameter

    def kernels(projection) -> int:
        return sum(s.kernels * n for s, n in projection.trace.ops.items() if s.phase == "optimizer")

    assert kernels(fused) < kernels(foreach) / 3


def test_a_fused_step_is_measured_and_learns_as_the_foreach_one_does():
    spec = WORKLOAD.size("smoke")
    losses = {}
    for technique in ("baseline", "optim-fused"):
        torch.manual_seed(0)
        run = Run(workload=WORKLOAD, size=spec, mode="train", profile=PROFILES["cpu"], model=WORKLOAD.build(spec),
                  batch_size=2)
        parse_stack(technique).apply(run)
        step = Step(run, torch.device("cpu"))
        batch = WORKLOAD.batch(spec, 2, torch.Generator().manual_seed(0))
        losses[technique] = [float(step(batch)) for _ in range(3)]
        assert bool(step.optimizer.defaults["fused"]) == (technique == "optim-fused")
    torch.testing.assert_close(losses["optim-fused"], losses["baseline"], rtol=1e-4, atol=1e-4)
    cell = Cell("gpt", "smoke", "train", "optim-fused", "cpu", 2).resolve(PROFILES)
    row = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    assert row.status == "ok" and row.optimizer_bytes > 0


def test_optim_fused_is_a_training_technique():
    cell = Cell("gpt", "smoke", "infer", "optim-fused", "h100-sxm", 2).resolve(PROFILES)
    assert "only affects training" in cell.unsupported
