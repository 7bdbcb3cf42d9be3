"""Bytes a rank really sends in a step: every collective and point-to-point op the step dispatches, counted
as the ring algorithms the projection and the techniques' formulas assume.

PyTorch's own CommDebugMode (torch.distributed.tensor.debug) intercepts the same ops with a dispatch mode but
counts calls, not bytes; this mode sums their tensors' bytes. Ring costs per rank, for a buffer of B bytes
over n ranks (Patarasuk & Yuan 2009; NCCL's tests/doc/PERFORMANCE.md "bus bandwidth"): all-reduce
2 (n - 1) / n B, all-gather and reduce-scatter (n - 1) / n of the whole buffer, all-to-all (n - 1) / n of
the input, broadcast (n - 1) / n B (forwarded along the ring), send B.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _is_dtensor(kind: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(kind, DTensor)


def _group_size(group) -> int:
    """Ranks of a c10d op's process group (a boxed ProcessGroup) or a functional op's group name."""
    import torch.distributed as dist

    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.ProcessGroup.unbox(group).size()


def _share(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


# op name -> (index of the group argument, bytes sent per rank from (args, n)).
_C10D = {
    "allreduce_": (1, lambda a, n: 2 * _share(n) * _bytes(a[0])),
    "allreduce_coalesced_": (1, lambda a, n: 2 * _share(n) * _bytes(a[0])),
    "_allgather_base_": (2, lambda a, n: _share(n) * _bytes(a[0])),
    "allgather_": (2, lambda a, n: _share(n) * _bytes(a[0])),
    "allgather_coalesced_": (2, lambda a, n: _share(n) * _bytes(a[0])),
    "allgather_into_tensor_coalesced_": (2, lambda a, n: _share(n) * _bytes(a[0])),
    "_reduce_scatter_base_": (2, lambda a, n: _share(n) * _bytes(a[1])),
    "reduce_scatter_": (2, lambda a, n: _share(n) * _bytes(a[1])),
    "reduce_scatter_tensor_coalesced_": (2, lambda a, n: _share(n) * _bytes(a[1])),
    "alltoall_base_": (2, lambda a, n: _share(n) * _bytes(a[1])),
    "alltoall_": (2, lambda a, n: _share(n) * _bytes(a[1])),
    "broadcast_": (1, lambda a, n: _share(n) * _bytes(a[0])),
    "send": (1, lambda a, n: _bytes(a[0])),
}
# Functional collectives (DTensor's redistributions, tensor parallelism): the group name is the last
# positional argument; all-gather's input is 1/n of what it gathers.
_FUNCTIONAL = {
    "all_reduce": lambda a, n: 2 * _share(n) * _bytes(a[0]),
    "all_reduce_": lambda a, n: 2 * _share(n) * _bytes(a[0]),
    "all_reduce_coalesced": lambda a, n: 2 * _share(n) * _bytes(a[0]),
    "all_gather_into_tensor": lambda a, n: (n - 1) * _bytes(a[0]),
    "all_gather_into_tensor_coalesced": lambda a, n: (n - 1) * _bytes(a[0]),
    "reduce_scatter_tensor": lambda a, n: _share(n) * _bytes(a[0]),
    "reduce_scatter_tensor_coalesced": lambda a, n: _share(n) * _bytes(a[0]),
    "all_to_all_single": lambda a, n: _share(n) * _bytes(a[0]),
    "broadcast": lambda a, n: _share(n) * _bytes(a[0]),
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class CommVolumeMode(TorchDispatchMode):
    """Counts, while active, the bytes this rank sends (`sent`, by op name in `by_op`) in ring terms."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def sent(self) -> int:
        return round(sum(self.by_op.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A mode sees an op before a tensor subclass does, and what it runs is out of its sight: DTensor's op
        # handlers (loss_parallel's all-reduces, sharding propagation's redistributions) would send unseen.
        # Handing DTensor ops back lets DTensor run them and dispatch its collectives here, as PyTorch's own
        # CommDebugMode does (torch/distributed/tensor/debug/_comm_mode.py).
        if any(_is_dtensor(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and name in _C10D:
            where, cost = _C10D[name]
            self.by_op[name] += cost(args, _group_size(args[where]))
        elif namespace in _FUNCTIONAL_NAMESPACES and name in _FUNCTIONAL:
            group = kwargs.get("group_name", args[-1])
            self.by_op[name] += _FUNCTIONAL[name](args, _group_size(group))
        return func(*args, **kwargs)


def bytes_sent(one_step) -> tuple[int, dict[str, int]]:
    """Run `one_step()` once and return the bytes this rank sent in it, total and by op."""
    with CommVolumeMode() as mode:
        one_step()
    return mode.sent, {name: round(value) for name, value in mode.by_op.items()}
