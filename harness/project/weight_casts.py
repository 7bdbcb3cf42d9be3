"""Autocast's copies of the weights: under mixed precision every matmul's fp32 weight is cast to the autocast
dtype on its first use in a forward (autocast caches the cast for the rest of the forward), and autograd keeps
the copy for the backward's input gradient. Those copies are live at the forward's end beside the
activations, so a traced step files them under activations; this counts them so a row can say how much of
its activations they are (gpt2-124m amp-bf16: the weights' size at 2 bytes each, whatever the batch)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class WeightCasts(TorchDispatchMode):
    """Records each cast of a parameter (`aten._to_copy` whose input is one of `parameters`) while `counting`;
    `live_bytes()` is what those copies still hold (rounded as the allocator rounds): what the backward kept.
    Casts made where a checkpointed region recomputes its forward are not counted (`counting` is off there)."""

    def __init__(self, parameters, rounding: int = 1) -> None:
        super().__init__()
        self._parameter_ids = {id(p) for p in parameters}
        self._rounding = rounding
        self._copies: dict[int, tuple[weakref.ref, int]] = {}
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (self.counting and func is torch.ops.aten._to_copy.default and args
                and id(args[0]) in self._parameter_ids and isinstance(out, torch.Tensor)):
            try:
                storage = out.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) holds no storage of its own
                return out
            size = -(-storage.nbytes() // self._rounding) * self._rounding
            self._copies[id(storage)] = (weakref.ref(storage), size)
        return out

    def live_bytes(self) -> int:
        """Bytes of the recorded copies still alive now."""
        return sum(size for ref, size in self._copies.values() if ref() is not None)
