"""Structural techniques (sharing, low-rank, pruning) and selective activation checkpointing.

Each lossy technique is tested for its defining property (one module reused by every layer; the
best rank-r factors; a smaller dense model that drops exactly the least important units), and for
really smaller parameter storage; selective checkpointing for equal numerics and for activation
memory between the baseline's and full checkpointing's.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.measure.tensors import gradient_bytes, optimizer_state_bytes, parameter_bytes
from harness.outcome import to_record
from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run, Unsupported, checkpointing, lowrank, parse_stack, pruning
from suites.workloads import WORKLOADS

CPU = load_profiles()["cpu"]


def _run(workload_name: str, stack: str, model=None, mode: str = "train", spec=None) -> Run:
    workload = WORKLOADS[workload_name]
    spec = spec or workload.sizes["smoke"]
    if model is None:
        torch.manual_seed(0)
        model = workload.build(spec)
    run = Run(workload=workload, size=spec, mode=mode, profile=CPU, model=model, batch_size=spec.batch_size,
              optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-3))
    parse_stack(stack).apply(run)
    return run


def _batch(workload_name: str, batch_size: int | None = None, spec=None):
    workload = WORKLOADS[workload_name]
    spec = spec or workload.sizes["smoke"]
    return workload.batch(spec, batch_size or spec.batch_size, torch.Generator().manual_seed(1))


def _train_step(run: Run, batch) -> tuple[torch.Tensor, Step]:
    step = Step(run, torch.device("cpu"))
    loss = step(batch)
    assert torch.isfinite(loss)
    return loss, step


# --- param-sharing ------------------------------------------------------------------------------

@pytest.mark.parametrize("workload_name", ["gpt", "bert"])
def test_sharing_reuses_one_block_and_stores_its_weights_once(workload_name):
    workload = WORKLOADS[workload_name]
    smoke = workload.sizes["smoke"]
    layers = 4
    spec = dataclasses.replace(smoke, config={**smoke.config, "n_layer": layers})
    torch.manual_seed(0)
    model = workload.build(spec)
    before = parameter_bytes(model)
    block_bytes = parameter_bytes(workload.block_lists(model)[0][0])

    run = _run(workload_name, "param-sharing", model=model, spec=spec)
    blocks = list(workload.block_lists(run.model)[0])
    assert len(blocks) == layers and all(b is blocks[0] for b in blocks)
    after = parameter_bytes(run.model)
    assert after == before - (layers - 1) * block_bytes  # the blocks' share shrinks L-fold
    assert "4 layers share one layer's weights" in run.notes[0]

    _, step = _train_step(run, _batch(workload_name, spec=spec))
    assert gradient_bytes(run.model) == after  # one gradient per stored weight
    # AdamW keeps two moments per parameter (plus a scalar step each): twice the shrunken weights.
    assert 2 * after <= optimizer_state_bytes(step.optimizer) < 2 * after + 4096


def test_a_shared_block_gets_the_sum_of_every_layers_gradient():
    workload = WORKLOADS["gpt"]
    torch.manual_seed(0)
    model = workload.build(workload.sizes["smoke"])
    # The unshared twin: every layer an independent copy of block 0's weights.
    twin = copy.deepcopy(model)
    for index in range(1, len(twin.blocks)):
        twin.blocks[index] = copy.deepcopy(twin.blocks[0])
    batch = _batch("gpt")

    shared = _run("gpt", "param-sharing", model=model)
    workload.loss(shared.model, batch).backward()
    workload.loss(twin, batch).backward()
    for name, param in shared.model.blocks[0].named_parameters():
        total = sum(dict(block.named_parameters())[name].grad for block in twin.blocks)
        torch.testing.assert_close(param.grad, total, rtol=1e-5, atol=1e-7, msg=name)


def test_sharing_is_unsupported_without_uniform_blocks_with_the_reason():
    reason = parse_stack("param-sharing").check(CPU, WORKLOADS["resnet50"], "train")
    assert reason and "uniform blocks" in reason and "no single block to share" in reason


# --- low-rank -----------------------------------------------------------------------------------

def test_choose_rank_by_ratio_and_by_energy():
    values = torch.tensor([3.0, 2.0, 1.0, 0.0])  # energies 9, 4, 1, 0 of 14: 64%, 93%, 100%
    assert lowrank.choose_rank(values, "ratio", ratio=0.5) == 2
    assert lowrank.choose_rank(values, "ratio", ratio=0.1) == 1
    assert lowrank.choose_rank(values, "energy", energy=0.9) == 2
    assert lowrank.choose_rank(values, "energy", energy=0.5) == 1
    assert lowrank.choose_rank(values, "energy", energy=0.95) == 3
    with pytest.raises(ValueError, match="unknown rank mode"):
        lowrank.choose_rank(values, "magic")


@pytest.mark.parametrize("workload_name", ["gpt", "bert"])
def test_low_rank_factors_are_the_best_rank_r_approximation(workload_name):
    torch.manual_seed(0)
    model = WORKLOADS[workload_name].build(WORKLOADS[workload_name].sizes["smoke"])
    original = {name: m for name, m in copy.deepcopy(model).named_modules() if isinstance(m, nn.Linear)}
    before = parameter_bytes(model)

    run = _run(workload_name, "low-rank", model=model)
    factorised = {name: m for name, m in run.model.named_modules()
                  if isinstance(m, nn.Sequential) and name in original}
    assert len(factorised) == 8  # qkv, proj, up, down/proj in each of 2 blocks
    for name, pair in factorised.items():
        weight = original[name].weight.detach().double()
        rank = int(lowrank.DEFAULT_RANK_RATIO * min(weight.shape))
        assert pair[0].out_features == pair[1].in_features == rank, name
        product = pair[1].weight.detach().double() @ pair[0].weight.detach().double()
        singular = torch.linalg.svdvals(weight)
        # Eckart-Young: the best rank-r error is the norm of the dropped singular values.
        error = torch.linalg.matrix_norm(weight - product)
        torch.testing.assert_close(error, singular[rank:].norm(), rtol=1e-4, atol=1e-6)
        if original[name].bias is not None:
            torch.testing.assert_close(pair[1].bias, original[name].bias)
    saved = sum(m.in_features * m.out_features - 16 * (m.in_features + m.out_features)
                for name, m in original.items() if name in factorised)
    assert parameter_bytes(run.model) == before - 4 * saved
    assert "rank 16 of 64 for 8 layers" in run.notes[0]
    _train_step(run, _batch(workload_name))


def test_energy_mode_recovers_a_low_rank_model_exactly(monkeypatch):
    workload = WORKLOADS["gpt"]
    torch.manual_seed(0)
    model = workload.build(workload.sizes["smoke"])
    with torch.no_grad():  # every block weight: rank 5 with equal singular values, so 90% energy needs all 5
        for module in model.blocks.modules():
            if isinstance(module, nn.Linear):
                out_features, in_features = module.weight.shape
                left = torch.linalg.qr(torch.randn(out_features, 5)).Q
                right = torch.linalg.qr(torch.randn(in_features, 5)).Q
                module.weight.copy_(0.5 * left @ right.T)
    batch = _batch("gpt")
    model.eval()
    expected = workload.forward(model, batch)

    monkeypatch.setattr(lowrank, "DEFAULT_RANK_MODE", "energy")
    run = _run("gpt", "low-rank", model=model, mode="infer")
    ranks = [m[0].out_features for m in run.model.modules() if isinstance(m, nn.Sequential)]
    assert ranks == [5] * 8
    assert "90% of the singular-value energy" in run.notes[0]
    # The factors hold the whole spectrum, so the smaller model computes the same function.
    torch.testing.assert_close(workload.forward(run.model, batch), expected, rtol=1e-4, atol=1e-4)


def test_a_factorised_strided_1x1_conv_is_the_rank_r_conv():
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 64, 1, stride=2, bias=True)
    nn.init.normal_(conv.bias)
    holder = nn.Sequential(conv)
    weight = conv.weight.detach().flatten(1).clone()
    bias = conv.bias.detach().clone()
    ranks, kept = lowrank.factorise_blocks([[holder]], mode="ratio", ratio=0.25)
    assert dict(ranks) == {(8, 32): 1} and kept == 0
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    best = (u[:, :8] * s[:8] @ vh[:8]).float()
    x = torch.randn(2, 32, 9, 9)
    torch.testing.assert_close(holder(x), F.conv2d(x, best[:, :, None, None], bias, stride=2),
                               rtol=1e-4, atol=1e-5)


def test_low_rank_resnet_factorises_1x1_convs_and_keeps_3x3():
    run = _run("resnet50", "low-rank")
    convs = [m for m in run.model.modules() if isinstance(m, nn.Conv2d)]
    assert all(m.kernel_size in ((1, 1), (3, 3), (7, 7)) for m in convs)
    bottleneck = run.model.layer1[0]
    assert isinstance(bottleneck.conv1, nn.Sequential) and isinstance(bottleneck.conv3, nn.Sequential)
    assert isinstance(bottleneck.downsample[0], nn.Sequential)
    assert isinstance(bottleneck.conv2, nn.Conv2d) and bottleneck.conv2.kernel_size == (3, 3)
    assert run.model.layer2[0].downsample[0][0].stride == (2, 2)
    assert sum(p.numel() for p in run.model.parameters()) < 0.75 * 25_557_032
    assert "3x3 kept" in run.notes[0]
    _train_step(run, _batch("resnet50"))


# --- structured-pruning -------------------------------------------------------------------------

def _transformer_parts(workload_name: str, block: nn.Module):
    """(attention, mlp, mlp's output layer) as each workload lays them out."""
    if workload_name == "gpt":
        return block.attn, block.mlp, block.mlp.proj
    return block.attn, block, block.down


@pytest.mark.parametrize("workload_name", ["gpt", "bert"])
def test_pruning_drops_exactly_the_weakest_heads_and_neurons(workload_name):
    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    model = workload.build(workload.sizes["smoke"])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # silence one head and a quarter of the neurons in each block
        for block in workload.block_lists(model)[0]:
            attn, mlp, down = _transformer_parts(workload_name, block)
            inner, heads = attn.proj.in_features, attn.n_head
            size = inner // heads
            head = int(torch.randint(heads, (1,), generator=generator))
            for part in range(3):
                attn.qkv.weight[part * inner + head * size:part * inner + (head + 1) * size] = 0
            attn.proj.weight[:, head * size:(head + 1) * size] = 0
            neurons = torch.randperm(mlp.up.out_features, generator=generator)[:mlp.up.out_features // 4]
            mlp.up.weight[neurons] = 0
            mlp.up.bias[neurons] = 0
            down.weight[:, neurons] = 0
    model.eval()
    batch = _batch(workload_name)
    expected = workload.forward(model, batch)
    before = parameter_bytes(model)

    run = _run(workload_name, "structured-pruning", model=model, mode="infer")
    for block in workload.block_lists(run.model)[0]:
        attn, mlp, down = _transformer_parts(workload_name, block)
        assert attn.n_head == 3 and attn.qkv.out_features == 3 * 48 and attn.proj.in_features == 48
        assert mlp.up.out_features == 192 and down.in_features == 192
    # Removing silent units changes nothing: the pruner found exactly the zeroed head and neurons.
    torch.testing.assert_close(workload.forward(run.model, batch), expected, rtol=1e-5, atol=1e-5)
    # Per block: one head's q, k, v rows (16 each, with biases) and proj columns; 64 neurons' up rows
    # (with biases) and down columns. 4 bytes each.
    removed = 2 * 4 * (3 * 16 * 65 + 64 * 16 + 64 * 65 + 64 * 64)
    assert parameter_bytes(run.model) == before - removed
    assert "heads 4 -> 3 in 2 modules" in run.notes[0] and "MLP neurons 256 -> 192" in run.notes[0]

    train = _run(workload_name, "structured-pruning")
    _train_step(train, _batch(workload_name))
    assert all(p.grad is not None and p.grad.shape == p.shape for p in train.model.parameters())


def test_pruning_keeps_at_least_one_head():
    attn = nn.Module()
    attn.qkv, attn.proj, attn.n_head = nn.Linear(8, 3 * 8), nn.Linear(8, 8), 2
    assert pruning.prune_attention(attn, 0.99) == (2, 1)
    assert attn.qkv.out_features == 12 and attn.proj.in_features == 4


def test_pruning_resnet_drops_the_weakest_inner_channels():
    workload = WORKLOADS["resnet50"]
    torch.manual_seed(0)
    model = workload.build(workload.sizes["smoke"])
    generator = torch.Generator().manual_seed(3)
    widths = {}
    with torch.no_grad():  # zero a quarter of the filters of both inner convs of every bottleneck
        for stage in workload.block_lists(model):
            for index, block in enumerate(stage):
                widths[(id(stage), index)] = block.conv1.out_channels
                for conv in (block.conv1, block.conv2):
                    filters = torch.randperm(conv.out_channels, generator=generator)[:conv.out_channels // 4]
                    conv.weight[filters] = 0
    model.eval()
    batch = _batch("resnet50", 2)
    expected = workload.forward(model, batch)
    before = parameter_bytes(model)

    run = _run("resnet50", "structured-pruning", model=model, mode="infer")
    for stage in workload.block_lists(run.model):
        for index, block in enumerate(stage):
            kept = widths[(id(stage), index)] * 3 // 4
            assert block.conv1.out_channels == block.bn1.num_features == block.conv2.in_channels == kept
            assert block.conv2.out_channels == block.bn2.num_features == block.conv3.in_channels == kept
    # A zero filter gives a zero map; batch norm (eval, fresh statistics) and ReLU keep it zero.
    torch.testing.assert_close(workload.forward(run.model, batch), expected, rtol=1e-4, atol=1e-4)
    # What a quarter of the inner channels weighs: conv1's rows, conv2's rows and columns (a quarter each
    # way: 7/16 of it gone), conv3's columns, and the two batch norms' weights, biases, running means and
    # variances (parameter_bytes counts buffers too).
    removed = 0
    for stage in workload.block_lists(model):
        for index, block in enumerate(stage):
            inner = widths[(id(stage), index)]
            gone = inner - inner * 3 // 4
            removed += gone * block.conv1.in_channels + (inner * inner - (inner - gone) ** 2) * 9
            removed += gone * block.conv3.out_channels + 8 * gone
    assert before - parameter_bytes(run.model) == 4 * removed  # fp32

    run.model.train()
    run.mode = "train"
    _train_step(run, _batch("resnet50"))


def test_pruning_rejects_layers_it_cannot_rebuild():
    attn = nn.Module()
    attn.qkv, attn.proj, attn.n_head = nn.Identity(), nn.Linear(8, 8), 2
    with pytest.raises(Unsupported, match="Identity"):
        pruning.prune_attention(attn, 0.5)


@pytest.mark.parametrize("stack", ["low-rank+structured-pruning", "low-rank+param-sharing+structured-pruning"])
def test_structure_techniques_stack(stack):
    before = parameter_bytes(WORKLOADS["gpt"].build(WORKLOADS["gpt"].sizes["smoke"]))
    run = _run("gpt", stack)
    attn = run.model.blocks[0].attn
    assert attn.n_head == 3 and isinstance(attn.qkv, nn.Sequential) and attn.qkv[1].out_features == 144
    assert parameter_bytes(run.model) < 0.5 * before
    _train_step(run, _batch("gpt"))


# --- selective-checkpointing --------------------------------------------------------------------

def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


@pytest.mark.parametrize("workload_name,selective", [("gpt", "selective-checkpointing"),
                                                     ("bert", "selective-checkpointing"),
                                                     ("resnet50", "selective-checkpointing"),
                                                     ("gpt", "selective-checkpointing:mm=alternate")])
def test_selective_checkpointing_matches_baseline(workload_name, selective):
    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    model = workload.build(workload.sizes["smoke"])
    batch = _batch(workload_name)
    results = {}
    for stack in ("baseline", selective):
        run = _run(workload_name, stack, model=copy.deepcopy(model))
        run.optimizer_factory = lambda params: torch.optim.SGD(params, lr=0.1)
        loss, _ = _train_step(run, batch)
        results[stack] = loss, {_clean(n): p.grad for n, p in run.model.named_parameters()}
    (base_loss, base_grads), (loss, grads) = results["baseline"], results[selective]
    torch.testing.assert_close(loss, base_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == base_grads.keys()
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_selective_checkpointing_keeps_matmul_and_attention_outputs():
    saved = checkpointing.SAVED_OPS
    aten = torch.ops.aten
    assert {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default} <= saved
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in saved
    assert aten.native_layer_norm.default not in saved and aten.gelu.default not in saved
    with pytest.raises(ValueError, match="incompatible stack"):
        parse_stack("checkpointing+selective-checkpointing")
    reason = parse_stack("selective-checkpointing").check(CPU, WORKLOADS["gpt"], "infer")
    assert reason and "training" in reason
    with pytest.raises(ValueError, match="mm must be all or alternate"):
        parse_stack("selective-checkpointing:mm=half")
    with pytest.raises(ValueError, match="one option, mm"):
        parse_stack("selective-checkpointing:every=2")


def test_torchtitans_alternating_policy_recomputes_every_second_linear_matmul_in_both_passes():
    """Forward and recomputation count apart, so the recomputation recomputes exactly what was not saved."""
    policy = checkpointing._policy(alternate=True)
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    aten, save = torch.ops.aten, CheckpointPolicy.MUST_SAVE
    ops = [aten.addmm.default, aten.gelu.default, aten.mm.default, aten.mm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.addmm.default]
    decisions = [policy(forward, op) == save for op in ops]
    assert decisions == [True, False, False, True, True, False]
    assert [policy(recompute, op) == save for op in ops] == decisions
    keep_all = checkpointing._policy(alternate=False)
    assert [keep_all(forward, op) == save for op in ops] == [True, False, True, True, True, True]


def test_selective_checkpointing_activations_sit_between_baseline_and_full():
    settings = MeasureSettings(warmup=1, steps=10, repeats=1)
    activations = {}
    for stack in ("baseline", "checkpointing", "selective-checkpointing", "selective-checkpointing:mm=alternate"):
        cell = Cell("gpt", "smoke", "train", stack, "cpu", 4).resolve(load_profiles())
        record = to_record(cell, measure(cell, settings), "test")
        assert record.status == "ok", record.reason
        activations[stack] = record.activations_bytes
    assert (activations["checkpointing"] < activations["selective-checkpointing:mm=alternate"]
            < activations["selective-checkpointing"] < activations["baseline"])
