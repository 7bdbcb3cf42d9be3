"""Optimizer implementations (the optimizer-state side of what practitioners fine-tune with).

`optim-fused` runs AdamW's whole update as one fused kernel per chunk of parameters (`fused=True`,
PyTorch's `_fused_adamw_`, on CUDA, ROCm and, since torch 2.4, the CPU) instead of the default
multi-tensor `foreach` path, whose step allocates a temporary the size of every parameter (the square
root of the second moments) and launches one kernel per elementwise op: same state bytes, less
temporary memory and fewer kernels (PyTorch's torch.optim documentation, "Algorithms").

`optim-8bit` and `optim-4bit` keep Adam's two moments block-wise quantised (Dettmers et al. 2021,
arXiv:2110.02861; Li et al. 2023, arXiv:2309.01507 for 4-bit): each block of weights' moments shares one
fp32 scale, and the step dequantises, updates and requantises them in one compiled kernel per parameter
(torchao's AdamW8bit / AdamW4bit). Moments take 2 bytes (8-bit) or 1 byte (4-bit) per parameter instead
of 8; torchao keeps parameters under 4,096 values, or not divisible into blocks, in fp32 state.
"""

from __future__ import annotations

import importlib.util

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from suites.techniques.base import Phase, Run, Technique, Unsupported, default_optimizer, train_only


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



def low_bit_adamw(bits: int):
    """An optimizer factory for torchao's AdamW8bit or AdamW4bit with the default optimizer's settings."""

    def build(params) -> torch.optim.Optimizer:
        from torchao.optim import AdamW4bit, AdamW8bit, subclass_4bit, subclass_8bit

        # The quantisation maps are computed once, with `.tolist()`: never inside a fake-tensor trace.
        with unset_fake_temporarily():
            for module in (subclass_8bit, subclass_4bit):
                module.get_qmap_signed(), module.get_qmap_unsigned()
        reference = default_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults
        kind = AdamW8bit if bits == 8 else AdamW4bit
        return kind(params, lr=reference["lr"], weight_decay=reference["weight_decay"], betas=reference["betas"],
                    eps=reference["eps"])

    return build


def _low_bit_check(bits: int):
    def check(profile, workload, mode: str) -> str | None:
        reason = train_only(f"optim-{bits}bit")(profile, workload, mode)
        if reason:
            return reason
        if importlib.util.find_spec("torchao") is None:
            return f"optim-{bits}bit is torchao's AdamW{bits}bit, and torchao is not installed (pip install torchao)"
        return None

    return check


def _apply_low_bit(bits: int):
    def apply(run: Run) -> None:
        if run.optimizer_factory is not default_optimizer:
            raise Unsupported(f"optim-{bits}bit replaces the optimizer, which another technique of the stack "
                              "already wraps")
        run.optimizer_factory = low_bit_adamw(bits)
        run.notes.append(f"AdamW{bits}bit (torchao): both moments in {bits}-bit blocks with an fp32 scale each")

    return apply


OPTIM_LOW_BIT = tuple(
    Technique(id=f"optim-{bits}bit", phase=Phase.STEP, changes_numerics=True,
              summary=f"AdamW with both moments block-wise quantised to {bits} bits (torchao's AdamW{bits}bit)",
              check=_low_bit_check(bits), apply=_apply_low_bit(bits), exclusive="optimizer")
    for bits in (8, 4))

TECHNIQUES = (OPTIM_FUSED, *OPTIM_LOW_BIT)
