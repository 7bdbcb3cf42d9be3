"""Cross-layer parameter sharing (guide T2): every Transformer layer reuses one layer's weights.

ALBERT (Lan et al. 2019, arXiv:1909.11942, section 3.1) shares all parameters across layers: the
model still runs L layers of compute, but stores, differentiates and optimises only one layer's
weights, so parameters, gradients and AdamW state of the blocks shrink L-fold. Here every entry of
each block list becomes the same module object as its first entry.
"""

from __future__ import annotations

from suites.techniques.base import Phase, Run, Technique, Unsupported


def _check(profile, workload, mode):
    if not workload.traits.uniform_blocks:
        return (f"cross-layer sharing reuses one layer for every layer; {workload.name} does not declare "
                "uniform blocks (ResNet's differ in width, stride and shortcut across stages), so there is "
                "no single block to share")
    return None


def _apply(run: Run) -> None:
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks to share")
    before = sum(p.numel() for p in run.model.parameters())
    shared = 0
    for container in containers:
        blocks = list(container)
        if len(blocks) < 2:
            continue
        first = blocks[0]
        for index in range(1, len(blocks)):
            # The same module object: nn.Module.parameters() yields its weights once, so the optimizer,
            # the gradients and the state dict all hold one copy; autograd sums the L layers' grads.
            container[index] = first
        shared += len(blocks)
    if not shared:
        raise Unsupported(f"{run.workload.name} has a single block per list; there is nothing to share")
    after = sum(p.numel() for p in run.model.parameters())
    run.notes.append(f"{shared} layers share one layer's weights: {before:,} -> {after:,} parameters")


PARAM_SHARING = Technique(
    id="param-sharing", phase=Phase.STRUCTURE, changes_numerics=True, guide="T2",
    summary="ALBERT-style cross-layer sharing: all blocks are one module, so their weights are stored once",
    check=_check, apply=_apply)

TECHNIQUES = (PARAM_SHARING,)
