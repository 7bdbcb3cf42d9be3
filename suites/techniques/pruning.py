"""Structured pruning (guide T4): remove whole attention heads, MLP neurons and conv channels.

Unlike unstructured pruning, the model really gets smaller and stays dense: the weight tensors are
rebuilt with fewer rows and columns, so parameters, gradients, optimizer state and activations all
shrink without sparse kernels. Heads and neurons are ranked by the L2 norm of all weights that belong
to them (a head's q, k and v rows and its output-projection columns; a neuron's up/gate rows and its
down-projection column), a weight-only stand-in for Michel et al.'s gradient-based head importance
(2019, "Are Sixteen Heads Really Better than One?", arXiv:1905.10650). ResNet bottlenecks lose output
channels of their two inner convs, ranked by each filter's L1 norm as in Li et al. 2017 ("Pruning
Filters for Efficient ConvNets", arXiv:1608.08710); block outputs keep their width, so the residual
additions still line up.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique, Unsupported
from suites.workloads.base import AttentionRoles, ConvRoles, MlpRoles, Traits

# Fractions removed from every block: attention heads (at least one head is kept), MLP neurons, and
# the output channels of a ResNet bottleneck's 1x1-reduce and 3x3 convs.
DEFAULT_HEAD_FRACTION = 0.25
DEFAULT_NEURON_FRACTION = 0.25
DEFAULT_CHANNEL_FRACTION = 0.25

Layer = nn.Linear | nn.Conv2d
# Default roles for the functions below (the workloads declare their own in Traits).
FUSED_ATTENTION, GATED_MLP, BOTTLENECK = AttentionRoles(), MlpRoles(gate="gate"), ConvRoles()


def _leaves(module: nn.Module) -> tuple[Layer, Layer]:
    """(first, last) dense layer of a prunable module: a Linear/Conv2d, or a two-layer low-rank factor."""
    if isinstance(module, Layer):
        return module, module
    if (isinstance(module, nn.Sequential) and len(module) == 2
            and all(isinstance(m, Layer) for m in module)):
        return module[0], module[1]
    raise Unsupported(f"structured-pruning rebuilds dense nn.Linear / nn.Conv2d layers; found "
                      f"{type(module).__name__}")


def _matrix(module: nn.Module) -> torch.Tensor:
    """The effective weight as [out, in * kernel]: the product of the factors for a low-rank pair."""
    first, last = _leaves(module)
    if first is last:
        return first.weight.detach().flatten(1)
    return last.weight.detach().flatten(1) @ first.weight.detach().flatten(1)


def _rebuild(layer: Layer, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> Layer:
    """A copy of `layer` keeping only output rows `rows` and input columns `cols` (None: all)."""
    weight = layer.weight.detach()
    if rows is not None:
        weight = weight.index_select(0, rows)
    if cols is not None:
        weight = weight.index_select(1, cols)
    bias = layer.bias is not None
    kwargs = dict(bias=bias, device=weight.device, dtype=weight.dtype)
    if isinstance(layer, nn.Linear):
        new = nn.Linear(weight.shape[1], weight.shape[0], **kwargs)
    else:
        if layer.groups != 1:
            raise Unsupported(f"structured-pruning handles ungrouped convs; found groups={layer.groups}")
        new = nn.Conv2d(weight.shape[1], weight.shape[0], layer.kernel_size, stride=layer.stride,
                        padding=layer.padding, dilation=layer.dilation, **kwargs)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias:
            b = layer.bias.detach()
            new.bias.copy_(b.index_select(0, rows) if rows is not None else b)
    new.train(layer.training)
    return new


def _keep_outputs(module: nn.Module, rows: torch.Tensor) -> nn.Module:
    first, last = _leaves(module)
    if first is last:
        return _rebuild(first, rows=rows)
    return nn.Sequential(first, _rebuild(last, rows=rows))


def _keep_inputs(module: nn.Module, cols: torch.Tensor) -> nn.Module:
    first, last = _leaves(module)
    if first is last:
        return _rebuild(first, cols=cols)
    return nn.Sequential(_rebuild(first, cols=cols), last)


def _keep_norm(norm: nn.BatchNorm2d, channels: torch.Tensor) -> nn.BatchNorm2d:
    new = nn.BatchNorm2d(len(channels), eps=norm.eps, momentum=norm.momentum, affine=norm.affine,
                         track_running_stats=norm.track_running_stats,
                         device=channels.device if norm.weight is None else norm.weight.device)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            source = getattr(norm, name)
            if source is not None:
                getattr(new, name).copy_(source.detach().index_select(0, channels))
        if norm.num_batches_tracked is not None:
            new.num_batches_tracked.copy_(norm.num_batches_tracked)
    new.train(norm.training)
    return new


def _top(importance: torch.Tensor, remove: int) -> torch.Tensor:
    """Indices of the units kept (all but the `remove` least important), in their original order."""
    keep = importance.numel() - remove
    return importance.topk(keep).indices.sort().values


def prune_attention(attn: nn.Module, fraction: float, roles: AttentionRoles = FUSED_ATTENTION) -> tuple[int, int]:
    """Remove heads from an attention module with a fused [q; k; v] projection (heads contiguous), an
    output projection and a head count, named by `roles`.

    Returns (heads before, heads after).
    """
    heads = getattr(attn, roles.heads)
    if roles.kv_groups and getattr(attn, roles.kv_groups) != 1:
        # Query heads share key/value heads there: removing a query head would leave its group's
        # shared head half used, and removing a whole group is a different, coarser pruning.
        raise Unsupported(f"head pruning of grouped-query attention ({getattr(attn, roles.kv_groups)} query heads "
                          "per key/value head) is not implemented; it prunes multi-head attention")
    qkv, proj = _matrix(getattr(attn, roles.qkv)), _matrix(getattr(attn, roles.out))
    inner = qkv.shape[0] // 3
    size = inner // heads
    remove = min(int(heads * fraction), heads - 1)
    if remove <= 0:
        return heads, heads
    per_head = qkv.view(3, heads, size, -1).square().sum(dim=(0, 2, 3))
    per_head += proj.view(proj.shape[0], heads, size).square().sum(dim=(0, 2))
    keep = _top(per_head.sqrt(), remove)
    offsets = torch.arange(size, device=keep.device)
    cols = (keep[:, None] * size + offsets).flatten()  # the kept heads' channels within q (or k, or v)
    rows = torch.cat([cols + part * inner for part in range(3)])
    setattr(attn, roles.qkv, _keep_outputs(getattr(attn, roles.qkv), rows))
    setattr(attn, roles.out, _keep_inputs(getattr(attn, roles.out), cols))
    # The attention forward reads its width from qkv's output and this count.
    setattr(attn, roles.heads, len(keep))
    return heads, len(keep)


def prune_mlp(mlp: nn.Module, fraction: float, roles: MlpRoles = GATED_MLP) -> tuple[int, int]:
    """Remove hidden neurons of an MLP with an expanding layer (+ optional gate) and a contracting
    layer, named by `roles`.

    Returns (neurons before, neurons after).
    """
    producers = [name for name in (roles.up, roles.gate) if name and isinstance(getattr(mlp, name, None), nn.Module)]
    consumer = _matrix(getattr(mlp, roles.down))
    hidden = consumer.shape[1]
    remove = min(int(hidden * fraction), hidden - 1)
    if remove <= 0:
        return hidden, hidden
    importance = consumer.square().sum(dim=0)
    for name in producers:
        importance += _matrix(getattr(mlp, name)).square().sum(dim=1)
    keep = _top(importance.sqrt(), remove)
    for name in producers:
        setattr(mlp, name, _keep_outputs(getattr(mlp, name), keep))
    setattr(mlp, roles.down, _keep_inputs(getattr(mlp, roles.down), keep))
    return hidden, len(keep)


def prune_bottleneck(block: nn.Module, fraction: float, roles: ConvRoles = BOTTLENECK) -> list[tuple[int, int]]:
    """Remove output channels of each (conv, norm) pair of `roles` (ResNet: the 1x1 reduce and the 3x3
    conv) with their batch norms, and the matching input channels of the conv after each.

    Returns (channels before, after) for each pair.
    """
    changes = []
    for conv, norm, consumer in roles.pairs:
        filters = _matrix(getattr(block, conv))
        channels = filters.shape[0]
        remove = min(int(channels * fraction), channels - 1)
        if remove <= 0:
            changes.append((channels, channels))
            continue
        keep = _top(filters.abs().sum(dim=1), remove)  # L1 norm of each filter (Li et al. 2017)
        setattr(block, conv, _keep_outputs(getattr(block, conv), keep))
        setattr(block, norm, _keep_norm(getattr(block, norm), keep))
        setattr(block, consumer, _keep_inputs(getattr(block, consumer), keep))
        changes.append((channels, len(keep)))
    return changes


def _has_modules(module: nn.Module, names) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in names)


def _is_attention(module: nn.Module, roles: AttentionRoles | None) -> bool:
    return roles is not None and _has_modules(module, (roles.qkv, roles.out)) and hasattr(module, roles.heads)


def _is_mlp(module: nn.Module, roles: MlpRoles | None) -> bool:
    return roles is not None and _has_modules(module, (roles.up, roles.down))


def _is_bottleneck(module: nn.Module, roles: ConvRoles | None) -> bool:
    return roles is not None and _has_modules(module, {name for pair in roles.pairs for name in pair})


def prune_blocks(containers, traits: Traits, head_fraction: float | None = None,
                 neuron_fraction: float | None = None, channel_fraction: float | None = None) -> dict[str, Counter]:
    """Prune every block in place, finding its modules by the roles `traits` declares; returns
    kind -> Counter of (before, after) widths."""
    heads = DEFAULT_HEAD_FRACTION if head_fraction is None else head_fraction
    neurons = DEFAULT_NEURON_FRACTION if neuron_fraction is None else neuron_fraction
    channels = DEFAULT_CHANNEL_FRACTION if channel_fraction is None else channel_fraction
    for name, value in (("head", heads), ("neuron", neurons), ("channel", channels)):
        if not 0 <= value < 1:
            raise ValueError(f"{name} fraction must be in [0, 1), got {value}")
    changes: dict[str, Counter] = {"heads": Counter(), "MLP neurons": Counter(), "inner conv channels": Counter()}
    seen: set[int] = set()
    for container in containers:
        for block in container:
            if id(block) in seen:  # a block shared across layers is pruned once
                continue
            seen.add(id(block))
            if _is_bottleneck(block, traits.bottleneck):
                for change in prune_bottleneck(block, channels, traits.bottleneck):
                    changes["inner conv channels"][change] += 1
                continue
            for module in list(block.modules()):
                if _is_attention(module, traits.attention):
                    changes["heads"][prune_attention(module, heads, traits.attention)] += 1
                elif _is_mlp(module, traits.mlp):
                    changes["MLP neurons"][prune_mlp(module, neurons, traits.mlp)] += 1
    return {kind: counts for kind, counts in changes.items() if counts}


def _check(profile, workload, mode) -> str | None:
    traits = workload.traits
    if traits.attention is None and traits.mlp is None and traits.bottleneck is None:
        return (f"structured-pruning rebuilds the attention heads, MLP neurons or bottleneck channels a workload "
                f"names; {workload.name} declares none (Traits.attention / mlp / bottleneck)")
    return None


def _apply(run: Run) -> None:
    containers = run.workload.block_lists(run.model)
    before = sum(p.numel() for p in run.model.parameters())
    changes = prune_blocks(containers, run.workload.traits)
    if not changes:
        raise Unsupported(f"found none of the attention, MLP or bottleneck modules {run.workload.name} declares "
                          f"in its blocks to prune")
    after = sum(p.numel() for p in run.model.parameters())
    detail = "; ".join(f"{kind} {old} -> {new} in {n} modules"
                       for kind, counts in changes.items() for (old, new), n in sorted(counts.items()))
    run.notes.append(f"structured pruning by weight norm: {detail}; {before:,} -> {after:,} parameters")


STRUCTURED_PRUNING = Technique(
    id="structured-pruning", phase=Phase.STRUCTURE, changes_numerics=True, guide="T4",
    summary=f"remove the {DEFAULT_HEAD_FRACTION:.0%} lowest-norm heads and {DEFAULT_NEURON_FRACTION:.0%} of MLP "
            f"neurons (ResNet: inner conv channels), rebuilding smaller dense layers",
    check=_check, apply=_apply, post_training=True, fine_tune=True)

TECHNIQUES = (STRUCTURED_PRUNING,)
