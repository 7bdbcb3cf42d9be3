"""Provenance and environment: what ran where (device, driver, torch, CUDA, NVML, git revision)."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def git_sha() -> str | None:
    """The checkout's commit (with `-dirty` when it has uncommitted changes), None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{sha}-dirty" if dirty else sha
    except (OSError, subprocess.SubprocessError):
        return None


def nvml_info() -> dict[str, str | None]:
    """NVML's view (driver version, device count) or why it is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # NVML raises its own error types, or the library is missing
        return {"nvml": f"unavailable ({type(exc).__name__}: {exc})".strip(), "driver_version": None}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        return {"nvml": f"available, {count} device(s)", "driver_version": str(driver)}
    except Exception as exc:  # a query can fail after a successful init (driver/library mismatch)
        return {"nvml": f"query failed ({type(exc).__name__}: {exc})".strip(), "driver_version": None}
    finally:
        pynvml.nvmlShutdown()


def environment() -> dict[str, str | None]:
    """Everything the `env` command and the report's provenance section show."""
    cuda = torch.cuda.is_available()
    info: dict[str, str | None] = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "cpu_count": str(os.cpu_count()),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if cuda else None,
        "cuda_available": str(cuda),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_sha": git_sha(),
    }
    info.update(nvml_info())
    from harness.measure.nvml import open_source

    source, why = open_source(torch.device("cuda"))
    info["nvml_sampling"] = "power, energy, clocks and process memory sampled during timed steps" if source else why
    return info
