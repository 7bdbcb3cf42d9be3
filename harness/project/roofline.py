"""Step time from a roofline over the traced ops: each op takes the longer of its FLOPs at the dense
peak of its dtype and its bytes at the memory bandwidth, each scaled by an efficiency factor.

The factors say what fraction of the datasheet peak real kernels reach. They are fitted to the
physics, not to one benchmark: large cuBLAS GEMMs reach 70-80% of the dense tensor peak, fused
attention (FlashAttention-2 forward + backward) about half, cuDNN convolutions somewhat less than
GEMMs, and elementwise kernels 70-80% of the bandwidth. `benchmarks/projection_calibration.py`
projects the published measurements of reference/calibration.md (ResNet-50 and BERT-large on A100,
Llama-2 13B on A100) with these factors and prints the errors; rerun it after changing them.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.project.trace import StepTrace

# Fraction of the dense peak (compute) or of the bandwidth (memory) real kernels reach, by op class.
EFFICIENCY = {"matmul": 0.70, "attention": 0.50, "conv": 0.55, "memory": 0.75}
# Eager PyTorch spends a few microseconds of CPU time per op (dispatch + launch); a step cannot be
# faster than its ops can be issued. [M] order of magnitude from PyTorch's own overhead notes.
OP_OVERHEAD_S = 5e-6

# Trace dtype -> the profile peak it runs at. fp32 matmuls run on CUDA cores (PyTorch leaves TF32 off
# for matmul by default), fp32 convolutions on TF32 tensor cores where present (cuDNN's default).
DTYPE_PEAK = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
              "float8_e5m2": "fp8", "int8": "int8"}


@dataclass(frozen=True)
class TimeEstimate:
    """Projected seconds for one step, and the part of it bound by compute, memory and op overhead."""

    step_s: float
    compute_s: float
    memory_s: float
    overhead_s: float


def peak_for(profile, op_class: str, dtype: str) -> float | None:
    name = DTYPE_PEAK.get(dtype)
    if name is None:
        return None
    if name == "fp32" and op_class == "conv" and profile.has("tf32"):
        name = "tf32"
    return profile.peak(name)


def estimate(trace: StepTrace, profile, efficiency: dict[str, float] | None = None) -> TimeEstimate | None:
    """Roofline step time on `profile`; None when a needed peak or the bandwidth is unknown."""
    efficiency = efficiency or EFFICIENCY
    bandwidth = profile.memory_bandwidth_bytes_s
    if not bandwidth:
        return None
    compute = memory = 0.0
    ops = 0
    for (op_class, dtype), cost in trace.costs.items():
        ops += cost.count
        memory_time = cost.bytes / (bandwidth * efficiency["memory"])
        if cost.flops:
            peak = peak_for(profile, op_class, dtype)
            if peak is None:
                return None
            compute_time = cost.flops / (peak * efficiency.get(op_class, efficiency["matmul"]))
            # Summed per class: an op class is either compute- or memory-bound as a whole (its ops
            # share shapes), which keeps the estimate cheap and stable.
            if compute_time >= memory_time:
                compute += compute_time
                continue
        memory += memory_time
    overhead = ops * OP_OVERHEAD_S
    return TimeEstimate(step_s=max(compute + memory, overhead), compute_s=compute, memory_s=memory,
                        overhead_s=overhead)
