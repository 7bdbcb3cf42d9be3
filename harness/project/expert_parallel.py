"""One expert-parallel rank's part of a mixture of experts, for the projection: each MoE layer keeps E / e
of its experts and makes, from the rank's own capacity buffer, the shapes the all-to-all would bring it
(suites/workloads/moe.py's exchange without the sending), so the fake-tensor trace sees the rank's expert
weights, its tokens' routing and the expert matmuls it runs on every rank's tokens.
"""

from __future__ import annotations

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported
from suites.techniques.expert import moe_layers
from suites.workloads.moe import ExpertExchange


def rank_experts(ranks: int) -> Technique:
    """A projection-only technique that keeps one expert-parallel rank's experts."""

    def apply(run: Run) -> None:
        layers = moe_layers(run.model)
        if not layers:
            raise Unsupported(f"{run.workload.name} {run.size.name} has no mixture-of-experts layers: pick a MoE size "
                              "(mixtral-8x7b)")
        if layers[0].experts % ranks:
            raise Unsupported(f"{layers[0].experts} experts do not spread evenly over {ranks} ranks")
        for layer in layers:
            layer.keep_experts(0, ExpertExchange(ranks, communicate=False))
        run.notes.append(f"one of {ranks} expert-parallel ranks' part traced: {layers[0].experts // ranks} of "
                         f"{layers[0].experts} experts per MoE layer, on every rank's tokens for them")

    return Technique(id=f"expert-parallel-rank:e={ranks}", phase=Phase.PARALLEL, changes_numerics=False,
                     summary="one expert-parallel rank's experts (projection only)",
                     check=lambda profile, workload, mode: None, apply=apply)


def expert_figures(workload, spec, ranks: int, tokens: int) -> tuple[int, int, int]:
    """(MoE layers, elements of one layer's capacity buffer for `tokens` tokens, parameters replicated on
    every rank: all but the experts), from the model built on the meta device."""
    with torch.device("meta"):
        model = workload.build(spec)
    layers = moe_layers(model)
    if not layers:
        return 0, 0, 0
    experts = {id(p) for layer in layers for p in layer.expert_parameters()}
    replicated = sum(p.numel() for p in model.parameters() if id(p) not in experts)
    width = layers[0].router.in_features
    return len(layers), layers[0].experts * layers[0].capacity(tokens) * width, replicated


def all_to_all_bytes(ranks: int, layers: int, buffer: int, activation_bytes: int) -> float:
    """Bytes each rank sends per micro-batch: per MoE layer the tokens out (the norm's output dtype, fp32
    under autocast) and the experts' outputs back (the activations' dtype), forward and again backward,
    each all-to-all keeping 1/e of the buffer at home."""
    if ranks == 1:
        return 0.0
    return 2 * layers * (ranks - 1) / ranks * buffer * (4 + activation_bytes)
