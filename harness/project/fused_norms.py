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
function in the same dtypes (output in the input's dtype, `rstd` in fp32); a test checks their values
and gradients against the composite.
"""

from __future__ import annotations

import contextlib

import torch

from harness.project.scoped_kernels import ScopedKernels


def _has_fused_cuda_kernel() -> bool:
    """Whether this torch's CUDA build would fuse RMSNorm (the kernel arrived in torch 2.8)."""
    return hasattr(torch.ops.aten, "_fused_rms_norm") and torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_fused_rms_norm", "CUDA")


def _normalised_dims(normalized_shape) -> tuple[int, ...]:
    return tuple(range(-len(normalized_shape), 0))


def _forward(input, normalized_shape, weight=None, eps=None):
    """(output, rstd) as the CUDA kernel returns them: reduce in fp32, output in the input's dtype."""
    # No eps: the machine epsilon of the type it computes in (fp32 for 16-bit inputs), as the kernel takes it.
    eps = torch.finfo(torch.promote_types(input.dtype, torch.float32)).eps if eps is None else eps
    wide = input.float()
    rstd = torch.rsqrt(wide.pow(2).mean(_normalised_dims(normalized_shape), keepdim=True) + eps)
    output = wide * rstd
    if weight is not None:
        output = output * weight.float()
    return output.to(input.dtype), rstd


def _backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """Gradients of input and weight from the input and `rstd` alone (what the fused backward reads)."""
    dims = _normalised_dims(normalized_shape)
    normalised = input.float() * rstd
    grad = grad_out.float() * weight.float() if weight is not None else grad_out.float()
    grad_input = rstd * (grad - normalised * (grad * normalised).mean(dims, keepdim=True))
    grad_weight = None
    if weight is not None and output_mask[1]:
        batch_dims = tuple(range(input.dim() - len(normalized_shape)))
        grad_weight = (grad_out.float() * normalised).sum(batch_dims).to(weight.dtype)
    return (grad_input.to(input.dtype) if output_mask[0] else None), grad_weight


_scope = ScopedKernels(lambda: (("_fused_rms_norm", _forward, "CPU"), ("_fused_rms_norm_backward", _backward, "CPU")))


def cuda_fused_rms_norm():
    """Within this context, RMSNorm on CPU tensors runs as CUDA's fused kernel (see the module docstring);
    outside, the CPU's composite again. Re-entrant and process-wide (scoped_kernels.py). Where this torch has
    no CUDA kernel to imitate, nothing changes."""
    return _scope() if _has_fused_cuda_kernel() else contextlib.nullcontext()
