"""Shared test settings: a fixed thread count keeps CPU timings and numerics repeatable, and cells
are measured on the host CPU even where a GPU is present, so the suite checks the same thing on every
machine (the GPU paths have their own tests and benchmarks/gpu_check.sh)."""

import os

import torch

from harness.profiles import LOCAL_DEVICE_ENV

torch.set_num_threads(1)
os.environ[LOCAL_DEVICE_ENV] = "cpu"  # inherited by the `headroom run` subprocesses tests start
