"""Optimizer implementations as techniques (suites/techniques/optimizers.py): what they change in the
optimizer step's memory and kernels, measured and projected."""

from __future__ import annotations

import pytest
import torch

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.measure.tensors import optimizer_state_bytes
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import project
from tests.smoke_steps import smoke_losses

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
    losses = {}
    for technique in ("baseline", "optim-fused"):
        losses[technique], step = smoke_losses(technique)
        assert bool(step.optimizer.defaults["fused"]) == (technique == "optim-fused")
    torch.testing.assert_close(losses["optim-fused"], losses["baseline"], rtol=1e-4, atol=1e-4)
    cell = Cell("gpt", "smoke", "train", "optim-fused", "cpu", 2).resolve(PROFILES)
    row = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    assert row.status == "ok" and row.optimizer_bytes > 0


def test_optim_fused_is_a_training_technique():
    cell = Cell("gpt", "smoke", "infer", "optim-fused", "h100-sxm", 2).resolve(PROFILES)
    assert "only affects training" in cell.unsupported


@pytest.mark.parametrize("bits, moment_bytes, block", [(8, 1.0, 256), (4, 0.5, 128)])
def test_low_bit_adam_keeps_its_moments_in_the_bytes_stated_and_learns(bits, moment_bytes, block):
    from suites.techniques.optimizers import low_bit_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256, bias=False))
    optimizer = low_bit_adamw(bits)(model.parameters())
    optimizer.param_groups[0]["lr"].fill_(1e-3)  # torchao keeps lr as a tensor
    x = torch.randn(64, 256)
    target = torch.randn(64, 256)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    n = sum(p.numel() for p in model.parameters())
    # Two moments of `moment_bytes` per parameter, each block of `block` values with one fp32 scale,
    # against fp32 AdamW's 8 bytes per parameter; each moment tensor also carries its code map (2^bits
    # fp32 values), and each parameter a step counter.
    moments = 2 * len(optimizer.state)
    expected = 2 * n * moment_bytes + 2 * (n // block) * 4 + moments * 4 * 2**bits + 4 * len(optimizer.state)
    assert optimizer_state_bytes(optimizer) == expected


def test_low_bit_optimizers_are_projected_with_their_compiled_step():
    fp32, eight, four = (_projected(t) for t in ("baseline", "optim-8bit", "optim-4bit"))
    # Per parameter, fp32 AdamW keeps 8 bytes; 8-bit 2 bytes + two fp32 scales per 256; 4-bit 1 byte + two
    # per 128 (biases and norms, under 4,096 values, stay fp32: a fraction of a percent of gpt2's weights).
    assert eight.memory.optimizer == pytest.approx(fp32.memory.optimizer * (2 + 8 / 256) / 8, rel=0.01)
    assert four.memory.optimizer == pytest.approx(fp32.memory.optimizer * (1 + 8 / 128) / 8, rel=0.01)
    # Costed as torchao's compiled step: one kernel per parameter that reads the parameter, its gradient
    # and its moments and writes the parameter and moments back, not the eager trace's dozens of ops.
    shapes = {s: n for s, n in eight.trace.ops.items() if s.phase == "optimizer"}
    assert all(s.kernels == 1 and s.op_class == "memory" for s in shapes)
    moved = sum(s.bytes * n for s, n in shapes.items())
    trace = eight.trace
    assert moved == pytest.approx(2 * trace.params_bytes + trace.grads_bytes + 2 * trace.optimizer_bytes, rel=0.01)


def test_a_wrapped_optimizers_state_is_found_where_zero_keeps_it():
    from types import SimpleNamespace

    from harness.measure.local import _optimizer_state_started

    weight = torch.nn.Parameter(torch.ones(4))
    inner = torch.optim.AdamW([weight])
    wrapper = SimpleNamespace(state={}, optim=inner)  # ZeroRedundancyOptimizer's own `state` stays empty
    assert not _optimizer_state_started(wrapper)
    weight.grad = torch.ones(4)
    inner.step()
    assert _optimizer_state_started(wrapper) and _optimizer_state_started(None)
