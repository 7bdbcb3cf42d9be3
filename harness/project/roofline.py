"""Step time from a roofline over the traced ops: each op class takes the longer of its FLOPs at the
dense peak of its dtype and its bytes at the memory bandwidth, each scaled by an efficiency factor.

The factors say what fraction of the datasheet peak real kernels reach, and were chosen within
physical bounds against the published A100 measurements of reference/calibration.md
(`benchmarks/projection_calibration.py` prints the comparison; `--fit` searches a grid):
- matmul 0.70: large cuBLAS GEMMs reach 70-80% of the dense tensor peak; BERT-large FP16/TF32 at
  sequence 128 (580 / 317 sequences/s, NVIDIA DeepLearningExamples) project within +0.4% / +7%.
- conv 0.30: cuDNN training convolutions reach far less; ResNet-50 AMP / TF32 at batch 256 (2,470 /
  938 images/s) project at -6% / +26% with it (an unconstrained grid fit agrees: 0.3).
- attention 0.60: FlashAttention-2 forward + backward reaches 50-70% of peak on A100 (its paper);
  the grid prefers 0.9, which we do not take (it would only hide the -33% at sequence 512). That row
  cannot agree with the s128 rows under any per-op model: published, s512 runs 1.45x the tokens/s of
  s128 (210 x 512 vs 580 x 128) although each s512 token costs more FLOPs (attention grows with s);
  with the same tokens per step (16 x 512 = 64 x 128) the trace differs only in attention.
- memory 0.85: elementwise kernels stream at 80-90% of the bandwidth.
Mean absolute error over the like-for-like rows on 2026-11-30 (CUDA autocast lists): 14.5%, worst -32.9%
(BERT-large s512).

Against measured twins on an H200 (benchmarks/data/h200-2026-11-30.csv, torch 2.11, the suite's
standard batches: gpt2-124m b8, bert-base b32, resnet50 b32): fp32 GPT and BERT steps project within
-10% to +5%, but every amp-bf16 step projects 47-75% too fast and every ResNet step 34-81% too fast.
Those steps are short (4-40 ms) and launch-bound: measured minus roofline time is 8-29 us per traced
op, against the 5 us of OP_OVERHEAD_S. Not yet refitted: the next fit should use these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.metrics import peak_flops
from harness.project.trace import StepTrace

# Fraction of the dense peak (compute) or of the bandwidth (memory) real kernels reach, by op class
# (chosen as the module docstring explains).
EFFICIENCY = {"matmul": 0.70, "attention": 0.60, "conv": 0.30, "memory": 0.85}
# Eager PyTorch spends a few microseconds of CPU time per op (dispatch + launch); a step cannot be
# faster than its ops can be issued. [M] order of magnitude from PyTorch's own overhead notes.
OP_OVERHEAD_S = 5e-6

@dataclass(frozen=True)
class TimeEstimate:
    """Projected seconds for one step, and the part of it bound by compute, memory and op overhead."""

    step_s: float
    compute_s: float
    memory_s: float
    overhead_s: float


def estimate(trace: StepTrace, profile, efficiency: dict[str, float] | None = None,
             tf32_matmul: bool = False, phases: tuple[str, ...] = ("forward", "backward", "optimizer"),
             ) -> TimeEstimate | None:
    """Roofline step time on `profile`; None when a needed peak or the bandwidth is unknown.

    `tf32_matmul` models `torch.backends.cuda.matmul.allow_tf32 = True` (off by default in PyTorch);
    `phases` selects parts of the step (e.g. leave out the optimizer when it is amortised)."""
    efficiency = efficiency or EFFICIENCY
    bandwidth = profile.memory_bandwidth_bytes_s
    if not bandwidth:
        return None
    compute = memory = 0.0
    ops = 0
    for (phase, op_class, dtype), cost in trace.costs.items():
        if phase not in phases:
            continue
        ops += cost.count
        memory_time = cost.bytes / (bandwidth * efficiency["memory"])
        if cost.flops:
            peak = peak_flops(profile, dtype, convolution=op_class == "conv", tf32_matmul=tf32_matmul)
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
