"""RMSNorm as a GPU runs it, in a trace that runs on the CPU device.

On CUDA (and ROCm, which builds the same kernels), `F.rms_norm` calls one fused kernel,
`aten::_fused_rms_norm`, whose backward keeps only the input and the per-row reciprocal RMS (`rstd`).
The CPU has no such kernel: the op decomposes into pow, mean, add, rsqrt and two muls, and autograd
keeps their intermediates, among them a full-size fp32 copy of the normalised input. A Llama-2 13B
step at 2 x 4,096 tokens would so carry about 13 GB (80 norms x 168 MB) of activations the GPU never holds.
Inside `cuda_fused_rms_norm()` the CPU gets the fused op and its backward, so autograd records
`FusedRmsNormBackward0` and keeps what CUDA keeps.

Why by hand: PyTorch registers `_fused_rms_norm` for CUDA and MPS only (its CPU path is the
composite), and no API lends a device's kernel to another. The kernels below compute the same
function in the same dtypes (output in the input's dtype, `rstd` in the accumulation type: fp32 for 16-bit
inputs); a test checks their values and gradients against the composite.
"""

from __future__ import annotations

import contextlib

import torch

from harness.project.scoped_kernels import ScopedKernels


def _has_fused_cuda_kernel() -> bool:
    """Whether this torch release fuses RMSNorm on CUDA (the op arrived in torch 2.8). The op's existence is
    asked, not this build's CUDA kernel: a CPU-only wheel of the same release projects for the same GPUs."""
    return hasattr(torch.ops.aten, "_fused_rms_norm")


def _normalised_dims(normalized_shape) -> tuple[int, ...]:
    return tuple(range(-len(normalized_shape), 0))


def _compute_dtype(input) -> torch.dtype:
    """The kernel's accumulation type: fp32 for 16-bit inputs, the input's own for fp32 and fp64."""
    return torch.promote_types(input.dtype, torch.float32)


def _forward(input, normalized_shape, weight=None, eps=None):
    """(output, rstd) as the CUDA kernel returns them: reduce in the accumulation type (and, without eps, its
    machine epsilon), output in the input's dtype."""
    wide = input.to(_compute_dtype(input))
    eps = torch.finfo(wide.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(wide.pow(2).mean(_normalised_dims(normalized_shape), keepdim=True) + eps)
    output = wide * rstd
    if weight is not None:
        output = output * weight.to(wide.dtype)
    return output.to(input.dtype), rstd


def _backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """Gradients of input and weight from the input and `rstd` alone (what the fused backward reads)."""
    dims, wide = _normalised_dims(normalized_shape), _compute_dtype(input)
    normalised = input.to(wide) * rstd
    grad = grad_out.to(wide) * weight.to(wide) if weight is not None else grad_out.to(wide)
    grad_input = rstd * (grad - normalised * (grad * normalised).mean(dims, keepdim=True))
    grad_weight = None
    if weight is not None and output_mask[1]:
        batch_dims = tuple(range(input.dim() - len(normalized_shape)))
        per_row = grad_out.to(wide) * normalised
        grad_weight = (per_row.sum(batch_dims) if batch_dims else per_row).to(weight.dtype)
    return (grad_input.to(input.dtype) if output_mask[0] else None), grad_weight


_scope = ScopedKernels(lambda: (("_fused_rms_norm", _forward, "CPU"), ("_fused_rms_norm_backward", _backward, "CPU")))


def cuda_fused_rms_norm():
    """Within this context, RMSNorm on CPU tensors runs as CUDA's fused kernel (see the module docstring);
    outside, the CPU's composite again. Re-entrant and process-wide (scoped_kernels.py). Before torch 2.8
    (no such op) nothing changes."""
    return _scope() if _has_fused_cuda_kernel() else contextlib.nullcontext()


def lent() -> bool:
    """Whether RMSNorm runs as CUDA's fused kernel right now (inside `cuda_fused_rms_norm`)."""
    return _scope.active
