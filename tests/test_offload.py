"""Optimizer offload (suites/techniques/offload.py): the host's bytes and traffic, what stays on the device,
and its projection (memory off the device, transfers over the host link, the host's AdamW)."""

from __future__ import annotations

import pytest
import torch

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import detect_local, load_profiles
from harness.project import project, project_outcome
from harness.project.roofline import HOST_ADAMW_BYTES_S, PHASES, estimate, host_link_bytes_s
from suites.techniques.offload import MINIMAL_SIZE, HostAdamWModel, host_traffic

PROFILES = load_profiles()


def test_the_host_holds_four_copies_of_each_offloaded_parameter_and_moves_two():
    params = [torch.zeros(1000, 100), torch.zeros(10, dtype=torch.bfloat16)]
    traffic = host_traffic(params)
    size = 1000 * 100 * 4 + 10 * 2
    # A pinned parameter copy and gradient each (the pinned allocator rounds 400,000 bytes up to 2^19 and 20
    # to 32) and two moments resident; gradients out and parameters back each step; the host AdamW reads
    # parameter, gradient and moments and writes parameter and moments.
    pinned = 2 * (2**19 + 32)
    assert (traffic.host_bytes, traffic.to_host, traffic.to_device, traffic.host_step) == (pinned + 2 * size, size,
                                                                                             size, 7 * size)


def test_the_trace_model_keeps_only_small_parameters_state_on_the_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        big, small = torch.nn.Parameter(torch.randn(MINIMAL_SIZE)), torch.nn.Parameter(torch.randn(MINIMAL_SIZE - 1))
        optimizer = HostAdamWModel([big, small])
        (big.sum() + small.sum()).backward()
        optimizer.step()
        assert set(optimizer.state) == {small} and optimizer.traffic.host_bytes == 4 * 4 * MINIMAL_SIZE  # 2^14
        optimizer.zero_grad()
        assert big.grad is None and small.grad is None


def test_offload_fits_a_fine_tune_that_does_not_fit_and_says_what_it_assumes():
    def projected(stack):
        return project_outcome(Cell("gpt", "gpt2-1.3b", "train", stack, "l4", 1, source="projected")
                               .resolve(PROFILES))

    plain, offloaded = projected("amp-bf16+checkpointing"), projected("amp-bf16+checkpointing+optim-offload")
    assert plain.status == "oom" and offloaded.status == "ok"
    params = offloaded.memory.params
    # fp32 parameters: pinned copies of parameters and gradients (rounded up to powers of two) and moments
    assert 4 * params < offloaded.memory.host < 6 * params
    assert offloaded.memory.optimizer < params / 1000  # biases and norms only
    assert plain.memory.peak_allocated - offloaded.memory.peak_allocated > 0.9 * 2 * params
    assert "assumed 84 GB/s (not measured)" in "; ".join(offloaded.notes)


def test_offload_adds_the_host_step_or_the_return_trip_to_the_step_time():
    cell = Cell("gpt", "gpt2-124m", "train", "amp-bf16+optim-offload", "h100-sxm", 8,
                source="projected").resolve(PROFILES)
    moved = project(cell)
    host, profile = moved.trace.host, cell.profile.per_device()
    link = host_link_bytes_s(profile)
    assert link == pytest.approx(128e9 / 2 * 0.8)  # PCIe Gen5 x16: 128 GB/s both ways
    backward = estimate(moved.trace, profile, phases=("backward",)).step_s
    model = estimate(moved.trace, profile, phases=PHASES[:2]).step_s
    # Gradients leave during the backward (only what outlasts it shows), then the host's AdamW and the
    # parameters' return pipeline per parameter; the device steps only the small parameters.
    extra = max(0.0, host.to_host / link - backward) + max(host.host_step / HOST_ADAMW_BYTES_S, host.to_device / link)
    assert extra > 0
    assert 0 <= moved.time.step_s - model - extra < 0.05 * extra


def test_offload_is_for_gpus():
    cell = Cell("gpt", "smoke", "train", "optim-offload", "cpu", 2).resolve(PROFILES)
    assert "on a CPU it is already there" in cell.unsupported


@pytest.mark.gpu
def test_an_offloaded_step_keeps_adams_state_in_host_memory():
    local = detect_local(load_profiles(None))
    rows = {}
    for stack in ("baseline", "optim-offload"):
        cell = Cell("gpt", "smoke", "train", stack, local.id, 2).resolve(load_profiles(None))
        rows[stack] = to_record(cell, measure(cell, MeasureSettings(warmup=2, steps=10, repeats=1)), "t")
    offloaded = rows["optim-offload"]
    assert offloaded.status == "ok", offloaded.reason
    assert offloaded.optimizer_bytes < rows["baseline"].optimizer_bytes / 10
    assert offloaded.host_bytes > 2 * rows["baseline"].optimizer_bytes * 0.9


def test_offload_refuses_loss_scaling_and_several_ranks():
    from suites.techniques import Run, Unsupported, parse_stack
    from suites.workloads import get_workload

    workload = get_workload("gpt")
    spec = workload.size("smoke")

    def run() -> Run:
        return Run(workload=workload, size=spec, mode="train", profile=PROFILES["h100-sxm"],
                   model=workload.build(spec), batch_size=2)

    with pytest.raises(Unsupported, match="loss scaling"):
        parse_stack("amp-fp16+optim-offload").apply(run())
    ranked = run()
    ranked.data_parallel = 2  # as data-parallel and the sharded stacks leave it, before the step phase
    with pytest.raises(Unsupported, match="single-GPU"):
        parse_stack("optim-offload").apply(ranked)


def test_state_is_split_between_host_and_device_memory():
    from harness.measure.tensors import storage_bytes

    host = [torch.zeros(10), torch.zeros(5, dtype=torch.float16)]
    assert storage_bytes(host) == storage_bytes(host, "host") == 50
    assert storage_bytes(host, "device") == 0  # nothing of it on an accelerator
