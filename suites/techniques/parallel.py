"""Data parallelism and sharding on PyTorch's own engine (T13, T16): DDP, ZeRO-1, FSDP2 and its CPU offload.

Under data parallelism every rank runs its slice of the global batch. `data-parallel` (DDP) keeps a
full replica of parameters, gradients and optimizer state on each rank and all-reduces the gradients;
`zero1` shards only the optimizer state (ZeroRedundancyOptimizer, ZeRO stage 1); `fsdp` (FSDP2
`fully_shard`, ZeRO stage 3) shards parameters, gradients and optimizer state, all-gathering each
block's parameters for its forward and backward and reduce-scattering its gradients; `fsdp-zero2`
keeps the gathered parameters from the forward to the backward (ZeRO stage 2's memory, one all-gather
less); `cpu-offload` holds FSDP2's shards and optimizer step in host memory. All run under torchrun
(`headroom run --world-size N`), gloo on CPUs and NCCL on GPUs.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import replace

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported, choice_option
from suites.techniques.vocabulary_parallel import gradients_placed_as_parameters


def distributed():
    """torch.distributed with its default process group, or Unsupported saying how to get one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Unsupported("runs under torchrun, one process per rank: give headroom run --world-size N "
                          "(projection of parallel stacks is not implemented yet)")
    return dist


def rank_device(run: Run) -> torch.device:
    """This rank's device: its local GPU (torchrun's LOCAL_RANK) or the CPU."""
    if run.profile.vendor == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def data_parallel_mesh(run: Run):
    """The data-parallel mesh: the `dp` dimension of the stack's 2-D or 3-D mesh, or every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if run.mesh is not None:
        return run.mesh["dp"] if run.mesh.ndim >= 2 else run.mesh
    run.mesh = init_device_mesh(rank_device(run).type, (distributed().get_world_size(),))
    return run.mesh


def _splits_batch(run: Run, dist, sharded: bool) -> None:
    """Set the data-parallel ranks and this rank's slice: every rank, or the `dp` dimension of a 2-D or 3-D
    mesh (tensor-parallel ranks of one group, and the stages of one pipeline, take the same slice)."""
    from torch.distributed.tensor import DTensor

    if any(getattr(module, "exchange", None) is not None for module in run.model.modules()):
        if not sharded:
            raise Unsupported("expert-parallel already trains what is not an expert data-parallel over these ranks "
                              "(its gradient hooks average it): DDP over it adds nothing; use fsdp to shard it")
        return  # expert parallelism set every rank's slice already
    world, index = dist.get_world_size(), None
    two_d = run.mesh is not None and run.mesh.ndim >= 2
    if run.pipeline is not None and two_d and run.mesh.mesh_dim_names == ("dp", "tp"):
        raise Unsupported("tensor-parallel and pipeline-parallel take every rank here, leaving none to split the "
                          "batch over: give pipeline-parallel:p=P and tensor-parallel:t=T with P x T below the "
                          "world size (3D parallelism)")
    if any(isinstance(p, DTensor) for p in run.model.parameters()) and not two_d:
        raise Unsupported("tensor-parallel takes every rank here, leaving none to split the batch over: give it "
                          "groups (tensor-parallel:t=N with N below the world size)")
    if two_d:
        if not sharded:
            raise Unsupported("DDP and ZeRO-1 over tensor-parallel groups or pipelines side by side are not built "
                              "(DDP takes no DTensor parameters): use fsdp, which shards over the 2-D mesh's "
                              "data-parallel dimension")
        world, index = run.mesh["dp"].size(), run.mesh["dp"].get_local_rank()
    if run.batch_size % (world * run.micro_batches):
        raise Unsupported(f"the global batch {run.batch_size} does not split into {world} ranks x "
                          f"{run.micro_batches} micro-batches")
    run.data_parallel, run.data_rank = world, index


def _apply_ddp(run: Run) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dist = distributed()
    _splits_batch(run, dist, sharded=False)
    device = rank_device(run)
    run.model = DistributedDataParallel(run.model.to(device), device_ids=[device.index] if device.index is not None
                                        else None)
    run.placed = True
    grads = sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad)
    world = dist.get_world_size()
    # A ring all-reduce sends 2 (N - 1) / N of the buffer from each rank (Patarasuk & Yuan 2009).
    run.comm_bytes_per_step = int(2 * (world - 1) / world * grads)
    run.notes.append(f"DDP over {world} ranks: full replica per rank, gradients all-reduced in buckets "
                     f"({run.comm_bytes_per_step:,} bytes sent per rank per step, ring)")


def _apply_zero1(run: Run) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _apply_ddp(run)
    factory = run.optimizer_factory
    template = factory([torch.nn.Parameter(torch.zeros(1))])  # the stack's optimizer class and settings
    accepted = inspect.signature(type(template).__init__).parameters  # defaults may hold more (AdamW's)
    defaults = {k: v for k, v in template.defaults.items()
                if k in accepted and k not in ("differentiable", "capturable")}
    run.optimizer_factory = lambda params: ZeroRedundancyOptimizer(params, optimizer_class=type(template),
                                                                   **defaults)
    world = distributed().get_world_size()
    # Each rank's updated shard goes to the others: only what the optimizer steps (not frozen weights).
    params = sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad)
    run.comm_bytes_per_step += int((world - 1) / world * params)
    run.notes.append("ZeRO-1: each rank keeps and steps 1/N of the optimizer state, then broadcasts its parameters")


# FSDP2's MixedPrecisionPolicy dtypes an `mp` option names (torchtitan trains with bf16).
GATHER_DTYPES = {"bf16": torch.bfloat16}


def _shard(run: Run, reshard_after_forward: bool, offload: bool, mp: str | None = None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from suites.techniques.expert import moe_layers, whole_tied_bytes  # it builds on this module

    dist = distributed()
    _splits_batch(run, dist, sharded=True)
    mesh = data_parallel_mesh(run)
    run.model.to(rank_device(run))
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    # Expert parallelism's experts are this rank's own: FSDP2 shards the rest over the same ranks (its
    # reduce-scatter averages what the expert technique's hooks averaged; they stay on the experts only).
    experts = {p for layer in moe_layers(run.model) if getattr(layer, "exchange", None) is not None
               for p in layer.expert_parameters()}
    if experts:
        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise Unsupported("this torch's FSDP2 cannot leave the experts unsharded (fully_shard has no "
                              "ignored_params): upgrade torch to measure expert-parallel with fsdp")
        options["ignored_params"] = experts
        run.optimizer_factory = grouped_optimizer(run.optimizer_factory)  # sharded DTensors and plain experts apart
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if mp:
        # Shards stay fp32 (the optimizer steps them); each block is all-gathered in `mp` and computes in
        # it; its gradients are reduce-scattered in fp32, as torchtitan's default policy does.
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=GATHER_DTYPES[mp], reduce_dtype=torch.float32)
        if run.precision == "fp32":  # no autocast: every op computes in the gathered dtype
            run.precision = mp
    blocks = run.workload.blocks(run.model)
    # What FSDP gathers whole, before it shards: each parameter as this rank holds it (a tensor-parallel
    # rank's part of a sharded layer), in the dtype gathered; only trained ones have gradients to scatter.
    gathered = GATHER_DTYPES[mp].itemsize if mp else None  # bytes per element all-gathered under `mp`
    inside = {p for block in blocks for p in block.parameters()}
    held = [((p.to_local() if hasattr(p, "to_local") else p).numel(), p.element_size(), p.requires_grad, p in inside)
            for p in run.model.parameters() if p not in experts]
    params = sum(n * (gathered or size) for n, size, _, _ in held)
    root = sum(n * (gathered or size) for n, size, _, in_block in held if not in_block)
    trained = sum(n * size for n, size, grad, _ in held if grad)
    for block in blocks:  # one all-gather per block: only one block's parameters are whole at a time
        fully_shard(block, **options)
    # The root (embeddings, final norm, head) stays gathered from its forward to its backward, as FSDP2 does by
    # default (its parameters are needed again at once); an explicit True would reshard it too on torch >= 2.8.
    fully_shard(run.model, **(options | {"reshard_after_forward": False}))
    run.placed = True
    world = run.data_parallel
    # Gathered for the forward, and the blocks again for the backward unless kept (the root stays gathered);
    # in a pipeline stage, the blocks once per micro-batch and once more (harness/project/communication.py's
    # collective_bytes). Counted as sent (harness/measure/comm_volume.py) on gpt smoke: exactly these bytes.
    block_gathers = 1 if not reshard_after_forward else run.pipeline.micro_batches + 1 if run.pipeline else 2
    gathered_bytes = root + block_gathers * (params - root)
    # Tensor parallelism's and the pipeline's bytes stay; so do expert parallelism's all-to-alls, but its
    # all-reduce of the rest is now FSDP's gathers and scatters.
    # (The expert technique's all-reduces ran in each backward pass: a pipeline's micro-batches, or accumulated ones.)
    expert_passes = run.pipeline.micro_batches if run.pipeline else run.micro_batches
    kept = (run.comm_bytes_per_step or 0) - (int(2 * (world - 1) / world * trained * expert_passes)
                                             + whole_tied_bytes(run, world) if experts else 0)
    passes = 1 if run.pipeline else run.micro_batches  # FSDP2 gathers and scatters in each accumulated pass
    run.comm_bytes_per_step = kept + int((world - 1) / world * passes * (gathered_bytes + trained))
    run.notes.append(f"FSDP2 over {world} data-parallel ranks, {len(blocks)} blocks sharded one by one"
                     + ("; the experts left unsharded (each rank's own)" if experts else "")
                     + ("; parameters kept gathered from forward to backward (ZeRO-2)" if not reshard_after_forward
                        else "") + ("; shards and optimizer step in host memory" if offload else "")
                     + (f"; blocks gathered and computed in {mp}, gradients reduced in fp32" if mp else "")
                     + f"; {run.comm_bytes_per_step:,} bytes sent per rank per step (ring all-gather / "
                       "reduce-scatter)")
    if run.pipeline and reshard_after_forward and not offload and run.pipeline.micro_batches > 1:
        run.notes.append(regathered_note(run.pipeline.micro_batches))


def regathered_note(micro_batches: int) -> str:
    """What fsdp costs under a pipeline and the variant that avoids it: each stage runs its forward and backward
    once per micro-batch, and FSDP2 resharding after the forward gathers the stage's blocks again for each.
    torchtitan keeps them gathered under pipeline parallelism by default (reshard_after_forward = not
    pp_enabled, torchtitan/models/llama3/infra/parallelize.py), as fsdp-zero2 does here."""
    return (f"under the pipeline fsdp gathers the stage's blocks again for each of its {micro_batches} micro-batches; "
            "fsdp-zero2 gathers them once per step and keeps them whole (torchtitan's default under pipeline "
            "parallelism)")


def rank_count(technique: str, option: str, meaning: str, options: dict[str, str]) -> int:
    """A parallel technique's one option, a number of ranks (`tensor-parallel:t=8`), checked."""
    unknown = set(options) - {option}
    if unknown:
        raise ValueError(f"{technique} takes one option, {option} ({meaning}), not {', '.join(sorted(unknown))}")
    try:
        ranks = int(options[option])
    except ValueError:
        raise ValueError(f"{technique}: {option} must be a whole number of ranks, got {options[option]!r}") from None
    if ranks < 1:
        raise ValueError(f"{technique}: {option} must be at least 1, got {ranks}")
    return ranks


def grouped_optimizer(factory):
    """The stack's optimizer over two parameter groups, the sharded (DTensor) and the replicated parameters:
    a multi-tensor (foreach) step cannot take both kinds in one list."""
    from torch.distributed.tensor import DTensor

    def make(params):
        params = list(params)
        groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
                  {"params": [p for p in params if not isinstance(p, DTensor)]}]
        optimizer = factory([group for group in groups if group["params"]])
        optimizer.register_step_pre_hook(gradients_placed_as_parameters)
        return optimizer

    return make


def _check_offload(profile, workload, mode):
    if profile.vendor == "cpu":
        return "cpu-offload moves parameters and optimizer state from GPU to host memory; on a CPU there is none"
    return check_train(profile, workload, mode)


def check_train(profile, workload, mode):
    if mode != "train":
        return "data parallelism and sharding are set up for training steps here (inference runs one replica)"
    return None


def _check_sharded(profile, workload, mode):
    if not workload.block_lists:
        return f"{workload.name} exposes no repeated blocks to shard one by one"
    return check_train(profile, workload, mode)


DATA_PARALLEL = Technique(
    id="data-parallel", phase=Phase.DATA_PARALLEL, changes_numerics=False, guide="T13", exclusive="data-parallel",
    summary="DDP: a replica per rank, each on its slice of the global batch, gradients all-reduced",
    check=check_train, apply=_apply_ddp)

ZERO1 = Technique(
    id="zero1", phase=Phase.DATA_PARALLEL, changes_numerics=False, guide="T13", exclusive="data-parallel",
    summary="DDP with the optimizer state sharded over ranks (ZeroRedundancyOptimizer, ZeRO stage 1)",
    check=check_train, apply=_apply_zero1)

def _sharding(id_: str, summary: str, check, reshard_after_forward: bool, offload: bool,
              mp: str | None = None) -> Technique:
    """An FSDP2 technique; its option `mp=bf16` gathers and computes in bf16 (MixedPrecisionPolicy) over fp32
    shards, instead of autocast casting fp32 gathers (whose cast cache keeps every block's 16-bit weights
    until the forward ends)."""
    base = Technique(
        id=id_ + (f":mp={mp}" if mp else ""), phase=Phase.DATA_PARALLEL, changes_numerics=mp is not None,
        guide="T16", exclusive="data-parallel", check=check,
        summary=summary + ("" if mp else "; mp=bf16: gathered and computed in bf16 (FSDP2 MixedPrecisionPolicy)"),
        apply=lambda run: _shard(run, reshard_after_forward=reshard_after_forward, offload=offload, mp=mp))
    return replace(base, configure=lambda given: _sharding(id_, summary, check, reshard_after_forward, offload,
                                                           choice_option(id_, "mp", GATHER_DTYPES, given,
                                                                         "the dtype blocks are gathered in")))


FSDP = _sharding("fsdp", "FSDP2 fully_shard per block: parameters, gradients and optimizer state sharded (ZeRO "
                 "stage 3)", _check_sharded, reshard_after_forward=True, offload=False)
FSDP_ZERO2 = _sharding("fsdp-zero2", "FSDP2 keeping each block's gathered parameters from forward to backward "
                       "(ZeRO stage 2)", _check_sharded, reshard_after_forward=False, offload=False)
CPU_OFFLOAD = _sharding("cpu-offload", "FSDP2 with its offload policy: parameter shards, gradients and the "
                        "optimizer step in host memory", _check_offload, reshard_after_forward=True, offload=True)


def option_value(technique: Technique | None, option: str) -> str | None:
    """The value a configured technique's id gives `option` (`fsdp:mp=bf16`, "mp" -> "bf16"), None if not given."""
    for item in technique.id.split(":")[1:] if technique else ():
        key, _, value = item.partition("=")
        if key == option:
            return value
    return None


def degree(technique: Technique, option: str) -> int | None:
    """The ranks a configured parallel technique names (`tensor-parallel:t=8` -> 8), None if not given."""
    value = option_value(technique, option)
    return int(value) if value is not None else None


TECHNIQUES = (DATA_PARALLEL, ZERO1, FSDP, FSDP_ZERO2, CPU_OFFLOAD)
