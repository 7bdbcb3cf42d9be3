"""Activation checkpointing (guide T5): keep only each block's input, recompute its inside in backward.

Activation memory drops from all intermediate tensors of every block to one tensor per block, at the
price of one extra forward pass (about +33% FLOPs when backward costs twice the forward; Chen et al.
2016, arXiv:1604.06174). Each repeated block is wrapped, as torchtitan does, with PyTorch's
non-reentrant checkpoint wrapper.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from suites.techniques.base import Phase, Run, Technique, Unsupported, train_only


def _apply(run: Run) -> None:
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks to checkpoint")
    wrapped = 0
    for container in containers:
        for index, block in enumerate(list(container)):
            container[index] = checkpoint_wrapper(block, preserve_rng_state=True)
            wrapped += 1
    run.notes.append(f"checkpointed {wrapped} blocks")


CHECKPOINTING = Technique(
    id="checkpointing", phase=Phase.CHECKPOINT, changes_numerics=False, guide="T5",
    summary="recompute each block's activations in backward (per-block checkpointing)",
    check=train_only("checkpointing"), apply=_apply, exclusive="checkpointing")

TECHNIQUES = (CHECKPOINTING,)
