"""Tensor and sequence parallelism on DTensor (T13, T14): a layer's weights split over the ranks of a group.

`tensor-parallel` (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053) makes each attention block's fused QKV
projection and each MLP's first layer column-parallel (a rank computes its own heads and neurons) and their
output projections row-parallel (partial sums, all-reduced), with PyTorch's `parallelize_module`; the token
embedding and the head are vocabulary-parallel (vocabulary_parallel.py). `sequence-parallel` also splits the
norms, dropout and residual stream between those regions along the sequence (Korthikanti et al. 2022), each
all-reduce becoming a reduce-scatter and an all-gather. Both run under torchrun, after which a sharding technique
(parallel.py) may shard over the groups side by side.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported, output_bytes
from suites.techniques.parallel import (
    check_train,
    data_parallel_mesh,
    distributed,
    grouped_optimizer,
    rank_count,
    rank_device,
)
from suites.techniques.vocabulary_parallel import place_gradient_as_parameter, shard_vocabulary, vocabulary_comm


def _head_major(weight: torch.Tensor, heads: int, kv_heads: int, ranks: int) -> torch.Tensor:
    """A fused [q; k; v] projection's rows regrouped as [q_0; k_0; v_0; q_1; k_1; v_1; ...], where rank r's
    part holds its own query heads and the key/value heads they read, so that sharding the rows into
    contiguous equal blocks (what ColwiseParallel does) gives each rank whole heads of all three."""
    size = weight.shape[0] // (heads + 2 * kv_heads)
    q, k, v = weight.split((heads * size, kv_heads * size, kv_heads * size))
    parts = [chunk for r in range(ranks) for chunk in (q.chunk(ranks)[r], k.chunk(ranks)[r], v.chunk(ranks)[r])]
    return torch.cat(parts)


def _shardable(layer) -> bool:
    """A Linear that ColwiseParallel / RowwiseParallel can shard: not an adapter's wrapper (not a Linear) nor
    QLoRA's 4-bit base (its weight an NF4Tensor, which DTensor cannot split)."""
    from suites.techniques.adapters import NF4Linear

    return isinstance(layer, torch.nn.Linear) and not isinstance(layer, NF4Linear)


def _refuse_replaced(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Refuse the stack where one of `names` is a layer tensor parallelism cannot shard (a mixture's expert
    matrices are Parameters, not layers: expert parallelism's)."""
    replaced = next((name for name in names if isinstance(getattr(module, name, None), torch.nn.Module)
                     and not _shardable(getattr(module, name))), None)
    if replaced:
        raise Unsupported(f"tensor parallelism shards plain Linear layers; {replaced} is a "
                          f"{type(getattr(module, replaced)).__name__} (another technique of the stack replaced it)")


def tp_modules(model: torch.nn.Module, workload, ranks: int):
    """(module, "attention" or "mlp") for each module tensor parallelism shards over `ranks`, checked
    that it splits: whole query and key/value heads per rank, MLP neurons in equal parts, plain Linear
    layers (another technique's wrapper cannot be sharded). Shared by the real technique and the
    projection's one-rank model."""
    roles, mlp = workload.traits.attention, workload.traits.mlp
    found = []
    for module in model.modules():
        if hasattr(module, roles.qkv) and hasattr(module, roles.heads):
            heads = getattr(module, roles.heads)
            groups = getattr(module, roles.kv_groups) if roles.kv_groups else 1
            if heads % ranks or (heads // groups) % ranks:
                raise Unsupported(f"{heads} query and {heads // groups} key/value heads do not split over {ranks} "
                                  "ranks")
            _refuse_replaced(module, (roles.qkv, roles.out))
            found.append((module, "attention"))
        elif hasattr(module, mlp.up) and hasattr(module, mlp.down):
            _refuse_replaced(module, (mlp.up, mlp.down))
            if not isinstance(getattr(module, mlp.up), torch.nn.Linear):
                continue
            if getattr(module, mlp.up).out_features % ranks:
                raise Unsupported(f"{getattr(module, mlp.up).out_features} MLP neurons do not split over {ranks} "
                                  "ranks")
            found.append((module, "mlp"))
    if not found:
        raise Unsupported(f"{workload.name} declares no attention or MLP modules to shard")
    return found


def _apply_tp(run: Run, ranks: int | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist = distributed()
    world = dist.get_world_size()
    ranks = ranks or world
    if world % ranks:
        raise Unsupported(f"tensor-parallel:t={ranks} does not divide {world} ranks into groups")
    stages = run.pipeline_stages
    if ranks < world and stages and world // ranks > stages:
        # 3D: `stages` x data-parallel x `ranks`, tensor parallelism innermost and pipeline stages outermost
        # (torchtitan's order): one mesh, so that FSDP2's data-parallel dimension and the tensor-parallel
        # one share the root it requires.
        if world % (stages * ranks):
            raise Unsupported(f"{stages} pipeline stages of {ranks} tensor-parallel ranks do not divide {world} "
                              "ranks into data-parallel groups")
        run.mesh = init_device_mesh(rank_device(run).type, (stages, world // stages // ranks, ranks),
                                    mesh_dim_names=("pp", "dp", "tp"))
        mesh = run.mesh["tp"]
    elif ranks < world:
        # Groups of `ranks` consecutive ranks (tensor parallelism innermost, on the fastest links), the
        # groups side by side on the data-parallel dimension that a sharding technique then uses.
        run.mesh = init_device_mesh(rank_device(run).type, (world // ranks, ranks),
                                    mesh_dim_names=("dp", "tp"))
        mesh = run.mesh["tp"]
    else:
        mesh = data_parallel_mesh(run)
    roles, mlp = run.workload.traits.attention, run.workload.traits.mlp
    run.model.to(rank_device(run))
    modules = tp_modules(run.model, run.workload, ranks)
    sequence = run.sequence_parallel
    if sequence and run.size.seq_len % ranks:
        raise Unsupported(f"sequence-parallel splits the {run.size.seq_len}-token sequence over {ranks} ranks: "
                          "it does not divide")
    # With sequence parallelism the row-parallel outputs are reduce-scattered along the sequence instead of
    # all-reduced (the same bytes), and the residual stream between them stays sharded.
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()
    for module, kind in modules:
        if kind == "attention":
            heads = getattr(module, roles.heads)
            groups = getattr(module, roles.kv_groups) if roles.kv_groups else 1
            qkv = getattr(module, roles.qkv)
            with torch.no_grad():
                qkv.weight.copy_(_head_major(qkv.weight, heads, heads // groups, ranks))
                if qkv.bias is not None:
                    qkv.bias.copy_(_head_major(qkv.bias, heads, heads // groups, ranks))
            setattr(module, roles.heads, heads // ranks)  # this rank computes its own heads only
            plan = {roles.qkv: ColwiseParallel(), roles.out: row}
        else:
            plan = {mlp.up: ColwiseParallel(), mlp.down: row}
            if mlp.gate and getattr(module, mlp.gate, None) is not None:
                plan[mlp.gate] = ColwiseParallel()
        parallelize_module(module, mesh, plan)
    # A pipeline's last stage hands its output to the schedule's loss as a plain tensor: logits gathered there.
    parallel_loss = not run.pipelined
    vocabulary = shard_vocabulary(run.model, run.workload, mesh, parallel_loss)
    if vocabulary and parallel_loss:
        from torch.distributed.tensor.parallel import loss_parallel

        run.loss_context = loss_parallel
    if sequence:
        _shard_sequence(run.model, run.workload, mesh)
        # Each norm's gradient is a partial sum over the sequence's parts: all-reduced once per backward pass.
        run.norm_gradient_comm = int(2 * (ranks - 1) / ranks * norm_gradient_bytes(run.model) * run.micro_batches)
    sharded = len(modules)
    run.optimizer_factory = grouped_optimizer(run.optimizer_factory)
    run.placed = True
    activations = run.size.seq_len * run.size.config.get("n_embd", 0)  # elements per sample
    groups = world // ranks  # each group runs its data-parallel slice of the batch
    # Each module all-reduces its row-parallel output forward (in autocast's dtype) and its input's gradient
    # backward (fp32: the norm's output, cast inside the layer). With sequence parallelism each all-reduce is
    # a reduce-scatter and an all-gather (the same bytes), and the sequence's cut adds two fp32 gathers: the
    # final norm's output forward, the entry's gradient backward.
    unit = (ranks - 1) / ranks * activations * run.batch_size // groups
    run.vocabulary_comm = vocabulary_comm(run, vocabulary, unit, ranks, groups, parallel_loss)
    run.comm_bytes_per_step = int(2 * unit * (output_bytes(run) + 4) * sharded + (2 * unit * 4 if sequence else 0)
                                  + sum(run.vocabulary_comm) + run.norm_gradient_comm
                                  + (_recomputed_comm(run, unit, sharded) if run.recomputed else 0))
    run.notes.append(f"tensor parallel over {ranks} ranks (DTensor parallelize_module): {sharded} attention/MLP "
                     f"modules, QKV and first MLP layers column-parallel (whole heads per rank), output "
                     f"projections row-parallel and all-reduced; "
                     + (f"{' and '.join(sorted(set(vocabulary.values())))} vocabulary-parallel (1/{ranks} of the "
                        "rows each, " + ("logits sharded into loss_parallel's cross-entropy" if parallel_loss
                                         else "logits all-gathered") + "); positions and norms replicated"
                        if vocabulary
                        else "embeddings and norms replicated")
                     + (f"; {groups} such groups on a {run.mesh.ndim}-D mesh (data-parallel groups, pipeline stages)"
                        if groups > 1 else "")
                     + ("; sequence parallel: norms, dropout and the residual stream hold 1/"
                        f"{ranks} of the sequence" if sequence else ""))


def _recomputed_comm(run: Run, unit: float, sharded: int) -> float:
    """Bytes checkpointed blocks send again as their forward is recomputed (harness/project/communication.py,
    tensor_parallel_bytes, says the same): each row-parallel output all-reduced again (with sequence
    parallelism reduce-scattered, and each norm's fp32 output all-gathered again), but a block's last output
    where it only feeds the residual add, which non-reentrant checkpointing stops before (counted on gloo)."""
    layers = run.workload.depth(run.size) or 0
    skipped = layers if sharded >= 2 * layers and not run.size.config.get("dropout") else 0
    again = sharded - skipped
    if run.sequence_parallel:
        return unit * (4 * sharded + output_bytes(run) * again)
    return 2 * unit * output_bytes(run) * again


def _shard_sequence(model: torch.nn.Module, workload, mesh) -> None:
    """Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198) on a pre-norm model: the residual
    stream is cut along the sequence where it starts, each norm runs on its rank's part (PyTorch's
    SequenceParallel) and all-gathers its output for the tensor-parallel region it feeds.

    A block's norm hands the gathered output on as a DTensor, as torchtitan's plans do: the column-parallel
    layers' input gradient (partial sums on each rank) then goes back through the gather as a
    reduce-scatter, where a plain tensor in between would make it a full all-reduce (counted on gloo: 1.38x
    the bytes). The final norm feeds the head (vocabulary-parallel, its input replicated) a plain tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module

    entry = workload.traits.residual_entry
    parallelize_module(model, mesh, {entry: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True)})
    inside = {id(module) for block in workload.blocks(model) for module in block.modules()}
    norms = [(name, id(module) in inside) for name, module in model.named_modules()
             if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm)]
    for name, in_block in norms:
        parallelize_module(model, mesh, {name: SequenceParallel()})
        parallelize_module(model, mesh, {name: PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=not in_block)})
        for parameter in model.get_submodule(name).parameters():
            parameter.register_post_accumulate_grad_hook(place_gradient_as_parameter)


def norm_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients of `model`'s norms (what sequence parallelism all-reduces after each backward)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for module in model.modules() if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm)
               for p in module.parameters() if p.requires_grad)


def _sequence_parallel(run: Run) -> None:
    distributed()
    run.sequence_parallel = True  # tensor-parallel, applied next, builds its plans for it


def _check_tp(profile, workload, mode):
    roles = workload.traits
    if roles.attention is None or roles.mlp is None or roles.convolutional:
        return (f"tensor-parallel shards attention heads and MLP neurons a workload declares "
                f"(Traits.attention / mlp); {workload.name} declares none")
    if mode == "infer":
        return ("tensor-parallel serving is projected (headroom project --mode infer --technique "
                "tensor-parallel+bf16-weights --tp N), not measured: measured tensor parallelism runs training steps")
    return check_train(profile, workload, mode)


def _tensor_parallel(ranks: int | None = None) -> Technique:
    """tensor-parallel over every rank, or (`tensor-parallel:t=8`) over groups of `ranks`."""
    base = Technique(
        id="tensor-parallel" + (f":t={ranks}" if ranks else ""), phase=Phase.PARALLEL, changes_numerics=False,
        guide="T13", exclusive="tensor-parallel",
        summary="Megatron-style: QKV and first MLP layers column-parallel, output projections row-parallel, token "
                "embedding and head vocabulary-parallel (DTensor)",
        check=_check_tp, apply=lambda run: _apply_tp(run, ranks))
    return replace(base, configure=lambda given: _tensor_parallel(
        rank_count("tensor-parallel", "t", "ranks per group", given)))


TENSOR_PARALLEL = _tensor_parallel()


def _check_sp(profile, workload, mode):
    if workload.traits.residual_entry is None:
        return (f"sequence-parallel shards a pre-norm model's residual stream between its tensor-parallel regions; "
                f"{workload.name} declares none (Traits.residual_entry)")
    return _check_tp(profile, workload, mode)


SEQUENCE_PARALLEL = Technique(
    id="sequence-parallel", phase=Phase.PARALLEL, changes_numerics=False, guide="T14", order=-1,
    requires="tensor-parallel",
    summary="norms, dropout and the residual stream split along the sequence between tensor-parallel regions",
    check=_check_sp, apply=_sequence_parallel)


TECHNIQUES = (TENSOR_PARALLEL, SEQUENCE_PARALLEL)
