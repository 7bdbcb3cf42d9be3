"""The speed model's constants: per GPU vendor and architecture generation, and for the host that issues
the ops. `speed_constants.toml` holds the priors, each with its source; `speed_fit.toml` (written by
`benchmarks/projection_calibration.py --fit --write`, with the data it was fitted on and its held-out
error) overrides the constants it fitted; `decode_fit.toml` (written by `benchmarks/decode_calibration.py
--write`) then overrides a served decoder's streaming constants, fitted on published decodes.

A generation's table inherits its vendor's and overrides what differs; a generation or vendor nobody
fitted says so (`fitted` false), and projected rows carry that note. AMD parts are never costed with
NVIDIA's fitted factors: the AMD table stands on its own.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path

CONSTANTS_FILE = Path(__file__).with_name("speed_constants.toml")
FIT_FILE = Path(__file__).with_name("speed_fit.toml")
DECODE_FIT_FILE = Path(__file__).with_name("decode_fit.toml")
RATIO_CHECK_FILE = Path(__file__).with_name("ratio_check.toml")


@dataclass(frozen=True)
class GpuConstants:
    """How real kernels fall short of a GPU's datasheet (one set per vendor/generation)."""

    kernel_s: float              # fixed cost of every kernel: launch to completion of the smallest one
    saturation_flops_per_sm: float  # work per SM at which a GEMM/conv reaches half its achievable rate
    conv_efficiency: float       # convolutions' rate relative to the achievable matmul rate
    attention_efficiency: float  # fused attention's rate relative to the achievable matmul rate (on Ampere)
    unaligned_efficiency: float  # a 16/8-bit GEMM with a leading dimension off the tensor-core granule, relative
    bandwidth_efficiency: float  # achievable / datasheet bandwidth where no measured figure exists
    matmul_derating: float       # achievable / datasheet matmul rate where no measured figure exists
    # achievable / datasheet bandwidth of the long sequential reads of a served decoder's matmuls (weights)
    # and attention (KV cache), where no measured copy rate exists (fitted by benchmarks/decode_calibration.py)
    stream_bandwidth_efficiency: float = 0.85
    # the share of that stream rate a weight-only matmul reaches on its packed int8 / int4 weight (dequantising)
    int8_weight_stream_share: float = 1.0
    int4_weight_stream_share: float = 1.0
    # Fused attention's efficiency on tensor cores on this generation relative to Ampere's (PyTorch's
    # kernels, FlashAttention-2 and the memory-efficient one, were written for Ampere); a prior with its
    # source in speed_constants.toml, not fitted
    attention_generation_scale: float = 1.0
    # torchao's int4 tinygemm matmul's rate relative to a bf16 GEMM's (a prior with its source in
    # speed_constants.toml, not fitted)
    tinygemm_efficiency: float = 1.0
    fitted: bool = False         # whether these came from a fit on measurements of this vendor
    decode_fitted: bool = False  # whether the three decode constants above came from a fit (decode_fit.toml)


@dataclass(frozen=True)
class HostConstants:
    """What eager PyTorch costs on the host per op, and how well that overlaps the GPU's work."""

    issue_python_s: float     # Python + dispatcher + autograd recording, per op (forward, optimizer)
    issue_engine_s: float     # autograd's C++ engine, per backward op
    issue_inference_s: float  # Python + dispatcher under inference_mode (no autograd), per op
    # Added per convolution: cuDNN's descriptor set-up and execution-plan lookup on every call
    issue_conv_s: float
    # The host issues while the GPU runs: a phase takes (K**p + I**p)**(1/p) for kernel time K and
    # issue time I (p large: perfect overlap, the longer wins; p = 1: no overlap, they add).
    overlap: float


@dataclass(frozen=True)
class SpeedConstants:
    gpu: GpuConstants
    host: HostConstants
    key: str  # which table applied: "nvidia.hopper", "amd", ...

    @property
    def issue_s(self) -> dict[str, float]:
        """Host seconds per op, by its issuer (trace.OpShape.issuer)."""
        return {"python": self.host.issue_python_s, "engine": self.host.issue_engine_s,
                "inference": self.host.issue_inference_s}


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@cache
def _tables(path: Path = CONSTANTS_FILE, fitted: Path | None = FIT_FILE, decode: Path | None = DECODE_FIT_FILE) -> dict:
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    for over in (fitted, decode):
        if over is not None and over.exists():
            with open(over, "rb") as handle:
                data = _merged(data, tomllib.load(handle))
    return data


def _gpu(table: dict) -> dict:
    return {f.name: table[f.name] for f in fields(GpuConstants) if f.name in table}


def constants_for(profile, path: Path = CONSTANTS_FILE, fitted: Path | None = FIT_FILE,
                  decode: Path | None = DECODE_FIT_FILE) -> SpeedConstants:
    """The constants for `profile`'s vendor and generation; for a vendor nobody fitted, a calibrated
    profile's measured kernel floor and issue cost replace the priors. `fitted=None`: the priors alone
    (what a fit is pulled towards), decode's too; `decode=None`: the decode terms at their priors."""
    data = _tables(path, fitted, decode if fitted is not None else None)
    vendor_table = data["gpu"].get(profile.vendor, data["gpu"]["default"])
    values = _gpu(data["gpu"]["default"]) | _gpu(vendor_table)
    key = profile.vendor if profile.vendor in data["gpu"] else "default"
    generation = vendor_table.get(profile.generation)
    if isinstance(generation, dict):
        values |= _gpu(generation)
        key = f"{profile.vendor}.{profile.generation}"
    gpu = GpuConstants(**values)
    host = HostConstants(**data["host"])
    if gpu.fitted:
        # A fitted vendor's kernel and issue constants absorb costs the model does not itemise (they
        # were fitted together with the bandwidth efficiency): a calibration's raw figures would not
        # mean the same and are kept in its overlay only (refit to use them).
        return SpeedConstants(gpu=gpu, host=host, key=key)
    if profile.kernel_s is not None:
        gpu = replace(gpu, kernel_s=profile.kernel_s)
    if profile.issue_s is not None:
        # A calibration measures one figure, a Python-issued autograd op's; the fitted ratios place the others.
        scale = profile.issue_s / host.issue_python_s
        host = replace(host, issue_python_s=profile.issue_s, issue_engine_s=host.issue_engine_s * scale,
                       issue_inference_s=host.issue_inference_s * scale)
    return SpeedConstants(gpu=gpu, host=host, key=key)


def ratio_check(path: Path | None = None) -> dict:
    """The held-out error of projected GPU-to-GPU throughput ratios (benchmarks/cross_gpu_ratios.py --write):
    n, median_abs_error, worst_abs_error, the GPUs and the training fit it checked; empty where never written."""
    path = path or RATIO_CHECK_FILE
    if not path.exists():
        return {}
    return dict(tomllib.loads(path.read_text()).get("ratios", {}))


def fit_provenance() -> dict:
    """What the constants were fitted on and their held-out error (the [fit] table)."""
    return dict(_tables().get("fit", {}))


def training_fit_digest(path: Path = FIT_FILE) -> str:
    """A short digest of the training fit's file: the decode fit records the one it was fitted with, as a
    refit of the training constants (kernel costs, bandwidth) leaves it stale."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else ""


def decode_fit_provenance() -> dict:
    """What the decode constants were fitted on and their held-out error (decode_fit.toml's [decode_fit])."""
    return dict(_tables().get("decode_fit", {}))
