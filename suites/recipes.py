"""Named recipes: the guide's strategy by model size (claim C14) as stacks usable wherever a stack is.

- small-model (< 1 B parameters): mixed precision + activation checkpointing;
- mid-model (1-10 B): tensor parallelism + quantisation;
- large-model (> 10 B): 3D parallelism (data + tensor + pipeline) + expert parallelism.
A recipe naming a technique headroom does not implement yet is an `unsupported` row saying which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    techniques: tuple[str, ...]
    summary: str


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("small-model", ("amp-bf16", "checkpointing"), "guide C14, < 1B parameters: mixed precision + checkpointing"),
    Recipe("mid-model", ("tensor-parallel", "ptq-int8"), "guide C14, 1-10B: tensor parallelism + quantisation"),
    Recipe("large-model", ("data-parallel", "tensor-parallel", "pipeline-parallel", "expert-parallel"),
           "guide C14, > 10B: 3D parallelism + expert parallelism"),
)}
