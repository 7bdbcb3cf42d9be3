"""Quantisation techniques (T7-T9): real int8/int4 storage, per-layer calibration, QAT gradients, accuracy."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from harness.measure.tensors import parameter_bytes
from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import Run, parse_stack
from suites.techniques import groupquant as G
from suites.techniques import quantization as Q
from suites.workloads import WORKLOADS
from suites.workloads.base import count_parameters

PROFILES = load_profiles()
CPU = PROFILES["cpu"]


def _setup(workload_name: str, mode: str = "infer"):
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    torch.manual_seed(0)
    model = workload.build(spec).eval()
    batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(1))
    return workload, spec, model, batch


def _run(workload, spec, model, mode: str, stack: str) -> Run:
    run = Run(workload=workload, size=spec, mode=mode, profile=CPU, model=model, batch_size=spec.batch_size,
              optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1))
    parse_stack(stack).apply(run)
    return run


def _infer(run: Run, batch) -> torch.Tensor:
    return Step(run, torch.device("cpu"))(batch)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _reference(workload, model, batch) -> torch.Tensor:
    with torch.inference_mode():
        return workload.forward(model, batch)


def _layers(model: nn.Module, cls) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


# --- qat-int8 -----------------------------------------------------------------------------------------


def test_qat_trains_through_fake_quantisation_and_gradients_reach_the_float_weights():
    workload, spec, model, batch = _setup("gpt")
    linears = len(_layers(model, nn.Linear))
    run = _run(workload, spec, copy.deepcopy(model), "train", "qat-int8")
    wrapped = _layers(run.model, Q.FakeQuantized)
    assert len(wrapped) == linears
    assert not [m for m in run.model.modules() if type(m) is nn.Linear]  # every Linear was swapped

    seen = {}
    hooks = [w.input_fake_quant.register_forward_hook(lambda mod, args, out, w=w: seen.__setitem__(w, out.detach()))
             for w in wrapped]
    before = {id(w): w.layer.weight.detach().clone() for w in wrapped}
    step = Step(run, torch.device("cpu"))
    loss = step(batch)
    for hook in hooks:
        hook.remove()
    assert torch.isfinite(loss)
    for w in wrapped:
        weight = w.layer.weight
        assert weight.dtype == torch.float32 and weight.grad is not None and weight.grad.abs().sum() > 0
        assert not torch.equal(weight.detach(), before[id(w)])  # the optimizer updated the float weights
        # The layer saw an int8-grid input (affine, 256 levels) ...
        fq = w.input_fake_quant
        levels = seen[w] / fq.scale + fq.zero_point
        torch.testing.assert_close(levels, levels.round(), atol=1e-3, rtol=0)
        assert levels.min() >= -0.5 and levels.max() <= 255.5
        # ... and an int8-grid weight (symmetric per output channel).
        wfq = w.layer.weight_fake_quant
        q = wfq(weight.detach()) / wfq.scale[:, None]
        torch.testing.assert_close(q, q.round(), atol=1e-3, rtol=0)
        assert q.abs().max() <= 128.5
        assert wfq.scale.numel() == weight.shape[0]


@pytest.mark.parametrize("workload_name", ["gpt", "bert", "resnet50"])
def test_qat_inference_stays_close_to_the_float_model(workload_name):
    workload, spec, model, batch = _setup(workload_name)
    ref = _reference(workload, model, batch)
    run = _run(workload, spec, copy.deepcopy(model), "infer", "qat-int8")
    if workload.traits.convolutional:  # convolutions are fake-quantised too
        assert not [m for m in run.model.modules() if type(m) in (nn.Conv2d, nn.Linear)]
    out = _infer(run, batch)
    error = _relative_error(out, ref)
    assert 0 < error < 0.05, error
    assert "frozen" in run.notes[-1]


# --- ptq-int8 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload_name", ["gpt", "bert", "resnet50"])
def test_ptq_stores_int8_weights_shrinks_the_layers_fourfold_and_stays_close(workload_name):
    workload, spec, model, batch = _setup(workload_name)
    ref = _reference(workload, model, batch)
    float_layers = [m for m in model.modules() if type(m) in (nn.Linear, nn.Conv2d)]
    float_bytes = sum(parameter_bytes(m) for m in float_layers)
    run = _run(workload, spec, copy.deepcopy(model), "infer", "ptq-int8")
    layers = _layers(run.model, Q._Int8Layer)
    assert len(layers) == len(float_layers)
    assert not [m for m in run.model.modules() if type(m) in (nn.Linear, nn.Conv2d)]
    for layer in layers:
        assert layer.weight.dtype == torch.int8
        assert layer.weight_scale.shape == (layer.weight.shape[0],)  # per output channel
    ratio = sum(parameter_bytes(m) for m in layers) / float_bytes
    assert 0.25 <= ratio < 0.30, ratio  # int8 is 1/4 of fp32, plus per-channel scales and biases
    assert parameter_bytes(run.model) < parameter_bytes(model)
    assert _relative_error(_infer(run, batch), ref) < 0.05


def test_ptq_calibration_gives_every_layer_its_own_range_and_is_repeatable():
    workload, spec, model, _ = _setup("gpt")
    runs = [_run(workload, spec, copy.deepcopy(model), "infer", "ptq-int8") for _ in range(2)]
    scales = [[(m.input_scale.item(), m.input_zero_point.item()) for m in _layers(r.model, Q.Int8Linear)]
              for r in runs]
    assert scales[0] == scales[1]  # the calibration batches come from a fixed generator
    assert len(set(scales[0])) == len(scales[0])  # no two layers share a range


def test_ptq_int8_matmul_matches_the_dequantised_arithmetic(monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(32, 64) * 3 + 0.5
    scale = (x.max() - x.min()) / 255
    zero_point = torch.round(-128 - x.min() / scale).int()  # maps x.min() to -128: no clipping
    layer = Q.Int8Linear(linear, scale, zero_point)
    q = Q._quantize_activation(x, layer.input_scale, layer.input_zero_point)
    x_dq = (q.float() - zero_point) * scale
    w_dq = layer.weight.float() * layer.weight_scale[:, None]
    expected = x_dq @ w_dq.t() + linear.bias.detach()
    with torch.inference_mode():
        int_path = layer(x)
        monkeypatch.setattr(Q, "_int_mm_runs", lambda a, b: False)
        float_path = layer(x)
    torch.testing.assert_close(int_path, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(float_path, int_path, rtol=1e-5, atol=1e-5)
    assert _relative_error(int_path, linear(x).detach()) < 0.02


def test_low_rank_then_ptq_quantises_the_factors():
    workload, spec, model, batch = _setup("gpt")
    low_rank = _run(workload, spec, copy.deepcopy(model), "infer", "low-rank")
    ref = _infer(low_rank, batch)
    run = _run(workload, spec, copy.deepcopy(model), "infer", "low-rank+ptq-int8")
    pairs = [m for m in run.model.modules() if isinstance(m, nn.Sequential) and len(m) == 2
             and all(isinstance(x, Q.Int8Linear) for x in m)]
    assert pairs  # both factors of each low-rank pair are int8
    assert parameter_bytes(run.model) < parameter_bytes(_run(workload, spec, copy.deepcopy(model), "infer",
                                                             "ptq-int8").model)
    assert _relative_error(_infer(run, batch), ref) < 0.05


# --- group-quant ---------------------------------------------------------------------------------------


def _torchao_available() -> bool:
    return G._torchao()[0] is not None


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("path", ["default", "hand-written"])
def test_group_quant_stores_integer_weights_with_per_group_scales(bits, path, monkeypatch):
    if path == "hand-written":
        monkeypatch.setattr(G, "_torchao", lambda: (None, "disabled by the test"))
    elif bits == 8 and not _torchao_available():
        pytest.skip(f"torchao is not usable here: {G._torchao()[1]}")
    workload, spec, model, batch = _setup("gpt")
    ref = _reference(workload, model, batch)
    float_layers = _layers(model, nn.Linear)
    float_bytes = sum(parameter_bytes(m) for m in float_layers)
    stack = "group-quant" if bits == 8 else "group-quant-int4"
    run = _run(workload, spec, copy.deepcopy(model), "infer", stack)
    assert not [m for m in run.model.modules() if type(m) is nn.Linear and not _is_torchao(m)]
    layers = [m for m in run.model.modules() if isinstance(m, G.GroupQuantLinear) or _is_torchao(m)]
    assert len(layers) == len(float_layers)
    for layer in layers:
        out_features, in_features = layer.out_features, layer.in_features
        group = min(G.GROUP_SIZES[bits], in_features)
        if isinstance(layer, G.GroupQuantLinear):
            assert layer.group_size == group
            expected = (torch.int8, (out_features, in_features)) if bits == 8 else \
                (torch.uint8, (out_features, in_features // 2))  # two int4 nibbles per byte
            assert (layer.weight.dtype, tuple(layer.weight.shape)) == expected
            scales = layer.scales
        else:  # torchao's Int8Tensor: int8 data and its scales
            assert layer.weight.qdata.dtype == torch.int8
            scales = layer.weight.scale
        assert tuple(scales.shape) == (out_features, in_features // group)
    ratio = sum(parameter_bytes(m) for m in layers) / float_bytes
    low, high = (0.25, 0.30) if bits == 8 else (0.125, 0.17)  # 1/4 or 1/8 of fp32, plus scales
    assert low <= ratio < high, ratio
    which = "hand-written" if path == "hand-written" or bits == 4 else "torchao"
    assert f"{len(layers)} {which}" in run.notes[-1]
    error = _relative_error(_infer(run, batch), ref)
    assert error < (0.02 if bits == 8 else 0.15), error


class _TiedHead(nn.Module):
    """A token model whose head reads the embedding's table, tied as Hugging Face ties lm_head."""

    def __init__(self, vocabulary: int = 512, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(tokens))))


@pytest.mark.parametrize("stack", ["group-quant", "group-quant-int4", "ptq-int8"])
def test_quantisers_keep_a_head_tied_to_the_embedding_and_count_its_table_once(stack):
    workload, spec, _, batch = _setup("gpt")
    torch.manual_seed(0)
    model = _TiedHead()
    counted = count_parameters(model)
    assert counted == 512 * 64 + 64 * 64 + 64  # the tied table once
    run = _run(workload, spec, model, "infer", stack)
    assert type(run.model.head) is nn.Linear and run.model.head.weight is run.model.embed.weight
    assert type(run.model.body) is not nn.Linear or _is_torchao(run.model.body)  # the untied layer is quantised
    assert count_parameters(run.model) == counted
    assert "1 layer whose weight is tied to the token embedding kept in its dtype" in run.notes[-1]


def _is_torchao(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module.weight).__module__.startswith("torchao")


@pytest.mark.parametrize("bits", [8, 4])
def test_group_quant_rounding_error_is_at_most_half_a_step_per_group(bits):
    torch.manual_seed(0)
    linear = nn.Linear(256, 24)
    with torch.no_grad():
        linear.weight[3, :32] *= 50  # an outlier group must not coarsen the other groups' steps
    group = G.GROUP_SIZES[bits]
    layer = G.GroupQuantLinear(linear, bits, group)
    assert tuple(layer.scales.shape) == (24, 256 // group)
    error = (layer.dequantize() - linear.weight.detach()).abs().reshape(24, -1, group)
    assert (error <= layer.scales[..., None] / 2 + 1e-7).all()
    qmax = 127 if bits == 8 else 7
    assert layer.int_weight().abs().max() == qmax  # each group's largest weight uses the full range
    if bits == 4:
        assert layer.scales[3, 0] > 20 * layer.scales[3, 1]


def test_int4_error_exceeds_int8_error():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    x = torch.randn(16, 128)
    errors = [_relative_error(G.GroupQuantLinear(linear, bits, 32)(x).detach(), linear(x).detach())
              for bits in (8, 4)]
    assert errors[0] < 0.01 < errors[1] < 0.15


@pytest.mark.gpu
def test_group_quant_int4_uses_torchao_tinygemm_on_cuda():
    if not _torchao_available():
        pytest.skip(f"torchao is not usable here: {G._torchao()[1]}")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tinygemm needs compute capability >= 8.0")
    gpu = next(p for p in PROFILES.values() if p.vendor == "nvidia")
    workload = WORKLOADS["gpt"]
    smoke = workload.sizes["smoke"]
    # 1024-wide blocks: every linear has in_features a multiple of 1024, which tinygemm takes unpadded.
    spec = dataclasses.replace(smoke, config={**smoke.config, "n_embd": 1024, "n_head": 8})
    torch.manual_seed(0)
    model = workload.build(spec).eval()
    batch = {k: v.cuda() for k, v in workload.batch(spec, 2, torch.Generator().manual_seed(1)).items()}
    ref = _reference(workload, copy.deepcopy(model).cuda(), batch)
    # The same int4 quantisation on the hand-written CPU path: its error is the yardstick (group-32 int4
    # through this 1024-wide model: 0.22 on the CPU; 0.185 was measured through tinygemm on an H200).
    cpu_run = Run(workload=workload, size=spec, mode="infer", profile=PROFILES["cpu"], model=copy.deepcopy(model),
                  batch_size=2)
    parse_stack("group-quant-int4").apply(cpu_run)
    cpu_batch = {k: v.cpu() for k, v in batch.items()}
    cpu_error = _relative_error(Step(cpu_run, torch.device("cpu"))(cpu_batch), ref.cpu())
    run = Run(workload=workload, size=spec, mode="infer", profile=gpu, model=model, batch_size=2)
    parse_stack("group-quant-int4").apply(run)
    run.model = run.model.cuda()
    assert _layers(run.model, G.Bf16Input), run.notes[-1]
    gpu_error = _relative_error(Step(run, torch.device("cuda"))(batch), ref)
    assert gpu_error < 1.1 * cpu_error < 0.5, (gpu_error, cpu_error)


@pytest.mark.gpu
def test_group_quant_int4_keeps_the_true_size_where_tinygemm_would_pad():
    if not _torchao_available():
        pytest.skip(f"torchao is not usable here: {G._torchao()[1]}")
    linear = nn.Linear(768, 256)  # tinygemm pads in_features to 1024: a third more bytes than the layer
    assert G._torchao_layer(linear, 4, 128, torch.device("cuda")) is None
    assert G._torchao_layer(nn.Linear(1024, 256), 4, 128, torch.device("cuda")) is not None


def test_a_projection_traces_tinygemms_bf16_matmul_and_bytes_where_the_gpu_would_run_it():
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not _torchao_available():
        pytest.skip(f"torchao is not usable here: {G._torchao()[1]}")
    workload = WORKLOADS["gpt"]
    fake = FakeTensorMode()

    def traced_on(gpu: str) -> nn.Module:
        with fake:  # as the projection traces: fake tensors, an fp32 model
            run = Run(workload=workload, size=workload.sizes["smoke"], mode="infer", profile=PROFILES[gpu],
                      model=nn.Sequential(nn.Linear(1024, 256)), batch_size=1)
            parse_stack("group-quant-int4").apply(run)
        return run.model[0]

    ampere, turing = traced_on("a100-sxm4-80gb"), traced_on("t4")
    # An A100 runs torchao's tinygemm: a bf16 island, 4 bytes of scale and zero point per group of 32 (read by
    # the matmul as the kernel reads them), a bf16 bias.
    assert isinstance(ampere, G.Bf16Input) and ampere.layer.bias.dtype == torch.bfloat16
    weights = 1024 * 256
    assert sum(b.nbytes for b in ampere.buffers()) == weights // 2 + 4 * weights // 32 + 256 * 2
    # A T4 (compute capability 7.5) has no tinygemm: the hand-written layer, in the model's fp32.
    assert isinstance(turing, G.GroupQuantLinear) and turing.scales.dtype == torch.float32
    # The speed model costs the A100's matmul as tinygemm's (its own rate), the T4's as a weight-only GEMM.
    assert isinstance(ampere.layer, G.TinygemmStandIn) and not isinstance(turing, G.TinygemmStandIn)
    from harness.project.op_costs import _OpCostMode

    with fake, _OpCostMode() as costs:
        x = torch.zeros(4, 1024)
        ampere(x), turing(x)
    matmuls = [s for s in costs.ops if s.op_class == "matmul"]
    assert sorted((s.dtype, s.tinygemm) for s in matmuls) == [("bfloat16", True), ("float32", False)]
    # Both read a packed int4 weight: served, they stream it at the int4 share of the stream rate.
    assert {s.weight_bits for s in matmuls} == {4}


@pytest.mark.parametrize("bits", [8, 4])
def test_group_quant_stores_moe_expert_matrices_per_expert_and_keeps_the_router(bits):
    # A mixture of experts keeps its experts as batched [E, in, out] matrices (suites/workloads/moe.py), 96% of
    # Mixtral-8x7B's weights, which quantising nn.Linear alone does not reach: each expert's matrix is stored
    # as a Linear weight is, and the router stays float as quantised Mixtral checkpoints keep it.
    from suites.techniques.expert import moe_layers
    from suites.techniques.groupquant_experts import GroupQuantExperts

    workload = WORKLOADS["gpt"]
    spec = workload.sizes["moe-smoke"]
    torch.manual_seed(0)
    model = workload.build(spec).eval()
    batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(1))
    ref = _reference(workload, model, batch)
    floats = {(i, name): getattr(layer, name).detach().clone() for i, layer in enumerate(moe_layers(model))
              for name in layer.expert_names()}
    run = _run(workload, spec, copy.deepcopy(model), "infer", "group-quant" if bits == 8 else "group-quant-int4")
    layers = moe_layers(run.model)
    assert all(type(layer.router) is nn.Linear and layer.router.weight.dtype == torch.float32 for layer in layers)
    assert all(not layer.expert_parameters() for layer in layers)
    quantised = {(i, name): getattr(layer, name) for i, layer in enumerate(layers) for name in layer.expert_names()}
    assert quantised.keys() == floats.keys() and all(isinstance(q, GroupQuantExperts) for q in quantised.values())
    stored = sum(b.numel() * b.element_size() for q in quantised.values() for b in q.buffers())
    ratio = stored / sum(w.numel() * 4 for w in floats.values())
    low, high = (0.25, 0.30) if bits == 8 else (0.125, 0.17)  # 1/4 or 1/8 of fp32, plus the scales
    assert low <= ratio < high, ratio
    for key, q in quantised.items():
        step = q.scales.transpose(1, 2).repeat_interleave(q.group_size, dim=1)  # each weight's group's step
        assert ((q.dequantize() - floats[key]).abs() <= step / 2 + 1e-7).all(), key
    assert f"{len(floats)} MoE expert matrices" in run.notes[-1] and f"the {len(layers)} routers kept" in run.notes[-1]
    # Routing sends some tokens elsewhere once upstream layers are rounded: looser than a dense model's bounds.
    served = _infer(run, batch)
    error = _relative_error(served, ref)
    assert error < (0.05 if bits == 8 else 0.3), error
    # With gradients on, capacity dispatch multiplies by the dequantised matrices: the same result where no
    # expert's capacity overflows (moe-smoke's capacity factor 2 with top 2 of 4 experts holds every token).
    assert _relative_error(workload.forward(run.model, batch).detach(), served) < 1e-5


@pytest.mark.parametrize("technique", ["ptq-int8", "qat-int8"])
def test_int8_techniques_say_they_leave_moe_expert_matrices_unquantised(technique):
    # Their Linear/Conv2d layers do not include a mixture's batched expert matrices (most of its weights):
    # the row must not read as a quantised model.
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["moe-smoke"]
    note = _run(workload, spec, workload.build(spec).eval(), "infer", technique).notes[-1]
    assert "the MoE expert matrices'" in note and "keep their dtype" in note
    for name in ("gpt", "resnet50"):  # a convolution's 4-d weight is not an expert matrix
        dense, dense_spec, dense_model, _ = _setup(name)
        assert "MoE expert" not in _run(dense, dense_spec, dense_model, "infer", technique).notes[-1]


@pytest.mark.parametrize("workload_name, size", [("gpt", "smoke"), ("gpt", "moe-smoke"), ("resnet50", "smoke")])
@pytest.mark.parametrize("technique", ["ptq-int8", "group-quant", "group-quant-int4"])
def test_a_quantised_model_counts_the_parameters_its_integer_weights_stand_for(workload_name, size, technique):
    # Stored as integer buffers, the weights are still the model's parameters: Mixtral read 0.13B under
    # group-quant, and the hand-written and torchao paths counted differently.
    from suites.workloads.base import count_parameters

    workload = WORKLOADS[workload_name]
    if technique.startswith("group") and workload.traits.convolutional:
        pytest.skip("group-quant quantises Linear layers only (the vision check refuses it)")
    spec = workload.sizes[size]
    model = workload.build(spec).eval()
    quantised = _run(workload, spec, copy.deepcopy(model), "infer", technique).model
    assert count_parameters(quantised) == count_parameters(model)


# --- checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("technique", ["ptq-int8", "group-quant", "group-quant-int4"])
def test_inference_only_techniques_say_why_they_cannot_train(technique):
    reason = parse_stack(technique).check(CPU, WORKLOADS["gpt"], "train")
    assert reason and "inference" in reason and "gradient" in reason
    assert parse_stack(technique).check(CPU, WORKLOADS["gpt"], "infer") is None


@pytest.mark.parametrize("technique", ["group-quant", "group-quant-int4"])
def test_group_quant_names_convolutions_as_the_reason_for_vision(technique):
    reason = parse_stack(technique).check(CPU, WORKLOADS["resnet50"], "infer")
    assert reason and "convolutions" in reason


def test_qat_runs_in_both_modes_everywhere():
    for mode in ("train", "infer"):
        for profile in (CPU, PROFILES["t4"]):
            assert parse_stack("qat-int8").check(profile, WORKLOADS["resnet50"], mode) is None


def test_quantisation_techniques_are_mutually_exclusive():
    with pytest.raises(ValueError, match="incompatible stack"):
        parse_stack("ptq-int8+group-quant")


@pytest.mark.parametrize("technique, mode", [("qat-int8", "train"), ("qat-int8", "infer"), ("ptq-int8", "infer"),
                                             ("group-quant", "infer"), ("group-quant-int4", "infer")])
def test_techniques_apply_on_fake_tensors_for_projection(technique, mode):
    # The projection builds, transforms and steps the model under FakeTensorMode: calibration and
    # quantisation must not branch on tensor values.
    from torch._subclasses.fake_tensor import FakeTensorMode

    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    with FakeTensorMode():
        run = Run(workload=workload, size=spec, mode=mode, profile=CPU, model=workload.build(spec), batch_size=2)
        parse_stack(technique).apply(run)
        out = Step(run, torch.device("cpu"))(workload.batch(spec, 2, torch.Generator().manual_seed(0)))
    assert out.shape == (() if mode == "train" else (2, spec.seq_len, spec.config["vocab_size"]))
    if technique != "qat-int8":
        assert {b.dtype for b in run.model.buffers()} & {torch.int8, torch.uint8}


def test_a_projection_shares_a_trace_only_between_gpus_whose_int4_layers_agree():
    # An AMD GPU has no tinygemm, an A100 has: an int4 cell projected on one after the other must not reuse the
    # first's trace (it did, so a serving matrix's figures changed with the order of its GPUs).
    if not _torchao_available():
        pytest.skip(f"torchao is not usable here: {G._torchao()[1]}")
    from harness.cell import Cell
    from harness.project.trace import traced

    def trace_on(gpu: str, stack: str):
        return traced(Cell("gpt", "smoke", "infer", stack, gpu, 1, "projected").resolve(PROFILES))

    int4 = "bf16-weights+group-quant-int4"
    assert trace_on("mi300x", int4) is not trace_on("a100-sxm4-80gb", int4)
    assert trace_on("h100-sxm", int4) is trace_on("a100-sxm4-80gb", int4)  # both run tinygemm
    # A stack without such a technique traces once for every GPU.
    assert trace_on("mi300x", "bf16-weights") is trace_on("a100-sxm4-80gb", "bf16-weights")
