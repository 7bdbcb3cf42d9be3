"""Megatron's vocabulary-parallel embedding and head for `tensor-parallel` (Shoeybi et al. 2019, section 3):
each of t ranks holds 1/t of the vocabulary's rows of the token embedding and of the head, on PyTorch's
DTensor (RowwiseParallel on the embedding, ColwiseParallel on the head), with the logits kept sharded into
`loss_parallel`'s cross-entropy as torchtitan runs it, or gathered where a pipeline's last stage needs them
whole. The bytes they send, for the techniques' formula. Shared with the projection's one-rank model
(harness/project/tensor_parallel.py), which finds the same modules.
"""

from __future__ import annotations

import torch

from suites.techniques.base import Run, output_bytes


def vocabulary_modules(model: torch.nn.Module, workload) -> dict[str, str]:
    """{attribute: "embedding" or "head"} of what tensor parallelism shards over the vocabulary on `model`
    (a pipeline stage holds the embedding, the head, both or neither): plain Embedding and Linear layers
    only. Shared by the real technique and the projection's one-rank model."""
    roles = workload.traits.vocabulary
    if roles is None:
        return {}
    found = {}
    if isinstance(getattr(model, roles.embedding, None), torch.nn.Embedding):
        found[roles.embedding] = "embedding"
    if roles.head and isinstance(getattr(model, roles.head, None), torch.nn.Linear):
        found[roles.head] = "head"
    return found


def head_vocabulary(model: torch.nn.Module, workload) -> int:
    """The vocabulary of the head tensor parallelism shards on `model`: its own rows, or the embedding's where
    the head is tied to it (0 where it shards no head)."""
    roles, found = workload.traits.vocabulary, vocabulary_modules(model, workload)
    if "head" in found.values():
        return getattr(model, roles.head).out_features
    tied = roles is not None and roles.head is not None and getattr(model, roles.head, None) is None
    return getattr(model, roles.embedding).num_embeddings if tied and "embedding" in found.values() else 0


def shard_vocabulary(model: torch.nn.Module, workload, mesh, parallel_loss: bool) -> dict[str, str]:
    """Megatron's vocabulary-parallel embedding and head (Shoeybi et al. 2019, section 3): each rank holds
    1/t of the vocabulary's rows. The embedding looks up the tokens its rows hold, zeroes the others and
    all-reduces the sum (PyTorch's RowwiseParallel on an Embedding); the head computes its rows' logits
    (ColwiseParallel), its input's gradient all-reduced backward. With `parallel_loss` the logits stay
    sharded and the cross-entropy runs on them under PyTorch's loss_parallel (torchtitan's default: each
    rank's softmax over its rows, a few numbers per token all-reduced); without, they are all-gathered. A
    head tied to the embedding multiplies by the embedding's rows the same way (`gathered_logits`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    found = vocabulary_modules(model, workload)
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if parallel_loss \
        else ColwiseParallel(output_layouts=Replicate())
    plan = {name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()) if kind == "embedding"
            else head for name, kind in found.items()}
    if plan:
        parallelize_module(model, mesh, plan)
    embedding = next((getattr(model, name) for name, kind in found.items() if kind == "embedding"), None)
    if embedding is not None:
        # DTensor's embedding backward has no row-sharded rule: the whole table's gradient comes back on every
        # rank (replicated). Keep the rank's rows as soon as it is accumulated, so the rank holds 1/t of it from
        # there on (as the projection traces), not until the optimizer step. Module.to() after this would swap
        # the parameter and drop the hook: the optimizer's pre-step hook (_grouped) is the safety net.
        embedding.weight.register_post_accumulate_grad_hook(place_gradient_as_parameter)
        def gathered_logits(x: torch.Tensor) -> torch.Tensor:
            replicated = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            logits = torch.nn.functional.linear(replicated, embedding.weight)  # sharded by vocabulary
            return logits if parallel_loss else logits.full_tensor()

        embedding.gathered_logits = gathered_logits
    return found


def place_gradient_as_parameter(weight: torch.Tensor) -> None:
    """A post-accumulate hook: the DTensor gradient of `weight` redistributed to the parameter's placements
    where DTensor's backward left it otherwise. A vocabulary-parallel embedding's comes back replicated (the
    rank keeps a copy of its rows), a sequence-parallel norm's as partial sums over the sequence's parts
    (all-reduced once here; left partial, every use of it by the optimizer would all-reduce it again)."""
    grad = weight.grad
    if grad is not None and hasattr(grad, "placements") and grad.placements != weight.placements:
        weight.grad = grad.redistribute(weight.device_mesh, weight.placements)


def vocabulary_comm(run: Run, vocabulary: dict[str, str], unit: float, ranks: int, groups: int,
                     parallel_loss: bool) -> tuple[int, int]:
    """(embedding, head) bytes a rank sends for the vocabulary-parallel layers `vocabulary`, on its 1/`groups`
    slice of the batch (`unit`: (t - 1) / t of one activation): the embedding's output all-reduced in its
    weight's dtype; the head's input's fp32 gradient all-reduced; then either its logits all-gathered in the
    matmul's dtype or, where the loss is parallel, loss parallelism's three all-reduces of one fp32 number per
    token (the logits' maximum, the sum of their exponentials and the target's log-probability, in
    torch/distributed/tensor/parallel/loss.py). A head tied to a sharded embedding is one too."""
    if not vocabulary:
        return 0, 0
    embedding = next((getattr(run.model, name) for name, kind in vocabulary.items() if kind == "embedding"), None)
    sent_embedding = 2 * unit * embedding.weight.to_local().element_size() if embedding is not None else 0
    rows = head_vocabulary(run.model, run.workload)  # the sharded modules keep their types and sizes
    if not rows:
        return int(sent_embedding), 0
    # Not rounded to whole samples: a pipeline multiplies it back by its stages.
    tokens = run.batch_size * (run.size.seq_len or 0) / groups
    share = (ranks - 1) / ranks
    logits = 0 if parallel_loss else share * tokens * rows * output_bytes(run)
    loss = 3 * 2 * share * tokens * 4 if parallel_loss else 0
    return int(sent_embedding), int(logits + loss + 2 * unit * 4)


def gradients_placed_as_parameters(optimizer, args, kwargs) -> None:
    """A gradient placed otherwise than its parameter (where the parameter's own hook was dropped) placed as
    it before the step: a vocabulary-parallel embedding's cut to the rank's rows, a norm's partial sums reduced."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None and hasattr(parameter.grad, "placements"):
                place_gradient_as_parameter(parameter)
