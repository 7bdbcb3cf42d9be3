"""The workload contract: what a benchmarked model must provide.

A workload is a module-level object with a size table, a builder with random initialisation (no
downloads), a batch maker, a loss, the containers of its repeated blocks (so techniques such as
checkpointing can wrap them without knowing the model), and analytic FLOPs per sample for MFU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]

# Scales group sizes: `smoke` runs in seconds on a CPU (CI), `standard` holds the canonical sizes
# people quote, `large` holds sizes that mostly exist to be projected.
SCALES = ("smoke", "standard", "large")


@dataclass(frozen=True)
class SizeSpec:
    """One row of a workload's size table.

    Attributes:
        name: the id users type (`gpt2-124m`).
        scale: `smoke`, `standard` or `large`.
        config: the model's hyper-parameters (layers, hidden size, ...), passed to the builder.
        batch_size: the default batch for this size.
        seq_len: tokens per sample for language models, None for vision.
        image_size: pixels per side for vision models, None for language models.
        canonical_params: the published parameter count this size must reproduce, or None.
        canonical_tolerance: allowed relative error against `canonical_params` (0 means exact).
        canonical_source: where `canonical_params` comes from.
    """

    name: str
    scale: str
    config: Mapping[str, Any]
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    canonical_params: int | None = None
    canonical_tolerance: float = 0.0
    canonical_source: str = ""


@dataclass(frozen=True)
class Workload:
    """A benchmarked model with everything the harness needs to train, serve and account for it.

    Attributes:
        name: `resnet50`, `bert` or `gpt`.
        kind: `vision`, `encoder` or `decoder` (techniques check this, never the name).
        sizes: size id -> SizeSpec.
        build: size -> a freshly initialised nn.Module on the CPU, in float32.
        batch: (size, batch_size, generator) -> dict of input tensors on the CPU.
        loss: (model, batch) -> scalar training loss.
        forward: (model, batch) -> the inference output (logits).
        block_lists: model -> the nn.ModuleList / nn.Sequential containers of repeated blocks.
        forward_flops_per_sample: size -> analytic matmul/conv FLOPs of one forward pass per sample.
        train_flops_per_sample: size -> FLOPs of forward + backward per sample.
        accuracy_metric: name of the metric of its accuracy task (`top1`, `mlm-accuracy`, ...).
    """

    name: str
    kind: str
    sizes: Mapping[str, SizeSpec]
    build: Callable[[SizeSpec], nn.Module]
    batch: Callable[[SizeSpec, int, torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    forward: Callable[[nn.Module, Batch], torch.Tensor]
    block_lists: Callable[[nn.Module], list[nn.Module]]
    forward_flops_per_sample: Callable[[SizeSpec], float]
    train_flops_per_sample: Callable[[SizeSpec], float]
    accuracy_metric: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def size(self, name: str) -> SizeSpec:
        """The size called `name`; ValueError naming the valid ones otherwise."""
        try:
            return self.sizes[name]
        except KeyError:
            valid = ", ".join(self.sizes)
            raise ValueError(f"unknown size {name!r} for workload {self.name!r}; valid: {valid}") from None

    def sizes_at(self, scale: str) -> list[SizeSpec]:
        """The sizes that belong to `scale`."""
        return [s for s in self.sizes.values() if s.scale == scale]

    def tokens_per_sample(self, size: SizeSpec) -> int | None:
        """Tokens one sample carries (language models), None for vision."""
        return size.seq_len


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once, as published counts do)."""
    return sum(p.numel() for p in model.parameters())
