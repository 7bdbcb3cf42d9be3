"""Shared test fixtures: a fixed thread count keeps CPU timings and numerics repeatable."""

import torch

torch.set_num_threads(1)
