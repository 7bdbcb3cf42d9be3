"""CUDA's autocast op lists, applied to a trace that runs on the CPU device.

`torch.autocast` casts per op from a per-device list: on CUDA, softmax, layer_norm, sum, exp and
the losses run in fp32 even when their input is bf16/fp16, while the CPU runs most of them in the
input's dtype (and has its own fp32 list: cross_entropy_loss, linalg, fft...). The projection traces
on fake CPU tensors, so inside `cuda_autocast_policy()` the CPU's autocast kernels are re-registered
(`torch.library`, dispatch key AutocastCPU) with CUDA's policy; leaving the context restores them.

Why by hand: PyTorch keeps the CUDA lists in C++ (`aten/src/ATen/autocast_mode.h`,
AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE / AT_FORALL_PROMOTE / AT_FORALL_LOWER_PRECISION_FP)
and its CUDA kernels only cast CUDA tensors, so no API applies them to CPU tensors. The lists below
are copied from that header as of torch 2.14; each entry is applied only where the running torch
registers a CUDA autocast kernel for the op (`rms_norm` joined in 2.12), and a test checks every op
this torch's CUDA autocast covers against a fake-CUDA-tensor oracle. ROCm uses the CUDA lists.
The registration is process-wide: while the context is open every thread's CPU autocast follows it.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves, tree_map

from harness.project.scoped_kernels import ScopedKernels

# CUDA fp32 policy: floating inputs are cast to fp32, whatever autocast's dtype.
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa", "rms_norm", "linalg_matrix_sqrth",
)
# Ops that only some releases have at all: linalg_matrix_sqrth is on 2.14's list and absent from 2.11;
# the named-tensor overloads are on 2.11's lists and gone from 2.14.
NOT_IN_2_11 = ("linalg_matrix_sqrth",)
NOT_IN_2_14 = ("prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname", "cumsum.dimname",
               "sum.dim_DimnameList", "norm.names_ScalarOpt_dim", "norm.names_ScalarOpt_dim_dtype")
# CUDA fp32_append_dtype policy: norm is called with dtype=fp32 (its dtype overload) instead.
CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                          "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
# Refused under CUDA autocast (unsafe in 16 bits; use binary_cross_entropy_with_logits).
CUDA_BANNED = ("binary_cross_entropy",)
# Cast down on both devices' lists already (the CPU's lower_precision_fp entries that CUDA shares).
SHARED_LOWER_PRECISION = ("conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
                          "linear", "_convolution.deprecated", "matmul", "conv_tbc", "conv_transpose1d",
                          "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "scaled_dot_product_attention")
# On CUDA's lists, and no remapping needed: the CPU reaches the same dtypes through the ops they call
# (conv2d, bmm/mm, scaled_dot_product_attention are cast on both), or they are CUDA-only kernels.
SAME_AS_CPU = ("_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn",
               "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
               "chain_matmul", "einsum", "linalg_multi_dot")
# CUDA fp32_set_opt_dtype policy: the op's optional `dtype` is set to fp32 (its input is not copied
# first) unless the caller set it.
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    # Named-tensor overloads: on the lists of torch 2.11 (the lent GPU machine's), gone by 2.14.
    "prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname", "cumsum.dimname",
    "sum.dim_DimnameList",
)
# CUDA promote policy: inputs are cast to the widest floating dtype among them.
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add")
# CUDA lower-precision ops the CPU list lacks and that do not decompose into ones it has (einsum,
# chain_matmul and linalg_multi_dot reach bmm/mm, which the CPU casts). Their casts are not cached as
# CUDA caches weight casts; none of the suite's workloads calls them.
CUDA_LOWER_PRECISION_EXTRA = ("addmv", "addr", "mv", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
# On the CPU's autocast lists (aten/src/ATen/autocast_mode.cpp, AutocastCPU) but not on CUDA's: on CUDA
# they run in their inputs' dtype (composite ones, such as cross_entropy_loss, decompose into ops that
# are on CUDA's lists). CPU entries that CUDA lists too are overridden above with CUDA's policy.
CPU_ONLY = (
    "avg_pool3d", "polar", "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft",
    "stft.center", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex",
    "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
    "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "cross_entropy_loss", "ctc_loss.IntList",
    "ctc_loss.Tensor", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft",
    "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond",
    "linalg_cond.p_str", "linalg_matrix_rank", "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals",
    "linalg_eigvalsh", "linalg_inv", "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "svd", "triangular_solve",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward",
    "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
    "stack", "cat", "index_copy",
)

_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU


def _eligible(value) -> bool:
    # As autocast's is_eligible: a defined floating tensor that is not float64.
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _redispatch(op, args, kwargs):
    # What the C++ wrappers do: run the op below the autocast key, so it is not cast again.
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_CPU)):
        return op(*args, **kwargs)


def _cast_kernel(op, target):
    def kernel(*args, **kwargs):
        dtype = target() if callable(target) else target
        args, kwargs = tree_map(lambda v: v.to(dtype) if _eligible(v) and v.dtype != dtype else v, (args, kwargs))
        return _redispatch(op, args, kwargs)
    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        dtypes = [v.dtype for v in tree_leaves((args, kwargs)) if _eligible(v)]
        if not dtypes:
            return _redispatch(op, args, kwargs)
        return _cast_kernel(op, functools.reduce(torch.promote_types, dtypes))(*args, **kwargs)
    return kernel


# CUDA's softmax and log_softmax read fp16 input and write fp32 in one kernel (`half_to_float`),
# without the fp32 copy of the input that the generic `dtype=` path makes (aten SoftMax.cpp).
_HALF_TO_FLOAT = {"softmax": torch.ops.aten._softmax.default, "log_softmax": torch.ops.aten._log_softmax.default}


def _set_opt_dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    position = names.index("dtype")
    # Only the int-dim overloads: the named-tensor ones take a Dimname the fused kernel does not.
    half_to_float = (_HALF_TO_FLOAT.get(op._schema.name.removeprefix("aten::"))
                     if op._schema.overload_name == "int" else None)

    def kernel(*args, **kwargs):
        explicit = kwargs.get("dtype") if len(args) <= position else args[position]
        if explicit is not None or not (args and _eligible(args[0])):
            return _redispatch(op, args, kwargs)
        if half_to_float is not None and args[0].dtype == torch.float16 and isinstance(args[0], FakeTensor):
            # (Fake tensors only: the CPU kernels refuse half_to_float, which real CPU tensors would reach.)
            return _redispatch(half_to_float, (args[0], args[1], True), {})
        return _redispatch(op, args[:position], {**kwargs, "dtype": torch.float32})
    return kernel


def _append_dtype_kernel(target):
    def kernel(*args, **kwargs):
        if not (args and _eligible(args[0])):
            return _redispatch(target, args, kwargs)  # same signature plus dtype: defaults apply
        return _redispatch(target, args, {**kwargs, "dtype": torch.float32})
    return kernel


def _banned_kernel(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"torch.nn.functional.{name} is unsafe to autocast (CUDA autocast refuses it): use "
                           f"{name}_with_logits, which is safe to autocast")
    return kernel


def _op(name: str):
    """The aten overload `name` ("pow.Scalar"; no dot: the default overload), None if this torch lacks it."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)


def on_cuda_list(name: str) -> bool:
    """Whether this torch's CUDA autocast has a kernel for the op (is on one of its lists)."""
    qualified = "aten::" + name.removesuffix(".default")
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCUDA")


def _kernels():
    """(op name, AutocastCPU kernel) for every op whose CUDA policy differs from the CPU's, as far as
    this torch has the op and (for CUDA entries) lists it."""
    makers = (
        (CUDA_FP32, lambda op, name: _cast_kernel(op, torch.float32)),
        (CUDA_FP32_SET_OPT_DTYPE, lambda op, name: _set_opt_dtype_kernel(op)),
        (CUDA_PROMOTE, lambda op, name: _promote_kernel(op)),
        (CUDA_LOWER_PRECISION_EXTRA, lambda op, name: _cast_kernel(op, lambda: torch.get_autocast_dtype("cpu"))),
        (tuple(CUDA_FP32_APPEND_DTYPE), lambda op, name: _append_dtype_kernel(_op(CUDA_FP32_APPEND_DTYPE[name]))),
        (CUDA_BANNED, lambda op, name: _banned_kernel(name)),
    )
    for names, make in makers:
        for name in names:
            op = _op(name)
            if op is not None and on_cuda_list(name):
                yield name, make(op, name)
    for name in CPU_ONLY:
        if _op(name) is not None and not on_cuda_list(name):
            yield name, torch.library.fallthrough_kernel


_scope = ScopedKernels(lambda: ((name, kernel, "AutocastCPU") for name, kernel in _kernels()))


def cuda_autocast_policy():
    """Within this context, CPU autocast casts as CUDA autocast would (see the module docstring).
    Re-entrant; leaving the outermost one restores the CPU's lists (scoped_kernels.py)."""
    return _scope()
