"""Where a convolutional network's eager inference spends its GPU time, kernel by kernel: cuDNN's convolutions, the
layout transposes around them (nchwToNhwc / nhwcToNchw), and the rest, in fp32 (TF32 convolutions, PyTorch's
default) and under bf16 autocast, beside what the speed model charges for the transposes
(roofline.layout_transposes_s: each NCHW operand read and written once more around a tensor-core convolution).

Why: the held-out worst row of benchmarks/projection_calibration.py is ResNet-50 fp32 inference at batch 32 on an
H200 (+63%): measured 5.5 ms, faster than its bf16 twin (7.3 ms), while the model charges the fp32 convolutions
transposes of twice bf16's bytes. cuDNN's kernel names say which layouts they read and write (an
`..._nhwckrsc_nchw_...` kernel reads NHWC and writes NCHW itself), so one profile settles what the transposes cost.
Usage: python benchmarks/conv_kernels.py [--batch 32]   (without a CUDA GPU it says so and exits 0)
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch
import torchvision
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from harness.cell import Cell
from harness.profiles import detect_local, load_profiles
from harness.project import project
from harness.project.roofline import layout_transposes_s, op_arrays
from harness.project.speed_constants import constants_for

PRECISIONS = {"fp32": ("baseline", None), "bf16": ("amp-bf16", torch.bfloat16)}
ITERATIONS = 5


def kernel_kind(name: str) -> str:
    """`transpose` (a layout change around a convolution), `conv` (cuDNN's or CUTLASS's convolution kernels) or
    `other`, from a CUDA kernel's name."""
    lowered = name.lower()
    if "nchwtonhwc" in lowered or "nhwctonchw" in lowered:
        return "transpose"
    marks = ("fprop", "implicit_gemm", "implicit_convolve", "winograd", "conv2d", "dgrad", "scudnn", "16816cudnn",
             "1688cudnn", "cudnn_infer")
    if any(mark in lowered for mark in marks):
        return "conv"
    return "other"


def measured_kernels(model, batch: int, dtype) -> dict[str, float]:
    """Milliseconds per forward of each CUDA kernel, averaged over ITERATIONS profiled forwards."""
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            for _ in range(ITERATIONS):
                model(x)
            torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in trace.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue  # an operator on the host: its kernels are counted as themselves
        # torch 2.4 renamed the CUDA columns to device_*; older releases name them cuda_*.
        total_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if total_us:
            times[event.key] += total_us / 1e3 / ITERATIONS
    return times


def modelled_transposes_ms(profile_, technique: str, batch: int) -> float:
    """The transposes the speed model charges the same cell, in ms."""
    cell = Cell("resnet50", None, "infer", technique, profile_.id, batch, "projected").resolve(load_profiles())
    projection = project(cell)
    device = cell.profile.per_device()
    ops = op_arrays(projection.trace, device, tf32_matmul=projection.trace.tf32)
    constants = constants_for(device)
    bandwidth = ops.bandwidth * constants.gpu.bandwidth_efficiency
    return float(np.sum(layout_transposes_s(ops, bandwidth, constants.gpu.kernel_s) * ops.count)) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.version.hip:
        print("conv_kernels: needs a CUDA GPU (cuDNN's kernel names); none here, nothing measured")
        return 0
    local = detect_local(load_profiles())
    model = torchvision.models.resnet50().cuda().eval()
    print(f"ResNet-50 eager inference, batch {args.batch}, NCHW, on {local.id} "
          f"(cudnn.allow_tf32={torch.backends.cudnn.allow_tf32})")
    for precision, (technique, dtype) in PRECISIONS.items():
        times = measured_kernels(model, args.batch, dtype)
        if not times:
            print(f"{precision}: the profiler recorded no CUDA kernel (CUPTI unavailable?): nothing measured")
            return 1
        by_kind: dict[str, float] = defaultdict(float)
        for name, ms in times.items():
            by_kind[kernel_kind(name)] += ms
        total = sum(times.values())
        charged = modelled_transposes_ms(local, technique, args.batch)
        print(f"{precision}: GPU {total:.2f} ms a forward; convolutions {by_kind['conv']:.2f}, transposes "
              f"{by_kind['transpose']:.2f} (the model charges {charged:.2f}), the rest {by_kind['other']:.2f}")
        for name, ms in sorted(times.items(), key=lambda item: -item[1])[:8]:
            print(f"  {ms:7.3f} ms {ms / total:6.1%}  {kernel_kind(name):9} {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
