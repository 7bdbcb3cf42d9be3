"""ADDING.md's example workload, in one file: a residual MLP classifier on random features.

Nothing in harness/ knows it: what techniques and projection need is declared in its `Traits`
(repeated blocks of one shape, the depth key, the MLP's module roles for pruning).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from suites.workloads.base import ANY_SCALE, Batch, MlpRoles, SizeSpec, Traits, Workload


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))): the names `up` and `down` are what the MLP roles declare."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, features: int, width: int, hidden: int, n_layer: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(n_layer))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _config(n_layer: int) -> dict:
    return {"features": 64, "width": 128, "hidden": 512, "n_layer": n_layer, "classes": 10}


SIZES = {name: SizeSpec(name, ANY_SCALE, _config(layers), batch_size=16)
         for name, layers in (("mlp-4", 4), ("mlp-12", 12))}


def build(size: SizeSpec) -> nn.Module:
    return ResidualMLP(**size.config)


def make_batch(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    return {"x": torch.randn(batch_size, size.config["features"], generator=generator),
            "y": torch.randint(0, size.config["classes"], (batch_size,), generator=generator)}


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["x"])


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(model, batch), batch["y"])


def forward_flops_per_sample(size: SizeSpec) -> float:
    c = size.config
    per_block = 2 * c["width"] * c["hidden"] * 2  # up and down, 2 FLOPs per multiply-add
    return float(2 * c["features"] * c["width"] + c["n_layer"] * per_block + 2 * c["width"] * c["classes"])


WORKLOAD = Workload(
    name="residual-mlp", kind="classifier", sizes=SIZES, build=build, batch=make_batch, loss=loss,
    forward=forward, block_lists=lambda model: [model.blocks], forward_flops_per_sample=forward_flops_per_sample,
    # Every input needs a gradient only from the first Linear on: backward is ~2x forward.
    train_flops_per_sample=lambda size: 3 * forward_flops_per_sample(size), accuracy_metric="top1",
    traits=Traits(uniform_blocks=True, depth_key="n_layer", mlp=MlpRoles(up="up", down="down")))
