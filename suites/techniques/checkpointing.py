"""Activation checkpointing (guide T5): keep only each block's input, recompute its inside in backward.

Activation memory drops from all intermediate tensors of every block to one tensor per block, at the
price of one extra forward pass (about +33% FLOPs when backward costs twice the forward; Chen et al.
2016, arXiv:1604.06174). Each repeated block is wrapped, as torchtitan does, with PyTorch's
non-reentrant checkpoint wrapper.

Selective checkpointing keeps the outputs of the expensive ops (matmuls, attention, convolutions) and
recomputes only the cheap ones (norms, activations, elementwise), so it saves less memory than full
checkpointing but costs almost no extra FLOPs (Korthikanti et al. 2022, arXiv:2205.05198; PyTorch's
`torch.utils.checkpoint.create_selective_checkpoint_contexts`, as in torchtitan's op-level SAC).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from suites.techniques.base import Phase, Run, Technique, Unsupported, choice_option, train_only


def _wrap_blocks(run: Run, **checkpoint_kwargs) -> int:
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks to checkpoint")
    wrapped = 0
    for container in containers:
        for index, block in enumerate(list(container)):
            container[index] = checkpoint_wrapper(block, preserve_rng_state=True, **checkpoint_kwargs)
            wrapped += 1
    return wrapped


def _note_batch_norm(run: Run) -> None:
    # Recomputing a block re-runs its batch norms in training mode, which updates their running
    # statistics a second time; the step's loss and gradients are unaffected.
    if any(isinstance(m, _BatchNorm) for m in run.model.modules()):
        run.notes.append("batch norm is recomputed, so its running statistics get a second update per step")


def _apply(run: Run) -> None:
    run.notes.append(f"checkpointed {_wrap_blocks(run)} blocks")
    _note_batch_norm(run)


# Ops whose outputs selective checkpointing keeps: the matmuls, every fused attention kernel (flash,
# memory-efficient, cuDNN, the CPU flash kernel, the out-of-tree backend hook) and convolutions.
# By default all matmuls are kept, the plain "save compute-bound, recompute memory-bound" rule; with
# mm=alternate every second one is recomputed, as torchtitan does. Looked up by name: not every torch has all.
_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_OP_NAMES
                      if hasattr(torch.ops.aten, name))


# The matmuls torchtitan's alternating policy counts: a linear layer is `mm` without a bias, `addmm` with one.
_LINEAR_OPS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
MM_POLICIES = ("all", "alternate")


def _policy(alternate: bool):
    """A fresh policy per checkpointed call. `alternate`: torchtitan's op-level SAC, which also recomputes
    every second linear matmul (torchtitan/distributed/activation_checkpoint.py `_get_custom_policy`),
    counted apart in the forward and the recomputation so that both pick the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if alternate and op in _LINEAR_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _apply_selective(run: Run, mm: str) -> None:
    # A fresh pair of contexts per checkpointed call: they hold that call's saved outputs.
    wrapped = _wrap_blocks(run, context_fn=lambda: create_selective_checkpoint_contexts(_policy(mm == "alternate")))
    kept = "every second linear matmul" if mm == "alternate" else "matmul"
    run.notes.append(f"selectively checkpointed {wrapped} blocks: {kept}/attention/conv outputs kept, "
                     "other ops recomputed")
    _note_batch_norm(run)


def _selective(mm: str = "all") -> Technique:
    base = Technique(
        id="selective-checkpointing" + (f":mm={mm}" if mm != "all" else ""), phase=Phase.CHECKPOINT,
        changes_numerics=False, guide="T5",
        summary="per block, keep matmul/attention/conv outputs and recompute the cheap ops in backward "
                "(mm=alternate: recompute every second matmul too, as torchtitan's op-level SAC)",
        check=train_only("selective-checkpointing"), apply=lambda run: _apply_selective(run, mm),
        exclusive="checkpointing")
    return replace(base, configure=lambda given: _selective(
        choice_option("selective-checkpointing", "mm", MM_POLICIES, given)))


CHECKPOINTING = Technique(
    id="checkpointing", phase=Phase.CHECKPOINT, changes_numerics=False, guide="T5",
    summary="recompute each block's activations in backward (per-block checkpointing)",
    check=train_only("checkpointing"), apply=_apply, exclusive="checkpointing",
    # Declared before the stack applies: tensor parallelism, applied earlier, counts the collectives the
    # recomputed blocks run again.
    declare=lambda run: setattr(run, "recomputed", True))

SELECTIVE_CHECKPOINTING = _selective()

TECHNIQUES = (CHECKPOINTING, SELECTIVE_CHECKPOINTING)
