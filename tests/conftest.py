"""Shared test settings: a fixed thread count keeps CPU timings and numerics repeatable, and cells
are measured on the host CPU even where a GPU is present, so the suite checks the same thing on every
machine (the GPU paths have their own tests and benchmarks/gpu_check.sh)."""

import os

import pytest
import torch

from harness.profiles import LOCAL_DEVICE_ENV

torch.set_num_threads(1)
os.environ[LOCAL_DEVICE_ENV] = "cpu"  # inherited by the `headroom run` subprocesses tests start


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: without one they skip, saying so (`nox -s gpu-check` runs
    them on a GPU machine)."""
    if torch.cuda.is_available() and not torch.version.hip:
        return
    reason = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker): none here; `nox -s gpu-check` runs it on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)
