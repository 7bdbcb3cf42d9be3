"""Which peak a computation is judged against, and the speed and cost figures derived from a
throughput; shared by measured and projected rows (and by the roofline) so all use one definition.

MFU is model FLOPs (harness/model_flops.py: the workload's analytic count for the model as built,
without recomputation) per second over the dense peak of the precision actually used; cost is the
profile's hourly price over throughput. Unknown inputs give None, never 0.
"""

from __future__ import annotations

# Precision label (a row's `precision`) or traced dtype name -> the profile's dense peak it runs at
# (reference/gpu_specs.md: MFU is always against the dense peak of the precision actually used).
PEAK_NAME = {
    "fp32": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8-mixed": "fp8", "int8": "int8",
    "bf16": "bf16", "fp16": "fp16",  # weights held in 16 bits (bf16-weights, fp16-weights)
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def peak_name(profile, precision: str, convolution: bool = False, tf32_matmul: bool = False) -> str | None:
    """The profile peak (`fp32`, `tf32`, `bf16`, ...) that work in `precision` runs at, None if unknown.

    fp32 matmuls run on CUDA cores (PyTorch leaves `torch.backends.cuda.matmul.allow_tf32` off by
    default; `tf32_matmul` models it on), fp32 convolutions on TF32 tensor cores where the GPU has
    them (`torch.backends.cudnn.allow_tf32` is on by default)."""
    name = PEAK_NAME.get(precision)
    if name == "fp32" and profile.has("tf32") and (convolution or tf32_matmul):
        return "tf32"
    return name


def peak_flops(profile, precision: str, convolution: bool = False, tf32_matmul: bool = False) -> float | None:
    """Dense peak FLOP/s for work in `precision` on `profile` (see `peak_name`), None where unknown."""
    name = peak_name(profile, precision, convolution, tf32_matmul)
    return profile.peak(name) if name else None


def speed_and_cost(profile, precision: str, flops_per_sample: float, throughput: float | None,
                   seq_len: int | None, convolutional: bool = False) -> dict[str, float | None]:
    """tokens/s, MFU and USD per million samples/tokens for a throughput in samples/s on `profile`.

    `convolutional`: the workload's compute is convolutions, so an fp32 conv net's FLOPs are done in TF32."""
    if not throughput:
        return {"tokens_per_s": None, "mfu": None, "usd_per_million_samples": None, "usd_per_million_tokens": None}
    profile = profile.per_device()  # one process, one device of the package (its share of peak and price)
    peak = peak_flops(profile, precision, convolution=convolutional)
    usd_per_sample = profile.usd_per_hour / 3600 / throughput if profile.usd_per_hour else None
    return {
        "tokens_per_s": throughput * seq_len if seq_len else None,
        "mfu": flops_per_sample * throughput / peak if peak else None,
        "usd_per_million_samples": usd_per_sample * 1e6 if usd_per_sample else None,
        "usd_per_million_tokens": usd_per_sample * 1e6 / seq_len if usd_per_sample and seq_len else None,
    }
