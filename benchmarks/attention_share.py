"""Fused attention's rate on this device as a share of its achievable matmul rate: the figure the speed
model assumes (speed_constants.toml: the fitted attention efficiency times the generation's scale,
0.52 on Hopper and Blackwell from the FlashAttention-2/-3 papers' figures), measured.

Times `scaled_dot_product_attention` forward + backward over a few training shapes, causal and not, and
the best square GEMM. FLOPs are counted by torch.utils.flop_counter's formulas, as the projection's trace counts them
(a causal call counts the full square, though the kernel skips the masked half: its rate reads up to 2x).
Prints one line per shape: TFLOP/s, share of the matmul rate, and the share the model assumes.
Usage: python benchmarks/attention_share.py   (on a CPU it measures the host and says so)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from harness.calibrate import matmul_rates, seconds_per_call
from harness.profiles import detect_local, load_profiles
from harness.project.speed_constants import constants_for

# (batch, heads, sequence, head dim): GPT-2 small's, a 7-8B model's at 4k and at 8k tokens.
CUDA_SHAPES = ((8, 12, 1024, 64), (2, 32, 4096, 128), (1, 32, 8192, 128))
CPU_SHAPES = ((2, 4, 256, 64), (1, 8, 512, 64))


def attention_rate(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], causal: bool) -> float:
    """FLOP/s of one forward + backward, its FLOPs by flop_counter's SDPA formulas (what the trace counts;
    the CPU's fused kernel has no formula registered, so the counter itself would count none there)."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)

    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    return flops / seconds_per_call(device)(step, 10)


def main() -> None:
    profile = detect_local(load_profiles())
    device = torch.device("cuda" if profile.vendor != "cpu" else "cpu")
    dtype, name = (torch.bfloat16, "bf16") if device.type == "cuda" else (torch.float32, "fp32")
    sizes = (4096, 8192) if device.type == "cuda" else (512, 1024)
    matmul = matmul_rates(device, sizes=sizes, dtypes={name: dtype}, budget_s=30)[name]
    gpu = constants_for(profile).gpu
    assumed = gpu.attention_efficiency * (gpu.attention_generation_scale if name != "fp32" else 1.0)
    where = f"{profile.id} ({profile.generation})" if device.type == "cuda" else "the host CPU, not a GPU"
    print(f"{where}: best {name} GEMM {matmul / 1e12:.1f} TFLOP/s; the model assumes attention at {assumed:.2f} of it")
    print(f"{'batch x heads x seq x dim':28} {'causal':>6} {'TFLOP/s':>8} {'share':>6} {'model':>6}")
    for shape in CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES:
        for causal in (False, True):
            rate = attention_rate(device, dtype, shape, causal)
            label = " x ".join(map(str, shape))
            print(f"{label:28} {causal!s:>6} {rate / 1e12:8.1f} {rate / matmul:6.2f} {assumed:6.2f}")


if __name__ == "__main__":
    main()
