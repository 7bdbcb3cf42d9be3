"""Workload contract tests: published parameter counts, a real CPU train step, and analytic FLOPs
checked against torch's FlopCounterMode (an independent count, never used by the library code)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from suites.workloads import WORKLOADS, bert, get_workload, gpt, spec_as_run
from suites.workloads.base import SCALES, count_parameters

# The analytic counts are exact, so compare tightly: at 1% the stem conv's skipped input grad (0.95% of
# ResNet-50's train FLOPs) would go unnoticed.
REL_TOL = 1e-3

ALL_SIZES = [(w.name, s.name) for w in WORKLOADS.values() for s in w.sizes.values()]
STANDARD = [(w.name, s.name) for w in WORKLOADS.values() for s in w.sizes_at("standard")]

# A Llama-family size small enough for the CPU: no registered smoke size exercises RoPE/RMSNorm/SwiGLU.
LLAMA_SMOKE = dataclasses.replace(
    gpt.SIZES["smoke"],
    name="llama-smoke",
    config={**gpt.SIZES["smoke"].config, "family": "llama", "ffn_hidden": 96},
)


def _dense_bert(size):
    """`size` with its MLM head on the masked positions only, as NVIDIA's BERT pre-training runs it."""
    return dataclasses.replace(size, name=f"dense-{size.name}", config={**size.config, "dense_mlm_output": True})


DENSE_BERT_SMOKE = _dense_bert(bert.SIZES["smoke"])
EXTRA_SMOKE = {("gpt", "llama"): LLAMA_SMOKE, ("bert", "dense-smoke"): DENSE_BERT_SMOKE}


def _sizes(workload_name, size_name):
    w = get_workload(workload_name)
    return w, w.size(size_name)


def _batch(w, size, batch_size, device="cpu", seed=0):
    batch = w.batch(size, batch_size, torch.Generator().manual_seed(seed))
    return {k: v.to(device) for k, v in batch.items()}


def _counted(fn) -> int:
    """FLOPs FlopCounterMode sees while running fn, with sdpa forced onto its (counted) math path."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return counter.get_total_flops()


def test_registry():
    assert list(WORKLOADS) == ["resnet50", "bert", "gpt"]
    assert {w.kind for w in WORKLOADS.values()} == {"vision", "encoder", "decoder"}
    # What code reads is declared as traits, not branched on by kind or name.
    assert [w.traits.convolutional for w in WORKLOADS.values()] == [True, False, False]
    assert [w.traits.batch_norm for w in WORKLOADS.values()] == [True, False, False]
    assert [w.traits.depth_key for w in WORKLOADS.values()] == [None, "n_layer", "n_layer"]
    assert get_workload("gpt").accuracy_metric == "bits-per-byte"
    assert get_workload("bert").accuracy_metric == "masked-byte-accuracy"
    assert get_workload("resnet50").accuracy_metric == "top1"
    with pytest.raises(ValueError, match="unknown workload 'xyz'; valid: resnet50, bert, gpt, fragmentation$"):
        get_workload("xyz")
    with pytest.raises(ValueError, match="did you mean 'resnet50'"):
        get_workload("resnet")



def test_spec_as_run_takes_a_measured_rows_sequence_and_shape_but_keeps_the_size_where_blank():
    base = WORKLOADS["bert"].sizes["bert-large"]
    for blank in (None, float("nan"), base.seq_len):
        assert spec_as_run("bert", "bert-large", blank) is base
    longer = spec_as_run("bert", "bert-large", 384.0, {"vocab_size": 30528})
    assert (longer.seq_len, longer.config["vocab_size"], longer.name) == (384, 30528, base.name)

@pytest.mark.parametrize("workload_name,size_name", ALL_SIZES)
def test_parameter_count(workload_name, size_name):
    w, size = _sizes(workload_name, size_name)
    assert size.scale in SCALES and size.name == size_name
    if size.scale != "smoke":
        assert size.canonical_params and size.canonical_source
    if size.canonical_params is None:
        pytest.skip("no published count for this size")
    with torch.device("meta"):  # the large sizes would not fit in memory
        model = w.build(size)
    n = count_parameters(model)
    if size.canonical_tolerance == 0:
        assert n == size.canonical_params
    else:
        assert abs(n - size.canonical_params) / size.canonical_params <= size.canonical_tolerance


def test_blocks_are_the_containers_flattened_in_order():
    gpt_model = gpt.WORKLOAD.build(gpt.SIZES["smoke"])
    assert gpt.WORKLOAD.blocks(gpt_model) == list(gpt_model.blocks)
    assert len(gpt.WORKLOAD.blocks(gpt_model)) == gpt.SIZES["smoke"].config["n_layer"]
    resnet = get_workload("resnet50")
    with torch.device("meta"):
        model = resnet.build(resnet.size("resnet50"))
    # ResNet-50's four stages hold 3, 4, 6 and 3 bottleneck blocks.
    assert resnet.blocks(model) == [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
    assert len(resnet.blocks(model)) == 16


@pytest.mark.parametrize("workload_name", list(WORKLOADS))
def test_smoke_train_step_and_inference(workload_name):
    w, size = _sizes(workload_name, "smoke")
    _train_and_infer(w, size)


def test_llama_family_train_step_and_inference():
    _train_and_infer(gpt.WORKLOAD, LLAMA_SMOKE)


def _train_and_infer(w, size):
    torch.manual_seed(0)
    model = w.build(size)
    batch = _batch(w, size, size.batch_size)
    loss = w.loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    model.eval()
    with torch.no_grad():
        out = w.forward(model, batch)
    if w.traits.convolutional:
        assert out.shape == (size.batch_size, size.config["num_classes"])
    else:
        assert out.shape == (size.batch_size, size.seq_len, size.config["vocab_size"])
    blocks = w.block_lists(model)
    assert blocks and all(isinstance(b, torch.nn.ModuleList | torch.nn.Sequential) and len(b) for b in blocks)


@pytest.mark.parametrize("workload_name,size_name", [(n, "smoke") for n in WORKLOADS] + list(EXTRA_SMOKE))
def test_flops_match_flop_counter_on_cpu(workload_name, size_name):
    w = get_workload(workload_name)
    size = EXTRA_SMOKE.get((workload_name, size_name)) or w.size(size_name)
    model = w.build(size)
    batch = _batch(w, size, size.batch_size)
    forward = _counted(lambda: w.forward(model, batch)) / size.batch_size
    train = _counted(lambda: w.loss(model, batch).backward()) / size.batch_size
    assert forward > 0 and train > 0
    assert math.isclose(w.forward_flops_per_sample(size), forward, rel_tol=REL_TOL)
    assert math.isclose(w.train_flops_per_sample(size), train, rel_tol=REL_TOL)


@pytest.mark.parametrize("workload_name,size_name", STANDARD)
def test_forward_flops_at_standard_size_on_meta(workload_name, size_name):
    # FlopCounterMode and the math sdpa path both run on meta tensors, so full sizes cost no memory.
    w, size = _sizes(workload_name, size_name)
    with torch.device("meta"):
        model = w.build(size)
    batch = _batch(w, size, 1, device="meta")
    counted = _counted(lambda: w.forward(model, batch))
    assert math.isclose(w.forward_flops_per_sample(size), counted, rel_tol=REL_TOL)


def test_known_flops():
    # ResNet-50 at 224: 4.09 GMACs (torchvision docs list 4.09 GFLOPS counting MACs); 2 FLOPs per MAC.
    assert get_workload("resnet50").forward_flops_per_sample(get_workload("resnet50").size("resnet50")) == (
        pytest.approx(2 * 4.09e9, rel=0.01)
    )
    # Decoders: roughly 2 FLOPs per parameter per token plus attention (Kaplan et al. 2020, Table 1).
    size = gpt.SIZES["gpt2-124m"]
    d, seq, n_layer = 768, 1024, 12
    non_embedding = 124_439_808 - 50257 * d - 1024 * d
    expected = seq * (2 * non_embedding + 2 * n_layer * seq * d * 2 + 2 * 50257 * d)
    assert gpt.forward_flops_per_sample(size) == pytest.approx(expected, rel=0.001)


def test_llama_hidden_size():
    assert gpt.llama_hidden(4096) == 11008
    assert gpt.llama_hidden(5120) == 13824
    assert gpt.GPTConfig(**gpt.SIZES["gpt-7b"].config).hidden == 11008


def test_gpt_batch():
    size = gpt.SIZES["smoke"]
    a = _batch(gpt.WORKLOAD, size, 3, seed=1)
    b = _batch(gpt.WORKLOAD, size, 3, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["input_ids"].shape == a["labels"].shape == (3, size.seq_len)
    assert a["input_ids"].dtype == torch.int64
    assert torch.equal(a["input_ids"][:, 1:], a["labels"][:, :-1])  # labels are the next tokens
    assert int(a["input_ids"].max()) < size.config["vocab_size"]


def test_bert_batch():
    size = bert.SIZES["bert-base"]
    batch = _batch(bert.WORKLOAD, size, 64)
    ids, labels, types = batch["input_ids"], batch["labels"], batch["token_type_ids"]
    assert ids.shape == labels.shape == types.shape == (64, 128)
    masked = labels != -100
    assert masked.any(dim=1).all()  # at least one target per sample
    assert 0.12 < masked.float().mean() < 0.18
    assert (ids[masked] == 103).all()
    assert set(types.unique().tolist()) <= {0, 1}
    assert bert.mask_token_id(512) == 103 and bert.mask_token_id(64) == 63


def test_bert_dense_mlm_output_gives_the_same_loss_and_gradients_with_the_head_on_the_masked_positions_only():
    # NVIDIA's BERT pre-training runs its MLM head on the masked positions alone ("dense sequence output");
    # the loss is the same, the head's FLOPs drop to the masked share (19 of 128 positions).
    size = bert.SIZES["smoke"]
    batch = _batch(bert.WORKLOAD, size, 3)
    losses, grads = [], []
    for spec in (size, DENSE_BERT_SMOKE):
        torch.manual_seed(0)
        model = bert.build(spec)
        value = bert.loss(model, batch)
        value.backward()
        losses.append(value.detach())
        grads.append(model.word.weight.grad)
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads[1], grads[0])
    positions = bert.masked_positions(batch["labels"])
    assert positions.shape == (3, bert.predictions_per_sample(size.seq_len))
    assert (batch["labels"].gather(1, positions) != bert.IGNORE).all()
    large = bert.SIZES["bert-large"]
    dense_large = _dense_bert(large)
    d, vocab = large.config["n_embd"], large.config["vocab_size"]
    head = 2 * d * d + 2 * d * vocab
    assert bert.train_flops_per_sample(large) - bert.train_flops_per_sample(dense_large) == 3 * (128 - 19) * head
    assert bert.forward_flops_per_sample(dense_large) == bert.forward_flops_per_sample(large)  # inference: all


def test_resnet_batch():
    w = get_workload("resnet50")
    size = w.size("smoke")
    batch = _batch(w, size, 2)
    assert batch["images"].shape == (2, 3, 32, 32) and batch["images"].dtype == torch.float32
    assert batch["labels"].shape == (2,) and batch["labels"].dtype == torch.int64


def test_user_errors():
    with pytest.raises(ValueError, match="n_embd 100 is not divisible by n_head 3"):
        gpt.GPTConfig(n_layer=1, n_embd=100, n_head=3, vocab_size=10, block_size=8)
    with pytest.raises(ValueError, match="unknown family 'mamba'"):
        gpt.GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=10, block_size=8, family="mamba")
    model = gpt.WORKLOAD.build(gpt.SIZES["smoke"])
    with pytest.raises(ValueError, match="65 tokens exceeds block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        gpt.WORKLOAD.batch(gpt.SIZES["smoke"], 0, torch.Generator())
    with pytest.raises(ValueError, match="unknown size 'gpt2-7b'"):
        gpt.WORKLOAD.size("gpt2-7b")
