"""CUDA's fused RMSNorm lent to CPU traces: same values and gradients, CUDA's saved tensors, restored on exit,
and in a GPU projection of a Llama-family model."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import harness.project.trace as trace_module
from harness.profiles import load_profiles
from harness.project.fused_norms import _has_fused_cuda_kernel, cuda_fused_rms_norm
from suites.techniques import Run, parse_stack
from suites.workloads import WORKLOADS

pytestmark = pytest.mark.skipif(not _has_fused_cuda_kernel(),
                                reason="this torch has no _fused_rms_norm op to imitate (before 2.8)")


def _rms_norm(dtype):
    """Output, input gradient and weight gradient of F.rms_norm, and the bytes autograd saved for it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(16, generator=generator).to(dtype).requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes() if tensor.data_ptr() != x.data_ptr() else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = F.rms_norm(x, (16,), weight, 1e-5)
    (out.float() * torch.arange(16.0)).sum().backward()
    return out, x.grad, weight.grad, sum(saved), out.grad_fn.name()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_the_lent_kernel_computes_what_the_composite_does(dtype, tolerance):
    composite = _rms_norm(dtype)
    with cuda_fused_rms_norm():
        fused = _rms_norm(dtype)
    for mine, reference in zip(fused[:3], composite[:3], strict=True):
        assert mine.dtype == reference.dtype
        torch.testing.assert_close(mine.float(), reference.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape,dtype", [((16,), torch.float32), ((3, 16), torch.float64)], ids=["1d", "fp64"])
def test_the_lent_kernel_handles_a_single_row_and_double_precision(shape, dtype):
    def run():
        x = torch.arange(1.0, 1.0 + math.prod(shape), dtype=dtype).reshape(shape).requires_grad_()
        weight = torch.linspace(0.5, 1.5, 16, dtype=dtype).requires_grad_()
        out = F.rms_norm(x, (16,), weight)  # eps None: the machine epsilon of the accumulation type
        (out * torch.arange(16.0, dtype=dtype)).sum().backward()
        return out, x.grad, weight.grad

    composite = run()
    with cuda_fused_rms_norm():
        fused = run()
    for mine, reference in zip(fused, composite, strict=True):
        assert mine.dtype == reference.dtype == dtype
        torch.testing.assert_close(mine, reference)


def test_autograd_keeps_what_cuda_keeps_and_the_composite_comes_back_on_exit():
    before = _rms_norm(torch.float32)
    with cuda_fused_rms_norm():
        with cuda_fused_rms_norm():  # re-entrant
            pass
        fused = _rms_norm(torch.float32)
    after = _rms_norm(torch.float32)
    assert fused[4] == "FusedRmsNormBackward0"
    assert before[4] == after[4] != "FusedRmsNormBackward0"
    # CUDA's backward reads the input (not counted here), the weight and one fp32 rstd per row (15 rows);
    # the composite also keeps the normalised input at full size.
    assert fused[3] == 16 * 4 + 15 * 4
    assert before[3] >= fused[3] + 3 * 5 * 16 * 4


def test_a_gpu_projection_of_a_llama_block_saves_one_full_size_tensor_less_per_norm(monkeypatch):
    workload = WORKLOADS["gpt"]
    smoke = workload.sizes["smoke"]
    spec = dataclasses.replace(smoke, name="llama-smoke", config={**smoke.config, "family": "llama"})
    profile = load_profiles()["h100-sxm"]
    batch_size = 4

    def trace():
        def run():
            return Run(workload=workload, size=spec, mode="train", profile=profile, model=workload.build(spec),
                       batch_size=batch_size)

        def batch():
            return workload.batch(spec, batch_size, torch.Generator().manual_seed(0))

        return trace_module.trace_step(run, parse_stack("baseline"), profile, batch)

    fused = trace()
    monkeypatch.setattr(trace_module, "cuda_fused_rms_norm", contextlib.nullcontext)
    composite = trace()
    norms = 2 * spec.config["n_layer"] + 1
    full_size = batch_size * spec.seq_len * spec.config["n_embd"] * 4
    assert composite.activations_bytes - fused.activations_bytes == pytest.approx(norms * full_size, rel=0.05)
    # One fused kernel per norm and direction instead of the composite's pieces.
    assert sum(fused.ops.values()) < sum(composite.ops.values()) - norms
