"""Where memory goes, from the run's real tensors: parameters, gradients and optimizer state.

Bytes are counted per unique storage, so tied or shared weights count once (as the allocator sees
them) and views count nothing extra. Activations are not tensors one can enumerate after the fact:
they are measured as the live bytes a forward pass adds (see memory.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def leaves(tensor: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors that hold a tensor's data: itself, or, for wrapper subclasses such as
    torchao's quantized weights (int8 data + scales), the inner tensors they flatten to. A sharded
    DTensor (FSDP2, tensor parallelism) holds this rank's shard: its local tensor."""
    if _is_dtensor(tensor):
        yield tensor.to_local()
    elif is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from leaves(getattr(tensor, name))
    else:
        yield tensor


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take, through wrapper subclasses (quantised states and weights);
    unlike storage_bytes it works on fake tensors, whose storages have no addresses."""
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves(tensor))


def storage_bytes(tensors: Iterable[torch.Tensor], where: str | None = None) -> int:
    """Total bytes of the distinct storages behind `tensors`; `where` "host" counts those in host memory
    only, "device" the others (an accelerator's), None all of them."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        for leaf in leaves(tensor):
            if leaf.device.type == "meta" or (where is not None and (leaf.device.type == "cpu") != (where == "host")):
                continue
            storage = leaf.untyped_storage()
            seen[(leaf.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def parameter_bytes(model: nn.Module, where: str | None = None) -> int:
    """The model's state: parameters and buffers (int8 weights stored as buffers count here too)."""
    return storage_bytes([*model.parameters(), *model.buffers()], where)


def gradient_bytes(model: nn.Module, where: str | None = None) -> int:
    return storage_bytes((p.grad for p in model.parameters() if p.grad is not None), where)


def holding_state(optimizer):
    """The optimizer whose `state` holds the moments: ZeRO-1's wrapper (ZeroRedundancyOptimizer) keeps this
    rank's shard in the optimizer it wraps (`.optim`); any other holds its own."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, where: str | None = None) -> int | None:
    if optimizer is None:
        return None
    optimizer = holding_state(optimizer)
    if hasattr(optimizer, "param_d2h_map"):  # torchao's CPU offload: only its small parameters' state is here
        optimizer = optimizer.d_opt
        if optimizer is None:
            return 0
    return storage_bytes((value for state in optimizer.state.values() for value in state.values()
                          if isinstance(value, torch.Tensor)), where)
