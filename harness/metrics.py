"""Derived speed and cost figures, shared by measured and projected rows so both use one definition.

MFU is model FLOPs (harness/model_flops.py: the workload's analytic count for the model as built,
without recomputation) per second over the dense peak of the precision actually used; cost is the
profile's hourly price over throughput. Unknown inputs give None, never 0.
"""

from __future__ import annotations

# Precision label -> the dtype whose dense peak MFU is computed against (reference/gpu_specs.md:
# MFU is always against the dense peak of the precision actually used).
PEAK_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8-mixed": "fp8", "int8": "int8"}


def speed_and_cost(profile, precision: str, flops_per_sample: float, throughput: float | None,
                   seq_len: int | None, convolutional: bool = False) -> dict[str, float | None]:
    """tokens/s, MFU and USD per million samples/tokens for a throughput in samples/s on `profile`.

    `convolutional`: an fp32 conv net runs its convolutions on TF32 tensor cores where the GPU has
    them (cuDNN's default in PyTorch), so TF32 is the precision its FLOPs are actually done in."""
    if not throughput:
        return {"tokens_per_s": None, "mfu": None, "usd_per_million_samples": None, "usd_per_million_tokens": None}
    profile = profile.per_device()  # one process, one device of the package (its share of peak and price)
    dtype = PEAK_DTYPE.get(precision, "")
    if dtype == "fp32" and convolutional and profile.has("tf32"):
        dtype = "tf32"
    peak = profile.peak(dtype)
    usd_per_sample = profile.usd_per_hour / 3600 / throughput if profile.usd_per_hour else None
    return {
        "tokens_per_s": throughput * seq_len if seq_len else None,
        "mfu": flops_per_sample * throughput / peak if peak else None,
        "usd_per_million_samples": usd_per_sample * 1e6 if usd_per_sample else None,
        "usd_per_million_tokens": usd_per_sample * 1e6 / seq_len if usd_per_sample and seq_len else None,
    }
