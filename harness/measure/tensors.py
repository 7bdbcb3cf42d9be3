"""Where memory goes, from the run's real tensors: parameters, gradients and optimizer state.

Bytes are counted per unique storage, so tied or shared weights count once (as the allocator sees
them) and views count nothing extra. Activations are not tensors one can enumerate after the fact:
they are measured as the live bytes a forward pass adds (see memory.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    return storage_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int | None:
    if optimizer is None:
        return None
    return storage_bytes(value for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor))
