"""Tensor and sequence parallelism projected (harness/project/tensor_parallel.py): what one rank's part of
each sharded layer and of the vocabulary holds, the loss-parallel cross-entropy it traces, and the activations
Korthikanti et al.'s formulas give."""

from __future__ import annotations

import re

import pytest
import torch

from harness.cell import Cell
from tests.test_parallel_projection import PROFILES, _projected


def test_one_tensor_parallel_rank_holds_its_part_of_each_sharded_layer():
    from harness.project.tensor_parallel import keep_rank_part
    from suites.workloads import get_workload

    workload = get_workload("gpt")
    spec = workload.size("gpt-7b")
    with torch.device("meta"):
        whole, part = workload.build(spec), workload.build(spec)
    assert keep_rank_part(part, workload, 8) == 2 * 32  # an attention and an MLP module per block
    block, rank = whole.blocks[0], part.blocks[0]
    assert rank.attn.qkv.weight.shape == (3 * 4096 // 8, 4096) and rank.attn.n_head == 4
    assert rank.attn.proj.weight.shape == (4096, 4096 // 8)
    for name in ("up", "gate"):  # SwiGLU: both column-parallel, 11008 neurons in eighths
        assert getattr(rank.mlp, name).weight.shape == (11008 // 8, 4096)
    assert rank.mlp.proj.weight.shape == (4096, 11008 // 8)  # row-parallel
    assert rank.norm1.weight.shape == block.norm1.weight.shape  # norms stay whole
    # Llama's own head and its embedding: an eighth of the 32,000-token vocabulary each.
    assert part.wte.weight.shape == (4000, 4096) and part.lm_head.part.weight.shape == (4000, 4096)


def test_a_tensor_parallel_rank_shards_the_vocabulary_and_its_logits_unless_a_pipeline_gathers_them():
    from harness.project.tensor_parallel import keep_rank_part, sharded_model_figures
    from suites.workloads import get_workload

    workload = get_workload("gpt")
    spec = workload.size("gpt3-175b")  # GPT-2's 50,257 tokens, its head tied to the embedding
    with torch.device("meta"):
        part, gathered = (workload.build(workload.with_depth(spec, 1)) for _ in range(2))
    keep_rank_part(part, workload, 8)
    keep_rank_part(gathered, workload, 8, gathered_logits=True)
    # 50,257 does not split in eight: PyTorch shards as torch.chunk does, ceil(V / 8) rows on a rank.
    assert part.wte.weight.shape == (6283, 12288) and part.lm_head is None
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert part(tokens).shape == (2, 16, 6283)  # the tied head's logits over the rank's rows: loss parallel
    assert gathered(tokens).shape == (2, 16, 50257)  # under a pipeline, gathered whole on every rank
    figures = sharded_model_figures(workload, workload.with_depth(spec, 1), 8)
    assert figures.embedding and figures.logits_rows == 50257
    assert sum(p.numel() for p in figures.model.parameters()) == sum(p.numel() for p in part.parameters())
    untied = sharded_model_figures(workload, workload.with_depth(workload.size("gpt-7b"), 1), 8)  # Llama's own head
    assert untied.embedding and untied.logits_rows == 32000 and untied.model.lm_head.part.out_features == 4000
    alone = sharded_model_figures(workload, workload.with_depth(workload.size("gpt-7b"), 1), 1)  # one rank
    assert not alone.embedding and alone.logits_rows == 0


def test_a_vocabulary_shard_passes_its_gradient_through_the_whole_tables_as_dtensor_computes_it():
    # DTensor's embedding backward is replicated: every rank first holds the whole V x d gradient, then keeps its
    # rows. The stand-in allocates the same (its backward's largest tensor is V rows), and on one rank its
    # gradient is the embedding's own.
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.project.tensor_parallel import VocabularyShard

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.seen.append(tuple(out.shape))
            return out

    embedding = torch.nn.Embedding(50, 6)
    tokens = torch.randint(0, 50, (3, 7))
    shard = VocabularyShard(embedding, ranks=4, gathered=False)
    with Shapes() as shapes:
        shard(tokens).sum().backward()
    assert shapes.seen == [(50, 6)] and shard.weight.grad.shape == (13, 6)
    alone = VocabularyShard(embedding, ranks=1, gathered=False)
    alone.weight.data.copy_(embedding.weight.data)
    alone(tokens).square().sum().backward()
    embedding(tokens).square().sum().backward()
    assert torch.allclose(alone.weight.grad, embedding.weight.grad)


def test_the_traced_loss_parallel_cross_entropy_is_the_cross_entropy_and_its_gradient():
    # On one rank (every row its own) the projection's stand-in for loss_parallel computes what F.cross_entropy
    # does, forward and backward: its tensors are those of a correct computation.

    from harness.project.tensor_parallel import ShardedLoss

    logits = torch.randn(12, 40, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (12,))
    expected = torch.nn.functional.cross_entropy(logits, target)
    (want,) = torch.autograd.grad(expected, logits)
    with ShardedLoss():
        loss = torch.nn.functional.cross_entropy(logits, target)
    assert loss.grad_fn.name().endswith("_ShardedNllBackward")
    (got,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(loss, expected) and torch.allclose(got, want)
    # bf16 logits (GPT-2's tied head under amp-bf16): the log-softmax comes back in bf16 and autocast's fp32
    # copy of it is what the nll keeps, as PyTorch's run keeps both.
    half = logits.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), ShardedLoss():
        loss = torch.nn.functional.cross_entropy(half, target)
    assert loss.grad_fn.saved_tensors[0].dtype == torch.float32
    (got,) = torch.autograd.grad(loss, half)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.double(), want, atol=1e-2)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)


def test_gpt_70b_on_eight_tensor_parallel_ranks_holds_an_eighth_of_its_vocabulary_rows():
    # Llama-3 70B's 128,256-token embedding and head are 2.1B parameters: kept whole, 10.66B per rank; sharded,
    # the rank holds 70.6B / 8 and the norms (Megatron's vocabulary-parallel layers).

    from harness.project.tensor_parallel import keep_rank_part
    from suites.workloads import get_workload

    workload = get_workload("gpt")
    with torch.device("meta"):
        whole = workload.build(workload.size("gpt-70b"))
        part = workload.build(workload.size("gpt-70b"))
    keep_rank_part(part, workload, 8)
    norms = sum(p.numel() for name, p in whole.named_parameters() if "norm" in name)
    total, local = (sum(p.numel() for p in model.parameters()) for model in (whole, part))
    assert local == (total - norms) // 8 + norms
    assert 8.8e9 < local < 8.9e9


def test_the_guides_3d_question_answers_per_gpu_memory_fit_step_mfu_and_cost():
    # GPT-3 175B on 512 H100s: 8-way tensor x 8 stages x 8-way sharding (the example).
    plain = _projected("tensor-parallel:t=8+pipeline-parallel:p=8+fsdp+amp-bf16", 512)
    checkpointed = _projected("tensor-parallel:t=8+pipeline-parallel:p=8+fsdp+amp-bf16+checkpointing", 512)
    assert plain.status == "oom" and "8-way tensor x 8-stage 1F1B pipeline (32 micro-batches) x 8-way fsdp" in \
        plain.reason  # eight micro-batches' activations of 12 blocks do not fit 80 GB
    assert checkpointed.status == "ok" and checkpointed.memory.peak_reserved < plain.memory.peak_reserved / 2
    assert checkpointed.speed.step_time_ms_p50 > 0 and checkpointed.comm_bytes_per_step > 0
    notes = "; ".join(checkpointed.notes)
    assert "pipeline bubble 18%" in notes and "tensor parallel sends" in notes  # 7 / 39
    # One rank holds ~1/512 of the model states (norms and position embeddings stay whole under tensor
    # parallelism, so a little more).
    single = _projected("amp-bf16+checkpointing", 1, batch=1)
    ratio = checkpointed.memory.params / single.memory.params
    assert 1 / 512 < ratio < 1.5 / 512


def test_tensor_and_sequence_parallel_activations_match_korthikantis_formulas():
    from harness.project.layout import layout_of, local_cell
    from harness.project.parallel import _activations_per_block, _sequence_sharded

    # GPT-3's block in fp32 at t = 8 (Korthikanti et al. 2022, table 2, in 16-bit units: tensor parallel
    # 10 + 24/t, with sequence parallelism 34/t, per s*b*h; flash attention drops the 5as/h term and this
    # model's dropout of 0 the two 1-byte residual masks, so 8 + 24/t and 32/t; fp32 doubles the bytes).
    cell = Cell("gpt", "gpt3-175b", "train", "tensor-parallel:t=8+sequence-parallel", "h100-sxm", 1,
                source="projected", world_size=8).resolve(PROFILES)
    layout = layout_of(cell)
    local = local_cell(cell, layout)
    sbh = 2048 * 1 * 12288
    assert _activations_per_block(local) / sbh == pytest.approx(2 * (8 + 24 / 8), rel=0.01)
    # Sequence parallelism: the paper's 34/t assumes the all-gathered inputs of the column-parallel layers are
    # not kept; PyTorch's keep them (2 per block, whole), so (32 - 4)/t + 4, x 2 bytes: 15 at t = 8.
    gathered = 2 * sbh * 4
    sharded, saved = _sequence_sharded(local, layout, 12, gathered)
    assert sharded / sbh == pytest.approx(2 * ((32 - 4) / 8 + 4), rel=0.01) and saved > 0


def test_sequence_parallelism_works_through_tensor_parallelism_and_says_so_alone():
    alone = _projected("sequence-parallel+amp-bf16", 1, batch=1)
    assert alone.status == "unsupported" and "sequence-parallel works through tensor-parallel" in alone.reason
    plain = _projected("tensor-parallel:t=8+fsdp+amp-bf16", 64, size="gpt-70b", batch=8)
    sequence = _projected("tensor-parallel:t=8+sequence-parallel+fsdp+amp-bf16", 64, size="gpt-70b", batch=8)
    # At 8k tokens about a third off the peak (134.9 -> 90.8 GiB): the norms' and residual stream's share, which
    # only sequence parallelism shards (CUDA's fused RMSNorm keeps one fp32 copy of its input, not two).
    assert sequence.memory.peak_allocated < 0.7 * plain.memory.peak_allocated
    assert "8-way tensor (sequence parallel) x 8-way fsdp" in "; ".join(sequence.notes)
    # Checkpointed, a block keeps only its input: the residual stream, which sequence parallelism shards too.
    kept, sharded = (_projected(f"tensor-parallel:t=8{sp}+fsdp+amp-bf16+checkpointing", 64, size="gpt-70b", batch=8)
                     for sp in ("", "+sequence-parallel"))
    assert sharded.memory.activations < kept.memory.activations


def test_sequence_parallel_pipeline_stages_receive_a_tensor_parallel_ranks_part_of_the_sequence():
    # The blocks' output is sharded along the sequence: each micro-batch's buffers are 1/t of the whole, as
    # what the stage sends is. GPT-3 175B, t=8 p=8, 32 micro-batches of 3 x 2048 tokens x 12,288 in fp32, both
    # directions: 18,432 MiB whole, 2,304 MiB sharded.
    stack = "tensor-parallel:t=8+{}pipeline-parallel:p=8+zero1+amp-bf16+selective-checkpointing"
    buffers = {}
    for sp in ("", "sequence-parallel+"):
        notes = "; ".join(_projected(stack.format(sp), 1024, gpu="a100-sxm4-80gb", batch=1536).notes)
        buffers[sp] = re.search(r"([\d,.]+) MiB of receive buffers", notes).group(1)
    assert buffers == {"": "18,432.0", "sequence-parallel+": "2,304.0"}
