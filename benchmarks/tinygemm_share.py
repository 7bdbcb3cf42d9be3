"""torchao's int4 weight-only kernel (tinygemm) against a bf16 GEMM of the same shape, measured: the figure
the speed model assumes (speed_constants.toml, tinygemm_efficiency: 0.116 of the bf16 rate on Ampere, from
published A6000 kernel times; 0.060 on Hopper and Blackwell, an assumption).

Times `group-quant-int4`'s layer as a GPU runs it (suites/techniques/groupquant.py: Int4WeightOnlyConfig,
tile-packed, group 32, a bf16 island) and the bf16 Linear it replaces, at row counts from a decode step's to a
prefill's. Prints one line per row count: both times, the ratio, tinygemm's TFLOP/s, its share of the bf16
rate at the largest row count (where the bf16 GEMM is bound by compute, not by reading its weight), and the
model's share.
Usage: python benchmarks/tinygemm_share.py   (tinygemm runs on NVIDIA GPUs of compute capability 8.0 or
newer only: elsewhere it says why and measures nothing)
"""

from __future__ import annotations

import torch
from torch import nn

from harness.calibrate import seconds_per_call
from harness.profiles import detect_local, load_profiles
from harness.project.speed_constants import constants_for
from suites.techniques import groupquant

ROWS = (1, 16, 128, 1024, 4096)
FEATURES = 4096  # a 7-8B model's hidden size: tinygemm takes it unpadded (a multiple of 1024)


def main() -> None:
    profile = detect_local(load_profiles())
    if profile.vendor != "nvidia" or not torch.cuda.is_available():
        print(f"no tinygemm measured: it runs on NVIDIA GPUs only, and this machine's device is {profile.id}")
        return
    device = torch.device("cuda")
    dense = nn.Linear(FEATURES, FEATURES, bias=False, device=device, dtype=torch.bfloat16)
    int4 = groupquant._torchao_layer(dense, 4, groupquant.GROUP_SIZES[4], device)
    if int4 is None:
        reason = groupquant._torchao()[1] or "its tile-packed layout failed on this device"
        print(f"no tinygemm measured: torchao cannot build it here ({reason})")
        return
    assumed = constants_for(profile).gpu.tinygemm_efficiency
    print(f"{profile.id} ({profile.generation}): int4 tinygemm vs bf16, {FEATURES} x {FEATURES} weight, group "
          f"{groupquant.GROUP_SIZES[4]}; the model assumes tinygemm at {assumed:.3f} of the bf16 rate")
    timed = seconds_per_call(device)
    with torch.inference_mode():
        times = {}
        for rows in ROWS:
            x = torch.randn(rows, FEATURES, device=device, dtype=torch.bfloat16)
            times[rows] = tuple(timed(lambda layer=layer, x=x: layer(x), 20) for layer in (dense, int4))
    # The bf16 rate tinygemm is measured against: the largest GEMM's, bound by compute (a bf16 GEMM of fewer
    # rows is bound by reading its weight, which would flatter tinygemm's share).
    bf16_rate = 2.0 * ROWS[-1] * FEATURES * FEATURES / times[ROWS[-1]][0]
    print(f"{'rows':>6} {'bf16 ms':>9} {'int4 ms':>9} {'int4/bf16':>10} {'int4 TF/s':>10} {'share':>6} {'model':>6}")
    for rows, (dense_s, int4_s) in times.items():
        int4_rate = 2.0 * rows * FEATURES * FEATURES / int4_s
        print(f"{rows:6d} {dense_s * 1e3:9.4f} {int4_s * 1e3:9.4f} {int4_s / dense_s:10.2f} {int4_rate / 1e12:10.1f} "
              f"{int4_rate / bf16_rate:6.3f} {assumed:6.3f}")


if __name__ == "__main__":
    main()
