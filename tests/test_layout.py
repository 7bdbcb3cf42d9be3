"""Channels-last (suites/techniques/layout.py): the technique restrides convolution weights and image
batches, the trace records which convolution operands a channels-innermost kernel must transpose, and the
speed model costs those transposes where cuDNN's tensor cores or oneDNN make them, nowhere else."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import traced
from harness.project.op_costs import _OpCostMode
from harness.project.roofline import _CLASS_INDEX, layout_transposes_s, op_arrays, step_time
from harness.project.speed_constants import constants_for
from suites.step import Step
from suites.techniques import Run, parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()


def _trace(technique: str, gpu: str = "a100-sxm4-80gb"):
    spec = WORKLOADS["resnet50"].sizes["smoke"]
    cell = Cell("resnet50", spec.name, "train", parse_stack(technique).name, gpu, 2, "projected")
    return traced(cell.resolve(PROFILES, spec=spec))


def test_channels_last_is_for_convolutional_workloads_only():
    stack = parse_stack("channels-last")
    reason = stack.check(PROFILES["a100-sxm4-80gb"], WORKLOADS["gpt"], "train")
    assert reason and "convolutions" in reason
    assert stack.check(PROFILES["a100-sxm4-80gb"], WORKLOADS["resnet50"], "train") is None


def test_a_step_runs_convolutions_on_channels_last_weights_and_images():
    workload = WORKLOADS["resnet50"]
    spec = workload.sizes["smoke"]
    model = workload.build(spec)
    run = Run(workload=workload, size=spec, mode="train", profile=PROFILES["cpu"], model=model, batch_size=2)
    parse_stack("channels-last").apply(run)
    seen = []
    conv = next(m for m in run.model.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous(
        memory_format=torch.channels_last)))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    Step(run, torch.device("cpu"))(workload.batch(spec, 2, torch.Generator().manual_seed(0)))
    assert seen == [True]


@pytest.mark.parametrize("layout, kernel, transposed", [
    (torch.contiguous_format, 3, ("input", "weight", "output")),
    (torch.contiguous_format, 1, ("input", "output")),  # a 1x1 filter is the same in both layouts
    (torch.channels_last, 3, ()),
])
def test_the_trace_records_the_operands_an_nchw_convolution_transposes(layout, kernel, transposed):
    image = torch.randn(2, 8, 16, 16).contiguous(memory_format=layout)
    weight = torch.randn(16, 8, kernel, kernel).contiguous(memory_format=layout)
    with _OpCostMode() as costs:
        output = torch.nn.functional.conv2d(image, weight, padding=kernel // 2)
    (shape,) = [s for s in costs.ops if s.op_class == "conv"]
    sizes = {"input": image.nbytes, "weight": weight.nbytes, "output": output.nbytes}
    assert shape.nchw_tensors == len(transposed)
    assert shape.nchw_bytes == sum(sizes[name] for name in transposed)


def test_a_channels_last_stack_traces_no_transposes_and_the_same_flops():
    nchw = {s: n for s, n in _trace("amp-fp16").ops.items() if s.op_class == "conv"}
    channels_last = {s: n for s, n in _trace("amp-fp16+channels-last").ops.items() if s.op_class == "conv"}
    assert any(s.nchw_bytes for s in nchw)
    assert all(s.nchw_bytes == 0 and s.nchw_tensors == 0 for s in channels_last)
    assert sum(s.flops * n for s, n in nchw.items()) == sum(s.flops * n for s, n in channels_last.items())


def _costing(gpu: str):
    """The profile's per-device view, its speed constants and the bandwidth the model derates them to."""
    profile = PROFILES[gpu].per_device()
    constants = constants_for(profile)
    return profile, constants, profile.memory_bandwidth_bytes_s * constants.gpu.bandwidth_efficiency


def _transposes(gpu: str, technique: str = "amp-fp16", compiled: bool = False) -> tuple[float, object]:
    profile, constants, bandwidth = _costing(gpu)
    ops = dataclasses.replace(op_arrays(_trace(technique, gpu), profile), compiled=compiled)
    return float((layout_transposes_s(ops, bandwidth, constants.gpu.kernel_s) * ops.count).sum()), ops


def test_nchw_tensor_core_convolutions_pay_a_read_and_a_write_of_each_operand_and_a_kernel_each():
    seconds, ops = _transposes("a100-sxm4-80gb")
    profile, constants, bandwidth = _costing("a100-sxm4-80gb")
    convs = ops.op_class == _CLASS_INDEX["conv"]
    expected = ((2 * ops.nchw_bytes / bandwidth + ops.nchw_tensors * constants.gpu.kernel_s) * ops.count)[convs].sum()
    assert seconds == pytest.approx(expected) and seconds > 0
    # On the GPU's side (no host issue cost, which decides so small a step), channels-last is faster though
    # its step has the batch's layout copy more.
    gpu_only = dataclasses.replace(constants, host=dataclasses.replace(
        constants.host, issue_python_s=0.0, issue_engine_s=0.0, issue_inference_s=0.0, issue_conv_s=0.0))
    slow = step_time(ops, gpu_only).step_s
    fast = step_time(op_arrays(_trace("amp-fp16+channels-last"), profile), gpu_only).step_s
    assert slow > fast


@pytest.mark.parametrize("gpu, technique, compiled, why", [
    ("v100-sxm2-32gb", "baseline", False, "fp32 convolutions on CUDA cores: cuDNN has NCHW kernels"),
    ("mi300x", "amp-fp16", False, "MIOpen's native layout is NCHW"),
    ("a100-sxm4-80gb", "amp-fp16", True, "Inductor lays convolutions out channels-last"),
])
def test_no_transposes_where_the_kernels_take_nchw_or_the_compiler_removes_them(gpu, technique, compiled, why):
    seconds, ops = _transposes(gpu, technique, compiled)
    assert np.any(ops.nchw_bytes > 0), "the trace does see NCHW convolutions"
    assert seconds == 0.0, why


def test_fp32_convolutions_on_tf32_tensor_cores_are_transposed():
    seconds, _ = _transposes("a100-sxm4-80gb", "baseline")  # cuDNN's TF32 is on by default
    assert seconds > 0
