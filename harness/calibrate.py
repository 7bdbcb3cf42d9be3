"""Self-calibration: measure what this device really reaches, and write it as a profile overlay.

`headroom calibrate` times dense matmuls over a sweep of square shapes per dtype (the best rate is the
device's achievable matmul throughput, as stas00's mamf-finder measures it), a large device-to-device
copy (achievable bandwidth), the host's cost to issue one small autograd op from Python, and, on CUDA,
the GPU's floor per kernel (tiny kernels replayed from a CUDA graph, so the host is out of the way).
The overlay (TOML with provenance) goes in a folder that `--profiles DIR` reads; projections for that
profile then cost matmuls at the measured rates instead of derated datasheet ones. The bandwidth and
per-op figures replace the speed model's constants only where its vendor's were never fitted (there
the fitted constants absorb costs the raw figures do not carry; speed_constants.py). On a CPU the
same code measures the host, and the overlay says so.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from harness.provenance import git_sha

OVERLAY_SUFFIX = ".overlay.toml"
# Square GEMM sizes swept per dtype; the best rate over them is the achievable one. CUDA's large sizes
# saturate the tensor cores; the host CPU stops earlier (its GEMMs take seconds beyond).
CUDA_SIZES = (1024, 2048, 4096, 6144, 8192, 12288)
CPU_SIZES = (256, 512, 1024, 2048)
CUDA_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Calibration:
    """What one device measured (rates in FLOP/s and bytes/s, costs in seconds)."""

    profile_id: str
    device: str
    achievable_flops: dict[str, float] = field(default_factory=dict)
    bandwidth_bytes_s: float | None = None
    issue_s: float | None = None
    kernel_s: float | None = None
    notes: list[str] = field(default_factory=list)
    method: str = ""


def seconds_per_call(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of `fn`, averaged over `repeat` calls after one warm-up: CUDA events on a GPU
    (kernels are asynchronous), the wall clock on the CPU."""

    def cuda(fn, repeat: int) -> float:
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / repeat

    def cpu(fn, repeat: int) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - started) / repeat

    return cuda if device.type == "cuda" else cpu


def matmul_rates(device: torch.device, sizes=None, dtypes=None, budget_s: float = 90.0,
                 notes: list[str] | None = None) -> dict[str, float]:
    """Best dense matmul FLOP/s per dtype over square sizes (each size timed for about 0.2 s); a dtype the
    device cannot multiply in is left out with a note."""
    sizes = sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    dtypes = dtypes or (CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES)
    timer = seconds_per_call(device)
    deadline = time.monotonic() + budget_s
    rates: dict[str, float] = {}
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype in dtypes.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            for n in sizes:
                if time.monotonic() > deadline:
                    break
                try:
                    a = torch.randn(n, n, device=device, dtype=dtype)
                    b = torch.randn(n, n, device=device, dtype=dtype)
                    once = timer(lambda a=a, b=b: torch.mm(a, b), 1)
                    seconds = timer(lambda a=a, b=b: torch.mm(a, b), max(1, min(50, int(0.2 / max(once, 1e-6)))))
                except RuntimeError as exc:  # no kernel for this dtype here, or out of memory at this size
                    if notes is not None:
                        notes.append(f"{name} {n}x{n} matmul failed: {str(exc).splitlines()[0][:100]}")
                    break
                rates[name] = max(rates.get(name, 0.0), 2.0 * n**3 / seconds)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return rates


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes read + written per second by a large tensor copy (the streaming rate elementwise ops see)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 27)
    source = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    target = torch.empty_like(source)
    seconds = min(seconds_per_call(device)(lambda: target.copy_(source), 10) for _ in range(3))
    return 2 * nbytes / seconds


def issue_cost(device: torch.device, ops: int = 2000) -> float:
    """Host seconds to issue one small op from Python that autograd records (what eager training pays
    per op when the GPU is faster than the host): wall time of a loop of tiny adds, without waiting."""
    x = torch.ones(8, device=device, requires_grad=True)
    y = torch.ones(8, device=device)
    for _ in range(100):
        torch.add(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(ops):
            torch.add(x, y)
        best = min(best, (time.perf_counter() - started) / ops)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best


def kernel_floor(device: torch.device, kernels: int = 200) -> float | None:
    """GPU seconds per tiny kernel, replayed from a CUDA graph so that no host issue cost is in it;
    None on a CPU (nothing is launched)."""
    if device.type != "cuda":
        return None
    x = torch.ones(8, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return seconds_per_call(device)(graph.replay, 20) / kernels


def calibrate(profile, device: torch.device, quick: bool = False,
              progress: Callable[[str], None] = print) -> Calibration:
    """Every figure for `profile` on `device` (`quick`: a small sweep, for tests and a first look)."""
    result = Calibration(profile_id=profile.id, device=_device_name(device))
    sizes = (CUDA_SIZES[:3] if device.type == "cuda" else CPU_SIZES[:2]) if quick else None
    dtypes = {name: dtype for name, dtype in (CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES).items()
              if device.type != "cuda" or name in ("fp32", "fp16") or profile.has(name)}
    progress("matmul rates per dtype (a sweep of square GEMMs)...")
    rates = matmul_rates(device, sizes=sizes, dtypes=dtypes, budget_s=20 if quick else 90, notes=result.notes)
    progress("copy bandwidth...")
    copy_bytes = (1 << 28) if quick and device.type == "cuda" else (1 << 30 if device.type == "cuda" else 1 << 27)
    bandwidth = copy_bandwidth(device, nbytes=copy_bytes)
    # A package of several devices (MI250X: two GCDs) is measured on one; its profile holds the package's
    # figures (per_device() divides them again).
    share = profile.devices_per_package
    result.achievable_flops = {name: rate * share for name, rate in rates.items()}
    result.bandwidth_bytes_s = bandwidth * share
    swept = sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    result.method = (f"best square GEMM per dtype ({', '.join(map(str, swept))}), "
                     f"{copy_bytes >> 20} MiB copy, {500 if quick else 2000}-op issue loop"
                     + (", CUDA-graph kernel floor" if device.type == "cuda" else "")
                     + (f"; one of {share} devices, figures x{share} for the package" if share > 1 else ""))
    progress("host issue cost per op...")
    result.issue_s = issue_cost(device, ops=500 if quick else 2000)
    result.kernel_s = kernel_floor(device)
    if device.type != "cuda":
        result.notes.append("measured on the host CPU: these are the host's figures, not a GPU's")
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "host CPU"


def overlay_document(result: Calibration) -> dict:
    """The overlay as a TOML document: the measured figures with their provenance."""
    driver = None
    if torch.cuda.is_available():
        from harness.provenance import nvml_info

        driver = nvml_info().get("driver_version")
    figures = {"achievable_tflops": {k: float(f"{v / 1e12:.5g}") for k, v in result.achievable_flops.items()}}
    if result.bandwidth_bytes_s:
        figures["achievable_bandwidth_gb_s"] = round(result.bandwidth_bytes_s / 1e9, 1)
    if result.issue_s:
        figures["issue_us"] = round(result.issue_s * 1e6, 3)
    if result.kernel_s:
        figures["kernel_us"] = round(result.kernel_s * 1e6, 3)
    provenance = {"device": result.device, "torch": torch.__version__, "headroom": git_sha() or "unknown",
                  "host": socket.gethostname(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "method": f"headroom calibrate: {result.method}"}
    if driver:
        provenance["driver"] = driver
    if result.notes:
        provenance["notes"] = "; ".join(result.notes)
    return {"profile": result.profile_id, "calibration": provenance, "figures": figures}


def write_overlay(result: Calibration, folder: Path) -> Path:
    import tomli_w

    from harness.records import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result.profile_id}{OVERLAY_SUFFIX}"
    atomic_write_text(path, "# Written by `headroom calibrate`; read by `--profiles` on this folder.\n"
                      + tomli_w.dumps(overlay_document(result)))
    return path
