"""Dynamic sparsity (guide T12): keep only the top-k MLP activations of each token, a pattern that follows
the input (the Top-k Transformer of Li et al. 2023, arXiv:2210.06313). With dense kernels the zeros are
still stored and multiplied, so it changes numerics but saves neither memory nor time here.
"""

from __future__ import annotations

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique, Unsupported
from suites.techniques.sparsity import block_modules, replace_modules

# Fraction of the MLP's hidden units kept per token.
TOPK_FRACTION = 0.1


class TopKActivation(nn.Module):
    """Keep the k largest-magnitude entries along the last dimension (each token's hidden units), zero the
    rest; k = max(1, round(fraction * width)). Gradients flow through the kept entries only."""

    def __init__(self, fraction: float = TOPK_FRACTION):
        super().__init__()
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def k(self, width: int) -> int:
        return max(1, round(self.fraction * width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        keep = h.detach().abs().topk(self.k(h.shape[-1]), dim=-1, sorted=False).indices
        mask = torch.zeros_like(h, dtype=torch.bool).scatter_(-1, keep, True)
        return torch.where(mask, h, 0)  # saves the bool mask (1 byte per unit) for backward

    def extra_repr(self) -> str:
        return f"fraction={self.fraction}"


class TopKInput(nn.Module):
    """The MLP's down projection, reading the activation through a top-k filter."""

    def __init__(self, linear: nn.Module, fraction: float = TOPK_FRACTION):
        super().__init__()
        self.topk = TopKActivation(fraction)
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.topk(x))


def _check_dynamic(profile, workload, mode) -> str | None:
    if workload.traits.convolutional:
        return ("dynamic-sparsity keeps the top-k hidden units of a transformer MLP per token; "
                f"{workload.name}'s blocks are convolutions, with no MLP")
    return None


def _apply_dynamic(run: Run) -> None:
    # The block's contracting Linear layers (in_features > out_features) are the MLP down projections, whose
    # input is the activation after the nonlinearity (GELU, or SwiGLU's gated product); attention's
    # projections never contract. This finds them without knowing the model's attribute names.
    downs = [m for _, m in block_modules(run, nn.Linear) if m.in_features > m.out_features]
    if not downs:
        raise Unsupported(f"{run.workload.name} has no MLP down projection (Linear with in > out) in its blocks")
    replace_modules(run.model, {id(m): TopKInput(m) for m in downs})
    widths = sorted({m.in_features for m in downs})
    ks = ", ".join(f"{TopKActivation().k(w)} of {w}" for w in widths)
    run.notes.append(f"top-k activation sparsity before {len(downs)} MLP down projections: {ks} hidden units "
                     "kept per token")
    run.notes.append("dense kernels: the zeroed activations are still stored and multiplied, so this saves "
                     "no memory or time here" + ("; backward keeps a bool mask per MLP activation"
                                                 if run.mode == "train" else ""))


DYNAMIC_SPARSITY = Technique(
    id="dynamic-sparsity", phase=Phase.COMPRESS, changes_numerics=True, guide="T12",
    summary=f"keep the top {TOPK_FRACTION:.0%} MLP activations per token (input-dependent sparsity)",
    check=_check_dynamic, apply=_apply_dynamic)

TECHNIQUES = (DYNAMIC_SPARSITY,)
