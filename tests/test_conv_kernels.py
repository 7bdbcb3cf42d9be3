"""benchmarks/conv_kernels.py, the GPU check that profiles ResNet-50's kernels: how it classes cuDNN's kernel
names, what it compares them with, and that without a CUDA GPU it says so instead of measuring."""

from __future__ import annotations

import pytest
import torch

from benchmarks.conv_kernels import kernel_kind, main, modelled_transposes_ms
from harness.profiles import load_profiles


@pytest.mark.parametrize("name,kind", [
    ("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsize2x2x1_g1",
     "conv"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1",
     "conv"),
    ("cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688fprop_optimized_tf32_64x64_16x10_nhwc_align4>", "conv"),
    ("void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>", "transpose"),
    ("void cudnn::ops::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, true, false>", "transpose"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar>",
     "other"),
])
def test_kernel_names_are_classed_by_what_they_do(name, kind):
    assert kernel_kind(name) == kind


def test_the_model_charges_fp32_convolutions_transposes_of_twice_the_bytes_of_bf16s():
    h200 = load_profiles()["h200"]
    fp32, bf16 = modelled_transposes_ms(h200, "baseline", 32), modelled_transposes_ms(h200, "amp-bf16", 32)
    # Twice the bytes, the same number of transpose kernels (each one launch): 2.09 and 1.26 ms (2026-12-07).
    assert 1.5 * bf16 < fp32 < 2 * bf16 and bf16 > 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no CUDA GPU")
def test_without_a_cuda_gpu_it_says_so_and_measures_nothing(capsys):
    assert main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
