"""Low-rank factorisation (guide T3): replace a weight W [out, in] by two thin factors of rank r.

Truncated SVD gives the best rank-r approximation W ~ (U_r S_r^1/2)(S_r^1/2 V_r^T) in Frobenius and
spectral norm (Eckart-Young); a layer in->out becomes in->r->out, storing r(in + out) weights instead
of in*out (Denton et al. 2014, arXiv:1404.0736; Sainath et al. 2013 for the SVD-initialised form).
Every nn.Linear inside the repeated blocks is factorised, and ResNet's 1x1 convolutions too: a 1x1
conv is a linear map over channels applied at every pixel, so it factors exactly like a Linear. 3x3
convs are kept: their kernel is not one matrix, and factorising it needs a spatial decomposition
(Jaderberg et al. 2014) that is a different technique.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique, Unsupported, always

# How the rank is chosen: "ratio" keeps RANK_RATIO of min(in, out) singular values; "energy" keeps
# the fewest singular values whose squares sum to ENERGY of the total (the spectrum's "energy").
RANK_MODES = ("ratio", "energy")
DEFAULT_RANK_MODE = "ratio"
DEFAULT_RANK_RATIO = 0.25
DEFAULT_ENERGY = 0.90


def choose_rank(singular_values: torch.Tensor, mode: str | None = None, ratio: float | None = None,
                energy: float | None = None) -> int:
    """The rank to keep for a matrix with these singular values (descending), at least 1."""
    mode = mode or DEFAULT_RANK_MODE
    full = singular_values.numel()
    if mode == "ratio":
        ratio = DEFAULT_RANK_RATIO if ratio is None else ratio
        if not 0 < ratio <= 1:
            raise ValueError(f"rank ratio must be in (0, 1], got {ratio}")
        return max(1, int(ratio * full))
    if mode == "energy":
        energy = DEFAULT_ENERGY if energy is None else energy
        if not 0 < energy <= 1:
            raise ValueError(f"energy fraction must be in (0, 1], got {energy}")
        squares = singular_values.double().square()
        cumulative = squares.cumsum(0) / squares.sum()
        # The first index whose cumulative energy reaches the target, as a count of values kept.
        return min(full, int(torch.searchsorted(cumulative, torch.tensor(energy, dtype=cumulative.dtype))) + 1)
    raise ValueError(f"unknown rank mode {mode!r}; valid: {', '.join(RANK_MODES)}")


def _split(svd, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rank, in], B [out, rank]) with B @ A the best rank-`rank` approximation of W = U S Vh."""
    u, s, vh = svd
    root = s[:rank].sqrt()  # split S evenly so both factors have comparable scale
    return (root[:, None] * vh[:rank]).to(dtype), (u[:, :rank] * root).to(dtype)


def _matrix(module: nn.Module) -> torch.Tensor | None:
    """The weight as an [out, in] matrix for Linears and 1x1 convs; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.weight
    if isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1:
        return module.weight.flatten(1)
    return None


def _factorised(module: nn.Module, first: torch.Tensor, second: torch.Tensor) -> nn.Sequential:
    """in->r->out modules holding the factors; the bias (and a conv's stride/padding) carry over."""
    rank = first.shape[0]
    bias = module.bias is not None
    # Created where the weight lives (no later `.to()`, which fake-tensor tracing cannot swap).
    place = {"device": module.weight.device, "dtype": module.weight.dtype}
    if isinstance(module, nn.Linear):
        down = nn.Linear(module.in_features, rank, bias=False, **place)
        up = nn.Linear(rank, module.out_features, bias=bias, **place)
        down.weight.data.copy_(first)
        up.weight.data.copy_(second)
    else:
        # Stride and zero padding act on the pixels, before the channel map, so they stay on the first
        # conv: padded pixels are zero after it too, and the second conv maps them to its bias as before.
        down = nn.Conv2d(module.in_channels, rank, 1, stride=module.stride, padding=module.padding, bias=False,
                         **place)
        up = nn.Conv2d(rank, module.out_channels, 1, bias=bias, **place)
        down.weight.data.copy_(first[:, :, None, None])
        up.weight.data.copy_(second[:, :, None, None])
    if bias:
        up.bias.data.copy_(module.bias.detach())
    return nn.Sequential(down, up)


def factorise_blocks(containers, mode: str | None = None, ratio: float | None = None,
                     energy: float | None = None) -> tuple[Counter, int]:
    """Factorise every eligible layer of the blocks in place.

    Returns ((rank, full rank) -> layers factorised, layers kept because rank r would not save weights:
    r(in + out) >= in * out, which the energy mode can ask for on a flat spectrum).
    """
    seen: set[int] = set()
    ranks: Counter = Counter()
    kept = 0
    for container in containers:
        for block in container:
            if id(block) in seen:  # a block shared across layers is factorised once
                continue
            seen.add(id(block))
            targets = [(parent, name, child) for parent in block.modules()
                       for name, child in parent.named_children() if _matrix(child) is not None]
            for parent, name, child in targets:
                weight = _matrix(child)
                out_features, in_features = weight.shape
                svd = torch.linalg.svd(weight.detach().double(), full_matrices=False)
                rank = choose_rank(svd.S, mode, ratio, energy)
                if rank * (in_features + out_features) >= in_features * out_features:
                    kept += 1
                    continue
                first, second = _split(svd, rank, weight.dtype)
                setattr(parent, name, _factorised(child, first, second))
                ranks[(rank, min(in_features, out_features))] += 1
    return ranks, kept


def _apply(run: Run) -> None:
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks to factorise")
    before = sum(p.numel() for p in run.model.parameters())
    ranks, kept = factorise_blocks(containers)
    if not ranks:
        raise Unsupported(f"no layer of {run.workload.name}'s blocks gets smaller at the chosen rank "
                          f"({DEFAULT_RANK_MODE} mode)")
    after = sum(p.numel() for p in run.model.parameters())
    rule = (f"{DEFAULT_RANK_RATIO:.0%} of min(in, out)" if DEFAULT_RANK_MODE == "ratio"
            else f"{DEFAULT_ENERGY:.0%} of the singular-value energy")
    detail = ", ".join(f"rank {r} of {full} for {n} layer{'s' * (n != 1)}" for (r, full), n in sorted(ranks.items()))
    skipped = f"; {kept} layers kept dense (rank too high to save weights)" if kept else ""
    scope = "; 1x1 convs factorised, 3x3 kept" if run.workload.traits.convolutional else ""
    run.notes.append(f"low-rank SVD, rank = {rule}: {detail}{skipped}{scope}; "
                     f"{before:,} -> {after:,} parameters")


LOW_RANK = Technique(
    id="low-rank", phase=Phase.STRUCTURE, changes_numerics=True, guide="T3",
    summary=f"truncated-SVD factorisation of the blocks' Linear / 1x1-conv weights "
            f"(rank {DEFAULT_RANK_RATIO:.0%} of min(in, out))",
    check=always, apply=_apply, post_training=True, fine_tune=True)

TECHNIQUES = (LOW_RANK,)
