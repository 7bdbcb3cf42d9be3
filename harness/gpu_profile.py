"""One GPU variant's figures as the rest of headroom reads them: memory, bandwidth, dense peak per dtype,
achievable rates, features, price, links, each absent (None) where unknown. Reading and validating the
TOML files that hold them is `harness.profiles`' job."""

from __future__ import annotations

import dataclasses
import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
FEATURES = ("bf16", "tf32", "fp8", "sparse_2to4", "flash_attention")
VENDORS = ("nvidia", "amd", "cpu")
SAFE_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")
# Every price is on-demand USD per GPU-hour (pay as you go, no reservation or commitment; serverless
# per-second billing counts): reserved blocks, spot and commitments are cheaper by 30-90%
# (reference/gpu_specs.md, procurement note) and would reorder the cost rankings if mixed in.
PRICE_BASIS = "on-demand"
PRICE_DATE = re.compile(r"\d{4}(-\d{2}(-\d{2})?)?")


def price_day(text: str) -> datetime.date | None:
    """A price's date (YYYY, YYYY-MM or YYYY-MM-DD; a missing month or day counts as the first) as a
    day, None where it is not one (a shape PRICE_DATE refuses, or a month 13, a February 30)."""
    if not isinstance(text, str) or not PRICE_DATE.fullmatch(text):
        return None
    parts = [int(part) for part in text.split("-")] + [1, 1]
    try:
        return datetime.date(parts[0], parts[1], parts[2])
    except ValueError:
        return None


class ProfileError(ValueError):
    """A profile file is malformed; the message names the file, the field and what is expected."""


@dataclass(frozen=True)
class GpuProfile:
    """One GPU variant. Figures are per device package; absent figures are None (unknown)."""

    id: str
    family: str
    name: str
    vendor: str
    match: tuple[str, ...]
    path: Path
    architecture: str | None = None
    compute_capability: str | None = None
    gfx_target: str | None = None
    memory_bytes: int | None = None
    visible_memory_bytes: int | None = None  # what the driver reports (nvidia-smi memory.total)
    memory_bandwidth_bytes_s: float | None = None
    tdp_w: float | None = None
    sm_count: int | None = None
    l2_bytes: int | None = None
    devices_per_package: int = 1
    peak_flops: dict[str, float] = field(default_factory=dict)
    # What real kernels reach (measured: the best GEMM of a shape sweep, a streaming copy), per dtype;
    # empty where nobody measured it, and the speed model derates the datasheet by generation instead.
    achievable_flops: dict[str, float] = field(default_factory=dict)
    achievable_bandwidth_bytes_s: float | None = None
    # The per-op host issue cost and GPU kernel floor measured by `headroom calibrate` (seconds); None
    # where not calibrated, and the fitted constants apply.
    issue_s: float | None = None
    kernel_s: float | None = None
    calibration: dict[str, str] = field(default_factory=dict)  # provenance of an applied overlay
    sparse_flops: dict[str, float] = field(default_factory=dict)
    features: dict[str, bool] = field(default_factory=dict)
    interconnect: dict[str, Any] = field(default_factory=dict)
    usd_per_hour: float | None = None
    price_date: str | None = None
    price_source: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    unverified: tuple[str, ...] = ()

    def has(self, feature: str) -> bool:
        """Whether the profile declares `feature` (one of FEATURES)."""
        return bool(self.features.get(feature, False))

    def peak(self, dtype: str) -> float | None:
        """Dense peak FLOP/s for `dtype`, None where unknown (MFU is then empty, not wrong)."""
        return self.peak_flops.get(dtype)

    @property
    def generation(self) -> str:
        """The architecture generation (`ampere`, `hopper`, `cdna3`...): the first word of
        `architecture`, lower-cased; `unknown` where the profile has none."""
        return self.architecture.split()[0].lower() if self.architecture else "unknown"

    def per_device(self) -> GpuProfile:
        """The share of the package one process runs on. A package of several devices (MI250X: two
        GCDs, each its own GPU to software) divides its memory, bandwidth, peaks, power, units and
        price among them; `visible_memory_mib` is already per device."""
        n = self.devices_per_package
        if n == 1:
            return self

        def share(value, whole: bool = False):
            if value is None:
                return None
            return value // n if whole else value / n

        return dataclasses.replace(
            self, devices_per_package=1, memory_bytes=share(self.memory_bytes, whole=True),
            memory_bandwidth_bytes_s=share(self.memory_bandwidth_bytes_s),
            achievable_bandwidth_bytes_s=share(self.achievable_bandwidth_bytes_s),
            achievable_flops={k: v / n for k, v in self.achievable_flops.items()}, tdp_w=share(self.tdp_w),
            sm_count=share(self.sm_count, whole=True), l2_bytes=share(self.l2_bytes, whole=True),
            peak_flops={k: v / n for k, v in self.peak_flops.items()},
            sparse_flops={k: v / n for k, v in self.sparse_flops.items()}, usd_per_hour=share(self.usd_per_hour))

    @property
    def capacity_bytes(self) -> int | None:
        """The memory a process can be given: the driver's figure where known (ECC and driver
        reservations take 0.5-6% of the datasheet size), else the datasheet's."""
        return self.visible_memory_bytes or self.memory_bytes

    @property
    def cc_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)
