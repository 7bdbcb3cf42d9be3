"""Expert parallelism (T15): a mixture of experts' E experts spread over R ranks, E / R each, while
everything else is replicated and trained data-parallel on each rank's slice of the batch. Every MoE
layer sends each expert's share of the rank's tokens to the rank holding it and gets the outputs back:
two all-to-alls forward, two backward (GShard, Lepikhin et al. 2020). Built on torch.distributed's
autograd-aware `all_to_all_single`; the MoE layer and its exchange are in suites/workloads/moe.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported, output_bytes
from suites.techniques.parallel import distributed, rank_count, rank_device
from suites.workloads.moe import ExpertExchange


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's mixture-of-experts layers (those that can keep a rank's share of their experts)."""
    return [module for module in model.modules() if hasattr(module, "keep_experts")]


def router_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the model's mixture routers, which quantisation leaves in their dtype (quantised Mixtral
    checkpoints keep the gate unconverted, AutoAWQ's modules_to_not_convert = ["gate"]): a few bytes, and
    rounding them would send tokens to other experts."""
    return {id(layer.router) for layer in moe_layers(model)}


def _averaged(world: int, reduce: bool, group=None):
    """A hook on each backward's gradient, before it is accumulated (so gradient accumulation sums
    averages): averaged over the `group`'s `world` ranks, all-reduced for a replicated parameter; an expert's
    gradient already holds every rank's tokens' part, so it is only divided."""
    import torch.distributed as dist

    def hook(gradient: torch.Tensor) -> torch.Tensor:
        if reduce:
            gradient = gradient.clone()
            dist.all_reduce(gradient, group=group)
        return gradient / world

    return hook


def _expert_ranks(run: Run, dist) -> tuple[int, int, object]:
    """(ranks the experts spread over, this rank's index among them, their process group: None for all).
    Inside pipeline stages, a stage's ranks across the pipelines side by side (the `dp` dimension of the
    pipeline's (pp, dp) mesh): each stage's MoE layers exchange tokens among the ranks holding that stage."""
    from torch.distributed.tensor import DTensor

    names = (run.mesh.mesh_dim_names or ()) if run.mesh is not None else ()
    if "tp" in names or any(isinstance(p, DTensor) for p in run.model.parameters()):
        raise Unsupported("expert-parallel with tensor-parallel is not built (the experts would need tensor "
                          "parallelism of their own): drop one of them")
    if run.pipeline is None:
        return dist.get_world_size(), dist.get_rank(), None
    if names != ("pp", "dp"):
        raise Unsupported("expert-parallel inside pipeline stages needs pipelines side by side (world = e x p: "
                          "expert-parallel:e=E+pipeline-parallel:p=P on E x P ranks)")
    ranks = run.mesh["dp"]
    return ranks.size(), ranks.get_local_rank(), ranks.get_group()


def whole_tied_bytes(run: Run, pipelines: int) -> int:
    """What a pipeline's end stage sends beyond its count of the tied weight's all-reduce when no sharding
    technique shards that weight over the `pipelines` side by side."""
    if run.pipeline is None or run.pipeline.tied_group is None:
        return 0
    from suites.techniques.pipeline import stage_tied_bytes

    tied = stage_tied_bytes(run.model)
    return tied - tied // pipelines


def _apply(run: Run, ranks: int | None) -> None:
    dist = distributed()
    world, rank, group = _expert_ranks(run, dist)
    if ranks is not None and ranks != world:
        raise Unsupported(f"expert-parallel:e={ranks} over {world} ranks (expert groups inside data-parallel ones) is "
                          f"projected only; measure it with e equal to the data-parallel ranks ({world})")
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
    exchange = ExpertExchange(world, group=group)
    for layer in layers:
        layer.keep_experts(rank, exchange)
    run.model.to(rank_device(run))
    run.placed = True
    run.data_parallel, run.data_rank = world, (rank if group is not None else None)
    owned = {id(p) for layer in layers for p in layer.expert_parameters()}
    for parameter in run.model.parameters():
        if parameter.requires_grad:
            parameter.register_hook(_averaged(world, reduce=id(parameter) not in owned, group=group))
    # Each backward pass exchanges (and all-reduces) once: a pipeline's micro-batches, or accumulated passes.
    passes = run.pipeline.micro_batches if run.pipeline is not None else run.micro_batches
    tokens = run.batch_size // world // (passes if run.pipeline is not None else 1) * (run.size.seq_len or 1)
    width = run.size.config.get("n_embd", 0)
    buffer = experts * layers[0].capacity(tokens) * width  # elements of one capacity buffer
    replicated = sum(p.numel() * p.element_size() for p in run.model.parameters()
                     if id(p) not in owned and p.requires_grad)  # what the hooks all-reduce
    share = (world - 1) / world
    exchanges = passes if run.pipeline is not None else 1
    # The pipeline counted its end stages' all-reduce of a tied weight's gradient sharded over the pipelines,
    # as the sharding technique it needs would shard it; expert parallelism keeps it whole (fsdp takes this off).
    whole_tied = whole_tied_bytes(run, world)
    # The hooks all-reduce the replicated gradients in every backward: once per accumulated pass.
    # Each layer sends its tokens out (the norm's fp32 output) and the experts' outputs back (autocast's dtype),
    # and the backward sends both gradients the other way.
    exchanged = 2 * len(layers) * share * buffer * (4 + output_bytes(run)) * exchanges
    run.comm_bytes_per_step = (run.comm_bytes_per_step or 0) + int(exchanged + 2 * share * replicated * passes) \
        + whole_tied
    run.notes.append(f"expert parallel over {world} ranks" + (" of each pipeline stage" if group is not None else "")
                     + f": {experts // world} of {experts} experts per rank in {len(layers)} MoE layers, tokens "
                     "exchanged by all-to-all; the rest replicated, its gradients all-reduced (each backward, "
                     "unbucketed)")


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
