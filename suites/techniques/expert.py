"""Expert parallelism (T15): a mixture of experts' E experts spread over R ranks, E / R each, while
everything else is replicated and trained data-parallel on each rank's slice of the batch. Every MoE
layer sends each expert's share of the rank's tokens to the rank holding it and gets the outputs back:
two all-to-alls forward, two backward (GShard, Lepikhin et al. 2020). Built on torch.distributed's
autograd-aware `all_to_all_single`; the MoE layer and its exchange are in suites/workloads/moe.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported
from suites.techniques.parallel import distributed, rank_count, rank_device
from suites.workloads.moe import ExpertExchange


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's mixture-of-experts layers (those that can keep a rank's share of their experts)."""
    return [module for module in model.modules() if hasattr(module, "keep_experts")]


def _averaged(world: int, reduce: bool):
    """A hook on each backward's gradient, before it is accumulated (so gradient accumulation sums
    averages): averaged over ranks, all-reduced for a replicated parameter; an expert's gradient already
    holds every rank's tokens' part, so it is only divided."""
    import torch.distributed as dist

    def hook(gradient: torch.Tensor) -> torch.Tensor:
        if reduce:
            gradient = gradient.clone()
            dist.all_reduce(gradient)
        return gradient / world

    return hook


def _apply(run: Run, ranks: int | None) -> None:
    dist = distributed()
    world = dist.get_world_size()
    if ranks is not None and ranks != world:
        raise Unsupported(f"expert-parallel:e={ranks} on {world} ranks (expert groups inside data-parallel ones) is "
                          f"projected only; measure it on --world-size {ranks}")
    layers = moe_layers(run.model)
    if not layers:
        raise Unsupported(f"{run.workload.name} {run.size.name} has no mixture-of-experts layers: pick a MoE size "
                          "(moe-smoke, mixtral-8x7b)")
    experts = layers[0].experts
    if experts % world:
        raise Unsupported(f"{experts} experts do not spread evenly over {world} ranks")
    if run.batch_size % (world * run.micro_batches):
        raise Unsupported(f"the global batch {run.batch_size} does not split into {world} ranks x "
                          f"{run.micro_batches} micro-batches")
    exchange = ExpertExchange(world)
    for layer in layers:
        layer.keep_experts(dist.get_rank(), exchange)
    run.model.to(rank_device(run))
    run.placed = True
    run.data_parallel = world
    owned = {id(p) for layer in layers for p in layer.expert_parameters()}
    for parameter in run.model.parameters():
        if parameter.requires_grad:
            parameter.register_hook(_averaged(world, reduce=id(parameter) not in owned))
    tokens = run.batch_size // world * (run.size.seq_len or 1)
    width = run.size.config.get("n_embd", 0)
    buffer = experts * layers[0].capacity(tokens) * width * 4  # fp32 bytes of one capacity buffer
    replicated = sum(p.numel() * p.element_size() for p in run.model.parameters() if id(p) not in owned)
    share = (world - 1) / world
    # The hooks all-reduce the replicated gradients in every backward: once per accumulated pass.
    run.comm_bytes_per_step = int(4 * len(layers) * share * buffer + 2 * share * replicated * run.micro_batches)
    run.notes.append(f"expert parallel over {world} ranks: {experts // world} of {experts} experts per rank in "
                     f"{len(layers)} MoE layers, tokens exchanged by all-to-all; the rest replicated, its gradients "
                     "all-reduced (each backward, unbucketed)")


def _check(profile, workload, mode):
    if mode != "train":
        return "expert parallelism is set up for training steps here (a served model is projected per GPU)"
    return None


def _technique(ranks: int | None = None) -> Technique:
    base = Technique(
        id="expert-parallel" + (f":e={ranks}" if ranks else ""), phase=Phase.PARALLEL, changes_numerics=False,
        guide="T15", exclusive="expert-parallel", order=2,
        summary="a mixture of experts' experts spread over ranks, tokens exchanged by all-to-all (GShard)",
        check=_check, apply=lambda run: _apply(run, ranks))
    return replace(base, configure=lambda given: _technique(
        rank_count("expert-parallel", "e", "ranks the experts spread over", given)))


EXPERT_PARALLEL = _technique()

TECHNIQUES = (EXPERT_PARALLEL,)
