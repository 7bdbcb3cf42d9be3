"""Optimizer implementations (the optimizer-state side of what practitioners fine-tune with).

`optim-fused` runs AdamW's whole update as one fused kernel per chunk of parameters (`fused=True`,
PyTorch's `_fused_adamw_`, on CUDA, ROCm and, since torch 2.4, the CPU) instead of the default
multi-tensor `foreach` path, whose step allocates a temporary the size of every parameter (the square
root of the second moments) and launches one kernel per elementwise op: same state bytes, less
temporary memory and fewer kernels (PyTorch's torch.optim documentation, "Algorithms").
"""

from __future__ import annotations

import torch

from suites.techniques.base import Phase, Run, Technique, default_optimizer, train_only


def fused_adamw(params) -> torch.optim.Optimizer:
    """AdamW with the default optimizer's settings, fused."""
    reference = default_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults
    return torch.optim.AdamW(params, lr=reference["lr"], weight_decay=reference["weight_decay"],
                             betas=reference["betas"], eps=reference["eps"], fused=True)


def _apply_fused(run: Run) -> None:
    if run.optimizer_factory is not default_optimizer:
        # Another technique wraps the optimizer (sparsity masks re-applied after each step): it keeps its
        # wrapper around the fused one.
        run.notes.append("optim-fused: the optimizer another technique built is kept")
        return
    run.optimizer_factory = fused_adamw
    run.notes.append("AdamW fused=True: one fused kernel per chunk of parameters, no step-sized temporary")


# Fused and foreach AdamW do the same arithmetic in another order: the same state, not the same bits.
OPTIM_FUSED = Technique(
    id="optim-fused", phase=Phase.STEP, changes_numerics=True,
    summary="AdamW fused=True: the update in one kernel, without the foreach step's parameter-sized temporary",
    check=train_only("optim-fused"), apply=_apply_fused, exclusive="optimizer")

TECHNIQUES = (OPTIM_FUSED,)
