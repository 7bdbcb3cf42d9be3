"""Mixed precision (guide T1): run matmuls and convolutions in 16-bit under `torch.autocast`.

bf16 keeps fp32's exponent range, so it needs no loss scaling; fp16 does, because small gradients
underflow: GradScaler multiplies the loss by a dynamic factor and unscales before the step
(Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740).
"""

from __future__ import annotations

import torch

from suites.techniques.base import Phase, Run, Technique


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


AMP_BF16 = Technique(
    id="amp-bf16", phase=Phase.STEP, changes_numerics=True, guide="T1",
    summary="bf16 autocast for matmuls/convs, fp32 master weights, no loss scaling",
    check=_check_bf16, apply=_apply_bf16, exclusive="precision")

AMP_FP16 = Technique(
    id="amp-fp16", phase=Phase.STEP, changes_numerics=True, guide="T1",
    summary="fp16 autocast with dynamic loss scaling (GradScaler)",
    check=_check_fp16, apply=_apply_fp16, exclusive="precision")

TECHNIQUES = (AMP_BF16, AMP_FP16)
