"""`compile` in training (suites/techniques/serving.py, suites/step.py): a compiled step learns as the eager
one does, its compile time is recorded apart from its step times, and its projection fuses elementwise ops
while the optimizer step stays eager."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from harness.cell import Cell
from harness.measure import local
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import project, project_outcome
from harness.project.roofline import PHASES, estimate
from suites.step import Step
from tests.smoke_steps import smoke_losses

PROFILES = load_profiles()


def test_a_compiled_training_step_matches_the_eager_one_and_its_compile_time_is_kept_apart():
    losses = {}
    for stack in ("baseline", "compile"):
        losses[stack], step = smoke_losses(stack)
        assert (type(step.model).__name__ == "OptimizedModule") == (stack == "compile")
    # Inductor reorders reductions: the same training, not the same bits.
    torch.testing.assert_close(losses["compile"], losses["baseline"], rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()  # forget the graphs compiled above, or the cell reuses them and compiles nothing
    # Which step call each compilation starts in, and how many calls the warm-up made before the measured
    # steps began: every compilation must fall in the warm-up, none in the measured steps.
    calls, compiled_in, warm_up_calls = [0], [], []
    step_call, probe_for = Step.__call__, local.probe_for

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return step_call(self, *args, **kwargs)

    def marking_probe(device):
        probe = probe_for(device)
        begin = probe.begin_measured_step
        probe.begin_measured_step = lambda: (warm_up_calls.append(calls[0]), begin())
        return probe

    def started(*_):  # torch >= 2.7 passes the compile's CallbackArgs, 2.6 nothing
        compiled_in.append(calls[0])

    callbacks = torch._dynamo.callback.callback_handler
    callbacks.register_start_callback(started)
    try:
        with mock.patch.object(Step, "__call__", counted), mock.patch.object(local, "probe_for", marking_probe):
            cell = Cell("gpt", "smoke", "train", "compile", "cpu", 2).resolve(PROFILES)
            row = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    finally:
        callbacks.remove_start_callback(started)
    assert row.status == "ok" and "warmup_s" in row.notes and row.warmup_s > 0
    assert warm_up_calls == [1] and calls[0] > 10  # one warm-up call, then the measured and timed steps
    assert compiled_in and max(compiled_in) <= warm_up_calls[0], (compiled_in, warm_up_calls)


def test_a_compiled_training_step_projects_fused_elementwise_ops_and_an_eager_optimizer():
    def projected(stack):
        return project(Cell("gpt", "gpt2-124m", "train", stack, "h100-sxm", 8, source="projected").resolve(PROFILES))

    eager, compiled = projected("amp-bf16"), projected("amp-bf16+compile")
    assert compiled.trace.compiled and not eager.trace.compiled
    profile = PROFILES["h100-sxm"]
    optimizer = [estimate(p.trace, profile, phases=("optimizer",)).step_s for p in (eager, compiled)]
    assert optimizer[0] == pytest.approx(optimizer[1])  # torch.compile of the model leaves the step eager
    model = [estimate(p.trace, profile, phases=PHASES[:2]) for p in (eager, compiled)]
    # Fewer kernels (a fused chain is one), no per-op Python dispatch, less traffic (intermediates stay in
    # registers), the same matmuls.
    assert model[1].launch_s < model[0].launch_s and model[1].issue_s < model[0].issue_s / 2
    assert model[1].memory_s < model[0].memory_s and model[1].compute_s == pytest.approx(model[0].compute_s)
    assert model[1].step_s < model[0].step_s
    # Memory is the eager trace's, and the row says so (compile cannot run on fake tensors).
    notes = project_outcome(Cell("gpt", "gpt2-124m", "train", "amp-bf16+compile", "h100-sxm", 8,
                                 source="projected").resolve(PROFILES)).notes
    assert any(n.startswith("memory as the eager step's") and "upper bound" in n for n in notes)


def test_a_fused_chain_reads_its_input_once_and_stores_only_what_a_matmul_needs():
    from harness.project.op_costs import _OpCostMode

    x, weight = torch.randn(64, 64), torch.randn(64, 64)
    size = x.numel() * 4

    def chain(fused: bool) -> dict:
        with _OpCostMode(fused=fused) as costs:
            y = ((x.abs() * 2.0) + 1.0).sin()  # four elementwise ops: one fused kernel
            out = y @ weight
            del y, out
            costs.flush()
        return costs.ops

    eager, fused = chain(False), chain(True)
    memory = [sum(s.bytes * n for s, n in ops.items() if s.op_class == "memory") for ops in (eager, fused)]
    assert memory[0] == 8 * size  # each of the four ops reads and writes a whole tensor
    assert memory[1] == 2 * size  # the chain reads x once and stores y, which the matmul reads
    launches = [sum(s.kernels * n for s, n in ops.items() if s.op_class == "memory" and not s.fused)
                for ops in (eager, fused)]
    assert launches == [4, 1]
