"""Mixed precision (guide T1): run matmuls and convolutions in 16-bit under `torch.autocast`.

bf16 keeps fp32's exponent range, so it needs no loss scaling; fp16 does, because small gradients
underflow: GradScaler multiplies the loss by a dynamic factor and unscales before the step
(Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740). fp8 goes further on fp8
tensor cores (compute capability 8.9+): torchao's float8 training swaps nn.Linear for Float8Linear, whose
matmuls cast inputs and weights to e4m3 and gradients to e5m2 with dynamic per-tensor scales
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433); the rest runs in bf16.
TF32 keeps fp32 storage but feeds matmuls to tensor cores with a 10-bit mantissa (NVIDIA A100 whitepaper).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique, Unsupported


def _check_bf16(profile, workload, mode):
    if not profile.has("bf16"):
        cc = f" (compute capability {profile.compute_capability}; bf16 needs 8.0 or newer)" \
            if profile.compute_capability else ""
        return f"{profile.name} has no bf16 support{cc}"
    return None


def _check_fp16(profile, workload, mode):
    if profile.vendor != "cpu" and "fp16" not in profile.peak_flops:
        return f"{profile.name} lists no fp16 throughput"
    return None


def _apply_bf16(run: Run) -> None:
    run.autocast_dtype = torch.bfloat16
    run.precision = "bf16-mixed"


def _apply_fp16(run: Run) -> None:
    run.autocast_dtype = torch.float16
    # Dynamic loss scaling only matters when there is a backward pass.
    run.loss_scaling = run.mode == "train"
    run.precision = "fp16-mixed"


# torch._scaled_mm, behind Float8Linear, needs both matrix dimensions divisible by 16 (torchao's README
# filters layers the same way).
FP8_DIM_MULTIPLE = 16


def _check_fp8(profile, workload, mode):
    if profile.vendor == "cpu":
        return "fp8 training needs CUDA fp8 tensor cores; the host CPU has none"
    if not profile.has("fp8"):
        if profile.compute_capability:
            return (f"fp8 needs fp8 tensor cores (compute capability >= 8.9); {profile.name} is "
                    f"{profile.compute_capability}")
        return f"{profile.name} has no fp8 tensor cores"
    if workload.traits.convolutional:
        return (f"torchao's float8 converts nn.Linear layers only; {workload.name}'s compute is in "
                "convolutions")
    if mode != "train":
        # Measured with torchao 0.18: the autocast cast of its Float8TrainingTensor (aten.to.dtype) is not
        # implemented under torch.inference_mode. fp8 inference is weight quantisation, a different recipe.
        return ("fp8 is torchao's float8 training recipe; its Float8Linear cannot run under inference_mode "
                "with autocast")
    if importlib.util.find_spec("torchao") is None:
        return "fp8 uses torchao's float8 training, and torchao is not installed (pip install torchao)"
    return None


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % FP8_DIM_MULTIPLE == 0
            and module.out_features % FP8_DIM_MULTIPLE == 0)


def _apply_fp8(run: Run) -> None:
    try:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except Exception as exc:  # not installed, or built for another torch (which can fail in other ways)
        first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise Unsupported(f"fp8 needs torchao's float8 training, which does not import here: "
                          f"{type(exc).__name__}: {first_line}") from None
    linears = sum(isinstance(m, nn.Linear) for m in run.model.modules())
    convert_to_float8_training(run.model, module_filter_fn=_fp8_eligible)
    converted = sum(isinstance(m, Float8Linear) for m in run.model.modules())
    if not converted:
        raise Unsupported(f"no nn.Linear of {run.workload.name} has both dimensions divisible by "
                          f"{FP8_DIM_MULTIPLE}, as fp8 matmuls need")
    # Everything outside the fp8 matmuls (attention, norms, other layers) runs under bf16 autocast, the
    # recipe torchtitan pairs with float8; every fp8 GPU has bf16.
    run.autocast_dtype = torch.bfloat16
    run.precision = "fp8-mixed"
    run.notes.append(f"{converted} of {linears} nn.Linear layers run fp8 matmuls (torchao Float8Linear, "
                     "dynamic tensorwise scales); master weights stay fp32, the rest runs in bf16 autocast; "
                     "without torch.compile the fp8 casts are separate kernels")


def _check_tf32(profile, workload, mode):
    if not profile.has("tf32"):
        return f"{profile.name} has no TF32 tensor cores (NVIDIA Ampere and newer have them)"
    return None


def _apply_tf32(run: Run) -> None:
    run.tf32 = True
    if run.precision == "fp32":  # under autocast the row keeps its 16-bit label (only fp32 leftovers use TF32)
        run.precision = "tf32"
    run.notes.append("TF32 matmuls and convolutions (10-bit mantissa inputs, fp32 accumulation)")


AMP_BF16 = Technique(
    id="amp-bf16", phase=Phase.STEP, changes_numerics=True, guide="T1",
    summary="bf16 autocast for matmuls/convs, fp32 master weights, no loss scaling",
    check=_check_bf16, apply=_apply_bf16, exclusive="precision",
    # Declared before the stack applies: parallel techniques (applied earlier) count the bytes of the layer
    # outputs they exchange in autocast's dtype.
    declare=lambda run: setattr(run, "autocast_dtype", torch.bfloat16))

AMP_FP16 = Technique(
    id="amp-fp16", phase=Phase.STEP, changes_numerics=True, guide="T1",
    summary="fp16 autocast with dynamic loss scaling (GradScaler)",
    check=_check_fp16, apply=_apply_fp16, exclusive="precision",
    declare=lambda run: setattr(run, "autocast_dtype", torch.float16))

# STRUCTURE, not STEP: the Linear swap must precede tensor parallelism, checkpointing and FSDP, as in
# torchtitan, where float8 conversion is a model converter applied before parallelize.
FP8 = Technique(
    id="fp8", phase=Phase.COMPRESS, order=2, changes_numerics=True, guide="T1",
    summary="fp8 matmuls for nn.Linear via torchao float8 training, bf16 autocast elsewhere",
    check=_check_fp8, apply=_apply_fp8, exclusive="precision")

TF32 = Technique(
    id="tf32", phase=Phase.STEP, changes_numerics=True, guide="T1",
    summary="fp32 matmuls and convolutions on TF32 tensor cores (NVIDIA containers' default)",
    check=_check_tf32, apply=_apply_tf32)

TECHNIQUES = (AMP_BF16, AMP_FP16, FP8, TF32)
