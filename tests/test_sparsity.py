"""Sparsity (T10-T12): each technique's defining property, its memory accounting, and its support checks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.measure.tensors import parameter_bytes
from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run, parse_stack
from suites.techniques.dynamic_sparsity import TopKActivation
from suites.techniques.sparsity import (
    MASK,
    SCHEDULE,
    CsrLinear,
    SemiStructuredLinear,
    prune_iteratively,
    semi_structured_backend,
    two_four_mask,
)
from suites.workloads import WORKLOADS

PROFILES = load_profiles()
CPU = PROFILES["cpu"]
LANGUAGE = ["gpt", "bert"]


def _run(workload_name: str, mode: str, stack: str, profile=CPU, keep_original: bool = True):
    """A smoke run with `stack` applied, and an untouched copy of the model it started from."""
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    torch.manual_seed(0)
    model = workload.build(spec)
    original = copy.deepcopy(model) if keep_original else None
    run = Run(workload=workload, size=spec, mode=mode, profile=profile, model=model, batch_size=spec.batch_size)
    parse_stack(stack).apply(run)
    return run, original


def _batch(workload_name: str, seed: int = 0):
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    return workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(seed))


def _block_linears(run: Run) -> dict[str, nn.Linear]:
    blocks = {id(m) for c in run.workload.block_lists(run.model) for m in c.modules()}
    return {name: m for name, m in run.model.named_modules() if isinstance(m, nn.Linear) and id(m) in blocks}


def _assert_two_four(weight: torch.Tensor, name: str) -> None:
    groups = weight.detach().reshape(weight.shape[0], -1, 4)
    nonzeros = (groups != 0).sum(-1)
    assert (nonzeros == 2).all(), f"{name}: groups with {nonzeros.unique().tolist()} nonzeros"


# --- 2:4 --------------------------------------------------------------------------------------------


def test_two_four_mask_keeps_the_two_largest_of_every_four():
    weight = torch.tensor([[0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 1.0, 0.0]])
    mask = two_four_mask(weight)
    assert mask.tolist() == [[False, True, True, False, True, True, False, False]]
    with pytest.raises(ValueError, match="divisible by 4"):
        two_four_mask(torch.ones(2, 6))


@pytest.mark.parametrize("workload_name", LANGUAGE)
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_two_four_pattern_holds_in_every_group_of_every_pruned_weight(workload_name, mode):
    run, original = _run(workload_name, mode, "sparsity-2to4")
    before = dict(original.named_parameters())
    linears = _block_linears(run)
    assert linears
    for name, module in linears.items():
        _assert_two_four(module.weight, name)
        # Magnitude-based: the survivors are the original values at the 2 largest |w| of each group.
        expected = before[f"{name}.weight"].detach() * two_four_mask(before[f"{name}.weight"])
        torch.testing.assert_close(module.weight.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("workload_name", LANGUAGE)
def test_two_four_pattern_survives_training_steps(workload_name):
    run, _ = _run(workload_name, "train", "sparsity-2to4")
    step = Step(run, torch.device("cpu"))
    for seed in range(3):
        step(_batch(workload_name, seed))
    for name, module in _block_linears(run).items():
        _assert_two_four(module.weight, name)
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0  # it really trained


def test_two_four_masks_cost_one_byte_per_weight_in_training_and_nothing_in_inference():
    train, original = _run("gpt", "train", "sparsity-2to4")
    weights = sum(m.weight.numel() for m in _block_linears(train).values())
    assert all(getattr(m, MASK).dtype == torch.bool for m in _block_linears(train).values())
    assert parameter_bytes(train.model) == parameter_bytes(original) + weights
    infer, _ = _run("gpt", "infer", "sparsity-2to4")
    assert parameter_bytes(infer.model) == parameter_bytes(original)  # masked dense: zeros cost the same
    assert any("sparse kernels not measured on this device" in note for note in infer.notes)


def test_two_four_on_a_sparse_gpu_profile_uses_semi_structured_layers_for_inference_only():
    infer, _ = _run("bert", "infer", "sparsity-2to4", profile=PROFILES["a100-sxm4-80gb"])
    wrapped = [m for m in infer.model.modules() if isinstance(m, SemiStructuredLinear)]
    assert wrapped and not any("not measured" in note for note in infer.notes)
    for module in wrapped:
        _assert_two_four(module.weight, "semi-structured layer")
        assert not module.compressed  # compression happens when the model moves to CUDA
    train, _ = _run("bert", "train", "sparsity-2to4", profile=PROFILES["a100-sxm4-80gb"])
    assert not any(isinstance(m, SemiStructuredLinear) for m in train.model.modules())


@pytest.mark.gpu
def test_semi_structured_kernels_on_cuda():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} < (8, 0): no sparse tensor cores")
    if semi_structured_backend(torch.device("cuda")) is None:
        pytest.skip("this PyTorch has no cuSPARSELt and CUTLASS's 2:4 kernels need compute capability 8.x")
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    with torch.no_grad():
        linear.weight.mul_(two_four_mask(linear.weight))
    layer = SemiStructuredLinear(linear).to("cuda")
    assert layer.compressed
    x = torch.randn(4, 16, 256, device="cuda")
    dense = F.linear(x.half(), linear.weight.detach().half().cuda(), linear.bias.detach().half().cuda())
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), dense.float(), rtol=1e-2, atol=1e-2)
    # Half the fp16 values plus metadata: less than the dense fp16 weight.
    assert parameter_bytes(layer) < linear.weight.numel() * 2 + linear.bias.numel() * 2


# --- unstructured -----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload_name", LANGUAGE)
def test_unstructured_pruning_reaches_the_target_and_keeps_it_through_training(workload_name):
    run, _ = _run(workload_name, "train", "unstructured-pruning")
    linears = _block_linears(run)
    weights = [m.weight for m in linears.values()]
    total = sum(w.numel() for w in weights)
    zeros = sum(int((w == 0).sum()) for w in weights)
    assert zeros / total >= SCHEDULE[-1] >= 0.9
    step = Step(run, torch.device("cpu"))
    for seed in range(2):
        step(_batch(workload_name, seed))
    assert sum(int((w == 0).sum()) for w in weights) >= zeros  # the optimizer did not revive pruned weights
    assert any("dense storage: zeros save no memory" in note for note in run.notes)


def test_iterative_pruning_hits_every_level_and_recovers_in_between():
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.Linear(64, 32)]
    total = sum(m.weight.numel() for m in layers)
    seen = []

    def recover():
        # Pruning is still a reparametrisation here: the effective weight is weight_orig * weight_mask.
        seen.append(sum(int((m.weight_mask == 0).sum()) for m in layers) / total)
        with torch.no_grad():
            for m in layers:
                m.weight_orig.add_(torch.randn_like(m.weight_orig))  # stands in for training

    masks = prune_iteratively(layers, (0.5, 0.75, 0.9), recover)
    assert seen == pytest.approx([0.5, 0.75], abs=1 / total)
    assert all(not hasattr(m, "weight_orig") for m in layers)  # made permanent with prune.remove
    zero = sum(int((m.weight == 0).sum()) for m in layers) / total
    assert zero >= 0.9
    for m, mask in zip(layers, masks, strict=True):
        assert ((m.weight != 0) <= mask).all()


@pytest.mark.parametrize("workload_name", LANGUAGE)
def test_unstructured_inference_stores_csr_and_computes_the_pruned_model(workload_name):
    run, original = _run(workload_name, "infer", "unstructured-pruning")
    csr = [m for m in run.model.modules() if isinstance(m, CsrLinear)]
    assert csr and not _block_linears(run)
    dense_weights = sum(m.in_features * m.out_features for m in csr)
    nnz = sum(m.values.numel() for m in csr)
    assert nnz <= (1 - SCHEDULE[-1]) * dense_weights + 1
    assert parameter_bytes(run.model) < parameter_bytes(original) - 2 * dense_weights  # really smaller
    # Same function as the pruned dense layer.
    layer = csr[0]
    weight = layer.sparse_weight().to_dense()
    x = torch.randn(3, 5, layer.in_features)
    torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert Step(run, torch.device("cpu"))(_batch(workload_name)).isfinite().all()


# --- dynamic ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload_name", LANGUAGE)
def test_dynamic_sparsity_keeps_k_units_per_token_and_the_kept_set_follows_the_input(workload_name):
    run, _ = _run(workload_name, "infer", "dynamic-sparsity")
    filters = [m for m in run.model.modules() if isinstance(m, TopKActivation)]
    assert len(filters) == WORKLOADS[workload_name].sizes["smoke"].config["n_layer"]
    outputs = []
    handle = filters[0].register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
    step = Step(run, torch.device("cpu"))
    step(_batch(workload_name, 0))
    step(_batch(workload_name, 1))
    handle.remove()
    first, second = outputs
    width = first.shape[-1]
    k = filters[0].k(width)
    assert k == round(0.1 * width)
    assert ((first != 0).sum(-1) == k).all() and ((second != 0).sum(-1) == k).all()
    assert not torch.equal(first != 0, second != 0)  # input-dependent: a different set of units per input


def test_topk_keeps_the_largest_magnitudes_and_passes_gradients_only_through_them():
    h = torch.tensor([[0.5, -3.0, 0.1, 2.0, -0.2, 0.0, 1.0, -1.5, 0.3, 0.05]], requires_grad=True)
    out = TopKActivation(0.2)(h)
    assert out.detach().tolist() == [[0.0, -3.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    out.sum().backward()
    assert h.grad.tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_dynamic_sparsity_trains():
    run, _ = _run("gpt", "train", "dynamic-sparsity")
    loss = Step(run, torch.device("cpu"))(_batch("gpt"))
    assert torch.isfinite(loss)


# --- checks -----------------------------------------------------------------------------------------


def _reason(stack: str, profile: str, workload: str = "gpt", mode: str = "train") -> str | None:
    return parse_stack(stack).check(PROFILES[profile], WORKLOADS[workload], mode)


def test_two_four_check_needs_sparse_tensor_cores_but_runs_masked_on_the_host():
    reason = _reason("sparsity-2to4", "t4")
    assert "compute capability >= 8.0" in reason and "T4 is 7.5" in reason
    assert _reason("sparsity-2to4", "a100-sxm4-80gb") is None
    assert _reason("sparsity-2to4", "h100-sxm", mode="infer") is None
    assert _reason("sparsity-2to4", "cpu") is None and _reason("sparsity-2to4", "cpu", mode="infer") is None
    assert "sparse_2to4" in _reason("sparsity-2to4", "mi250x")
    assert "convolutions" in _reason("sparsity-2to4", "cpu", workload="resnet50")


@pytest.mark.parametrize("profile", ["cpu", "t4", "a100-sxm4-80gb", "h100-sxm"])
def test_unstructured_pruning_runs_everywhere(profile):
    for workload in WORKLOADS:
        assert _reason("unstructured-pruning", profile, workload) is None


def test_dynamic_sparsity_check():
    assert _reason("dynamic-sparsity", "t4") is None and _reason("dynamic-sparsity", "cpu", "bert", "infer") is None
    assert "with no MLP" in _reason("dynamic-sparsity", "h100-sxm", "resnet50")


def test_weight_sparsity_techniques_do_not_stack():
    with pytest.raises(ValueError, match="incompatible"):
        parse_stack("sparsity-2to4+unstructured-pruning")
    assert parse_stack("dynamic-sparsity+sparsity-2to4").name == "dynamic-sparsity+sparsity-2to4"


# --- projection (fake tensors) ----------------------------------------------------------------------


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("stack", ["sparsity-2to4", "unstructured-pruning", "dynamic-sparsity"])
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_fake_tensor_traces_build_the_same_shapes_as_real_runs(stack, mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real, _ = _run("bert", mode, stack)
    with FakeTensorMode():
        fake, _ = _run("bert", mode, stack, keep_original=False)
        batch = _batch("bert")
        Step(fake, torch.device("cpu"))(batch)  # the traced step runs on fake tensors
    assert abs(_state_bytes(fake.model) - _state_bytes(real.model)) <= 0.01 * _state_bytes(real.model)
    if stack != "dynamic-sparsity":
        assert any("fake-tensor trace" in note for note in fake.notes)


def test_a_projected_two_four_inference_on_sparse_tensor_cores_has_no_step_time():
    # The trace runs the semi-structured layers masked dense: costing cuSPARSELt's kernels as those would pass a
    # dense figure off as the sparse one, so the row keeps its memory and leaves the speed empty, saying why.
    from harness.cell import Cell
    from harness.profiles import load_profiles
    from harness.project import project_outcome

    profiles = load_profiles()
    sparse, dense = (project_outcome(Cell("gpt", "smoke", "infer", stack, "h100-sxm", 2, "projected",
                                          prompt_len=32, gen_len=8).resolve(profiles))
                     for stack in ("bf16-weights+sparsity-2to4", "bf16-weights"))
    assert sparse.status == dense.status == "ok" and dense.speed is not None
    assert sparse.speed is None and sparse.memory.peak_reserved > 0
    assert any("no step time: the trace cannot see cuSPARSELt's 2:4 sparse products" in n for n in sparse.notes)
