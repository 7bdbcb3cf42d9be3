"""The per-op speed model: op shapes from the trace, saturation, the host's issue cost, achievable peaks,
constants per vendor, the tf32 technique, and the fit recovering constants it generated data with."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project, project_outcome, traced
from harness.project.depth import traced_to_depth
from harness.project.op_costs import foreach_kernels
from harness.project.roofline import ISSUERS, OpArrays, achievable_rate, estimate, op_arrays, step_time
from harness.project.speed_constants import constants_for
from harness.project.speed_fit import SpeedPoint, fit, held_out, projected_s
from suites.step import tf32_matmuls
from suites.techniques import TECHNIQUES, parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()


def _cell(workload="gpt", size="smoke", technique="baseline", mode="train", batch=4, gpu="h100-sxm", spec=None):
    spec = spec or WORKLOADS[workload].sizes[size]
    return Cell(workload, spec.name, mode, parse_stack(technique).name, gpu, batch, "projected").resolve(
        PROFILES, spec=spec)


def _gemm(flops: float, count: int = 1, aligned: bool = True, issuer: str = "python") -> OpArrays:
    """One op kind as the model's input: `count` bf16 GEMMs of `flops` on an H100."""
    profile = PROFILES["h100-sxm"]
    return OpArrays(count=np.array([count], float), flops=np.array([flops]), bytes=np.array([flops / 1000]),
                    kernels=np.array([1.0]), phase=np.array([0]), issuer=np.array([ISSUERS.index(issuer)]),
                    aligned=np.array([aligned]), op_class=np.array([0]), fused=np.array([False]),
                    simt=np.array([False]), achievable=np.array([profile.achievable_flops["bf16"]]),
                    datasheet=np.array([profile.peak("bf16")]), sm_count=profile.sm_count,
                    bandwidth=profile.memory_bandwidth_bytes_s, achievable_bandwidth=None, host_is_device=False)


def _no_host(constants):
    host = dataclasses.replace(constants.host, issue_python_s=0.0, issue_engine_s=0.0, issue_inference_s=0.0,
                               issue_conv_s=0.0)
    return dataclasses.replace(constants, host=host, gpu=dataclasses.replace(constants.gpu, kernel_s=0.0))


def _only(ops: OpArrays, selected: np.ndarray) -> OpArrays:
    """The model's input cut down to the `selected` ops (the per-op columns; the device's figures stay)."""
    columns = ("count", "flops", "bytes", "kernels", "phase", "issuer", "aligned", "op_class", "fused", "simt",
               "achievable", "datasheet", "streaming", "nchw_bytes", "nchw_tensors", "tinygemm", "weight_bits")
    return dataclasses.replace(ops, **{name: getattr(ops, name)[selected] for name in columns})


def test_small_gemms_reach_a_smaller_share_of_the_achievable_rate_than_large_ones():
    constants = _no_host(constants_for(PROFILES["h100-sxm"]))
    rate = PROFILES["h100-sxm"].achievable_flops["bf16"]

    def share(flops):
        return flops / step_time(_gemm(flops), constants).step_s / rate

    assert share(1e8) < 0.2 < 0.9 < share(1e13) <= 1.0
    assert share(1e8) < share(1e10) < share(1e12)


def test_unaligned_gemms_run_slower_than_aligned_ones():
    constants = _no_host(constants_for(PROFILES["h100-sxm"]))
    assert step_time(_gemm(1e12, aligned=False), constants).step_s > 1.5 * step_time(_gemm(1e12), constants).step_s


def test_the_host_issue_cost_decides_a_step_of_tiny_ops_and_not_one_of_big_ones():
    constants = constants_for(PROFILES["h100-sxm"])
    tiny = step_time(_gemm(1e6, count=1000), constants)
    busy = tiny.compute_s + tiny.memory_s + tiny.launch_s
    # The GPU waits on the host: the step takes at least the issue time and at most issue plus kernels
    # (no overlap), and most of it is the GPU idling.
    assert tiny.issue_s > 2 * busy
    assert tiny.issue_s <= tiny.step_s <= tiny.issue_s + busy
    assert tiny.overhead_s > 0.5 * tiny.step_s
    big = step_time(_gemm(1e13, count=10), constants)
    # The host costs the big step under 1% (the fitted overlap decides how much of its issue time still shows:
    # at p = 1.03, fitted 2026-12-07, most of it, 0.12% of the step; at 1.13 it was under 0.1%).
    assert big.issue_s < 0.01 * big.step_s and big.overhead_s < 0.01 * big.step_s
    assert big.overhead_s < big.issue_s  # and some of it overlaps the kernels


def test_a_profile_without_a_measured_matmul_rate_is_derated_by_generation_and_says_so():
    cell = _cell(gpu="h100-nvl", technique="amp-bf16")
    measured = estimate(traced(cell), PROFILES["h100-sxm"])
    derated = estimate(traced(cell), PROFILES["h100-nvl"])  # no measured rate for any dtype
    assert any("no measured matmul rate for" in note and "bf16" in note and "h100-nvl: datasheet derated by "
               "generation" in note for note in derated.notes)
    assert derated.step_s > 0 and measured.step_s > 0
    # h100-sxm has a measured bf16 rate: an amp-bf16 projection's note does not claim a derating for bf16.
    amp = estimate(traced(_cell(technique="amp-bf16")), PROFILES["h100-sxm"])
    assert not any("bf16 on h100-sxm" in note for note in amp.notes)


def test_an_unmeasured_tensor_core_rate_takes_the_share_its_measured_bf16_reaches_and_says_so():
    a100 = PROFILES["a100-sxm4-80gb"]  # bf16 measured (MAMF), tf32 not
    rate, borrowed = achievable_rate(a100, "tf32")
    assert borrowed == "bf16"
    assert rate == pytest.approx(a100.peak("tf32") * a100.achievable_flops["bf16"] / a100.peak("bf16"))
    # A measured figure wins over the share; fp32 on CUDA cores borrows nothing; no sibling, no share.
    assert achievable_rate(PROFILES["l4"], "tf32") == (PROFILES["l4"].achievable_flops["tf32"], None)
    assert np.isnan(achievable_rate(a100, "fp32")[0])
    assert np.isnan(achievable_rate(PROFILES["a10"], "tf32")[0])
    tf32 = estimate(traced(_cell(technique="tf32", gpu="a100-sxm4-80gb")), a100, tf32_matmul=True)
    assert any("tf32 at the share of its datasheet that the measured bf16 reaches" in note for note in tf32.notes)
    # A 72 W L4 reaches 0.59 of its bf16 datasheet where a generation's derating would give it 0.80: its
    # matmuls take 0.80 / 0.59 = 1.37x as long with the measured rate as derated.
    l4 = PROFILES["l4"]
    derated = dataclasses.replace(l4, achievable_flops={})
    trace = traced(_cell(technique="amp-bf16", gpu="l4", batch=16))
    assert estimate(trace, l4).compute_s > 1.3 * estimate(trace, derated).compute_s


def test_convolutions_pay_the_conv_efficiency_on_tensor_cores_only():
    """fp32 convolutions run on a V100's CUDA cores like a GEMM; on an A100 cuDNN takes them to TF32 tensor
    cores, where the fitted conv efficiency applies."""
    def conv_ops(gpu):
        ops = op_arrays(traced(_cell(workload="resnet50", size="smoke", gpu=gpu, batch=2)), PROFILES[gpu].per_device())
        return ops, ops.op_class == 1

    v100, v100_convs = conv_ops("v100-sxm2-32gb")
    a100, a100_convs = conv_ops("a100-sxm4-80gb")
    assert v100_convs.any() and v100.simt[v100_convs].all()
    assert a100_convs.any() and not a100.simt[a100_convs].any()

    def conv_seconds(ops, convs, efficiency):
        constants = _no_host(constants_for(PROFILES["a100-sxm4-80gb"]))
        constants = dataclasses.replace(constants, gpu=dataclasses.replace(constants.gpu, conv_efficiency=efficiency))
        return step_time(_only(ops, convs), constants).step_s

    assert conv_seconds(v100, v100_convs, 0.25) == pytest.approx(conv_seconds(v100, v100_convs, 1.0))
    assert conv_seconds(a100, a100_convs, 0.25) > 2 * conv_seconds(a100, a100_convs, 1.0)


def test_flash_attention_is_derated_on_newer_generations_and_fp32_attention_is_not():
    """PyTorch's fused attention kernels were written for Ampere: on Hopper tensor-core attention runs at the
    generation's scale (0.52) of the fitted efficiency; fp32 attention on CUDA cores keeps it."""
    assert constants_for(PROFILES["a100-sxm4-80gb"]).gpu.attention_generation_scale == 1.0
    assert constants_for(PROFILES["h100-sxm"]).gpu.attention_generation_scale == pytest.approx(0.52)

    def attention_seconds(technique, scale):
        ops = op_arrays(traced(_cell(technique=technique)), PROFILES["h100-sxm"].per_device())
        attention = ops.op_class == 2
        assert attention.any()
        constants = _no_host(constants_for(PROFILES["h100-sxm"]))
        constants = dataclasses.replace(constants, gpu=dataclasses.replace(
            constants.gpu, attention_generation_scale=scale, saturation_flops_per_sm=0.0,
            bandwidth_efficiency=1e9))  # compute only: memory traffic costs nothing here
        return step_time(_only(ops, attention), constants).step_s

    assert attention_seconds("amp-bf16", 0.52) == pytest.approx(attention_seconds("amp-bf16", 1.0) / 0.52, rel=1e-6)
    assert attention_seconds("baseline", 0.52) == pytest.approx(attention_seconds("baseline", 1.0), rel=1e-9)


def test_amd_gpus_are_costed_with_amd_constants_never_nvidias_fit():
    amd = constants_for(PROFILES["mi300x"])
    nvidia = constants_for(PROFILES["h100-sxm"])
    assert amd.key == "amd.cdna3" and nvidia.key == "nvidia.hopper"
    assert not amd.gpu.fitted
    assert amd.gpu.matmul_derating == pytest.approx(0.514)  # MI300X's MAMF share, not NVIDIA's
    time = project(_cell(gpu="mi300x", technique="amp-bf16")).time
    assert any("not fitted" in note for note in time.notes)


def test_amd_bandwidth_priors_come_from_amd_stream_measurements_per_generation():
    # BabelStream: MI300X 0.77 of its datasheet, an MI250X GCD 0.81; eager kernels at the share of a stream kernel
    # that NVIDIA's fitted eager efficiency is of the H100's BabelStream 0.89 (a refit that moves it fails here
    # until the AMD priors are rederived).
    mi300x, mi250x = constants_for(PROFILES["mi300x"]).gpu, constants_for(PROFILES["mi250x"]).gpu
    assert (mi300x.stream_bandwidth_efficiency, mi250x.stream_bandwidth_efficiency) == (0.77, 0.81)
    eager_share = constants_for(PROFILES["h100-sxm"]).gpu.bandwidth_efficiency / 0.89
    for gpu in (mi300x, mi250x):
        assert gpu.bandwidth_efficiency == pytest.approx(gpu.stream_bandwidth_efficiency * eager_share, abs=0.01)
    assert constants_for(PROFILES["mi250x"]).key == "amd.cdna2" and mi250x.matmul_derating == 0.767


def test_op_shapes_are_extrapolated_in_depth_as_a_full_trace_counts_them():
    spec = dataclasses.replace(WORKLOADS["gpt"].sizes["smoke"], config={**WORKLOADS["gpt"].sizes["smoke"].config,
                                                                         "n_layer": 6})
    cell = _cell(spec=spec)
    extrapolated, _, depths = traced_to_depth(cell, PROFILES["h100-sxm"])
    full = traced(cell)
    assert depths  # 6 layers are traced at 2 and 3 and extrapolated
    def total(trace, field, phase):
        return sum(getattr(s, field) * n for s, n in trace.ops.items() if s.phase == phase)

    for phase in ("forward", "backward", "optimizer"):
        assert total(extrapolated, "flops", phase) == pytest.approx(total(full, "flops", phase), rel=1e-6)
        assert total(extrapolated, "bytes", phase) == pytest.approx(total(full, "bytes", phase), rel=0.02)
    assert estimate(extrapolated, PROFILES["h100-sxm"]).step_s == pytest.approx(
        estimate(full, PROFILES["h100-sxm"]).step_s, rel=0.05)


def test_issuers_tell_autograd_forward_engine_backward_recomputation_and_inference_apart():
    train = traced(_cell(technique="checkpointing"))
    issuers = {(s.phase, s.issuer) for s in train.ops}
    assert {("forward", "python"), ("backward", "engine"), ("optimizer", "python")} <= issuers
    assert ("backward", "python") in issuers  # the checkpoint's recomputed forward, issued from Python
    infer = traced(_cell(mode="infer"))
    assert {s.issuer for s in infer.ops} == {"inference"}


def test_a_projected_row_says_where_its_step_goes_by_phase_and_by_what_bounds_its_kernels():
    spec = dataclasses.replace(WORKLOADS["gpt"].sizes["gpt2-124m"], seq_len=256)
    plain, checkpointed = (project_outcome(_cell(size="gpt2-124m", spec=spec, technique=t, batch=8))
                           for t in ("amp-bf16", "amp-bf16+checkpointing"))
    time = project(_cell(size="gpt2-124m", spec=spec, technique="amp-bf16", batch=8)).time
    phases = dict(time.phase_s)
    assert list(phases) == ["forward", "backward", "optimizer"]
    assert sum(phases.values()) == pytest.approx(time.step_s)  # the phases add up to the step
    assert time.compute_s + time.memory_s + time.launch_s <= time.step_s

    def note(outcome):
        return next(n for n in outcome.notes if n.startswith("where the step goes: "))

    def ms(outcome, phase):
        return float(re.search(rf"{phase} ([\d,.]+)", note(outcome)).group(1).replace(",", ""))

    assert ms(plain, "forward") == pytest.approx(phases["forward"] * 1e3, abs=0.05)
    # Checkpointing recomputes each block's forward inside the backward: that phase, not the forward, grows.
    assert ms(checkpointed, "backward") > ms(plain, "backward") * 1.15
    assert ms(checkpointed, "forward") == pytest.approx(ms(plain, "forward"), rel=0.05)
    # A served decoder's prefill and decode are not training phases: no such note.
    served = project_outcome(_cell(size="smoke", mode="infer", batch=2))
    assert not any(n.startswith("where the step goes") for n in served.notes)


def test_an_op_that_takes_only_a_tensors_shape_reads_none_of_its_data():
    from harness.project.op_costs import _OpCostMode

    weight = torch.empty(64, 1024, 1024, device="meta")  # 256 MiB it must not be charged for
    with _OpCostMode() as costs:
        weight.new_empty(0), torch.empty_like(weight)
        torch.empty(64, 1024, device="meta"), torch.empty_strided((64, 1024), (1, 64), device="meta")
        weight.new_zeros(8), torch.zeros_like(weight[0])
    # Allocations launch nothing; a fill writes its output only: 8 floats, then one 4 MiB matrix.
    assert sorted(shape.bytes for shape in costs.ops) == [32.0, 4 * 2**20]


def test_a_training_batch_norm_reads_its_data_twice_and_an_eval_one_once():
    from harness.project.op_costs import _OpCostMode

    norm = torch.nn.BatchNorm2d(64)
    x = torch.randn(8, 64, 32, 32, requires_grad=True)
    grad, tensor = torch.ones_like(x), x.numel() * 4

    def norm_bytes(training: bool) -> tuple[float, float]:
        norm.train(training)
        with _OpCostMode() as costs:
            y = norm(x)
            costs.phase = "backward"
            if training:
                y.backward(grad)
        big = {phase: sum(s.bytes * n for s, n in costs.ops.items() if s.phase == phase and s.bytes > tensor / 2)
               for phase in ("forward", "backward")}
        return big["forward"], big["backward"]

    # Training: statistics, then normalisation (x read twice, y written); backward: a reduction over dy and x,
    # then dx (each read twice, dx written). Eval: x read once with the running statistics, y written.
    forward, backward = norm_bytes(True)
    assert forward == pytest.approx(3 * tensor, rel=0.01) and backward == pytest.approx(5 * tensor, rel=0.01)
    assert norm_bytes(False)[0] == pytest.approx(2 * tensor, rel=0.01)


def test_matmul_reshaping_its_result_moves_no_bytes():
    from harness.project.op_costs import _OpCostMode

    x, weight = torch.randn(4, 256, 512), torch.randn(1024, 512)
    with _OpCostMode() as costs:
        torch.nn.functional.linear(x, weight)  # no bias: mm on [1024, 512], then _unsafe_view to [4, 256, 1024]
    # One kernel, the GEMM: its operands and result; the reshape returns the same storage.
    assert sum(costs.ops.values()) == 1
    assert sum(shape.bytes for shape in costs.ops) == 4 * (x.numel() + weight.numel() + 4 * 256 * 1024)


def test_a_gemm_is_unaligned_by_its_leading_dimensions_not_by_its_count_of_rows():
    from harness.project.op_costs import _OpCostMode

    def aligned(rows: int, out: int) -> bool:
        x, weight = torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(out, 64, dtype=torch.bfloat16)
        with _OpCostMode() as costs:
            y = torch.nn.functional.linear(x, weight)  # forward: x @ weight.T
            y.t() @ x  # a weight gradient: the rows are the reduction, read through a transposed view
        return all(shape.aligned for shape in costs.ops)

    assert aligned(512, 128) and aligned(511, 128)  # a 511-token prompt wastes part of a tile, no more
    assert aligned(511, 1)  # a rank-1 adapter's [511, 1] output is a vector: no leading dimension
    assert not aligned(512, 50257)  # GPT-2's head: its output's rows are 50,257 elements apart


def test_a_decoded_tokens_time_is_near_what_reading_its_experts_weights_takes():
    # Mixtral at one sequence: a decode step reads the 2 of 8 experts each layer picks, not all 8 (a
    # `weight.new_empty` beside each expert matmul was once charged with every expert's bytes: 2.3x slower).
    cell = Cell("gpt", "mixtral-8x7b", "infer", "bf16-weights", "h200", 1, "projected", prompt_len=1024, gen_len=16)
    trace = project(cell.resolve(PROFILES)).trace
    decode = sum(s.bytes * n for s, n in trace.ops.items() if s.phase == "decode_first")
    experts = sum(s.bytes * n for s, n in trace.ops.items() if s.phase == "decode_first" and s.op_class == "matmul")
    assert decode < 1.25 * experts  # the rest: attention's KV cache, norms, routing
    assert decode < 0.4 * trace.params_bytes


def test_a_decode_step_is_costed_by_the_bandwidth_it_streams_not_by_idle_sms():
    # An fp32 decode on CUDA cores: the A100 has 2.6x the A10's bandwidth but less fp32 peak (19.5 vs 31.2
    # TFLOP/s). A decode step's skinny matmuls stream their weights (GEMV, split-K), so the A100 decodes faster;
    # costed with a full wave's idle SMs each, the A10 came out 1.75x faster.
    def decode_s(gpu):
        cell = Cell("gpt", "gpt2-124m", "infer", "baseline", gpu, 8, "projected", prompt_len=896, gen_len=128)
        return project(cell.resolve(PROFILES)).generation.decode_mean_s

    assert decode_s("a100-sxm4-40gb") < 0.8 * decode_s("a10")


def test_int4_tinygemm_multiplies_at_its_own_rate_and_reads_only_its_packed_weight():
    # torchao's tinygemm runs about 15 TFLOP/s at any row count on an A6000 (speed_constants.toml): a prefill's
    # int4 GEMM takes about 1 / tinygemm_efficiency times the bf16 one, a one-row decode's is bound by the packed
    # weight it reads and so beats bf16, which reads four times the bytes.
    profile = PROFILES["a100-sxm4-80gb"]
    constants = _no_host(constants_for(profile))
    efficiency = constants.gpu.tinygemm_efficiency
    assert 0.05 < efficiency < 0.2

    def seconds(rows: int, tinygemm: bool) -> float:
        k = n = 4096
        weight = k * n * (0.5 + 4 / 32) if tinygemm else k * n * 2  # int4 + a 4-byte scale per 32, or bf16
        ops = dataclasses.replace(_gemm(2.0 * rows * k * n), bytes=np.array([weight + 2 * rows * (k + n)]),
                                  achievable=np.array([profile.achievable_flops["bf16"]]),
                                  datasheet=np.array([profile.peak("bf16")]), sm_count=profile.sm_count,
                                  bandwidth=profile.memory_bandwidth_bytes_s, tinygemm=np.array([tinygemm]))
        return step_time(ops, constants).step_s

    prefill = seconds(8192, True) / seconds(8192, False)
    assert 0.8 / efficiency < prefill <= 1 / efficiency
    assert seconds(1, True) < 0.4 * seconds(1, False)
    assert "tinygemm" in " ".join(step_time(dataclasses.replace(_gemm(1e9), tinygemm=np.array([True])),
                                            constants).notes)


def test_foreach_ops_launch_a_kernel_per_chunk_of_tensors():
    assert foreach_kernels(([torch.empty(1)] * 10, [torch.empty(1)] * 10)) == 1
    assert foreach_kernels(([torch.empty(1)] * 130,)) == 3
    assert foreach_kernels(([torch.empty(30_000_000)],)) == 2


def test_tf32_runs_fp32_matmuls_on_tensor_cores_where_the_gpu_has_them():
    assert "tf32" in TECHNIQUES
    fp32 = project(_cell(gpu="a100-sxm4-80gb", size="gpt2-124m", batch=8))
    tf32 = project(_cell(gpu="a100-sxm4-80gb", size="gpt2-124m", batch=8, technique="tf32"))
    assert tf32.trace.tf32 and tf32.trace.precision == "tf32"
    assert tf32.time.step_s < 0.6 * fp32.time.step_s  # 156 vs 19.5 TFLOP/s for the matmuls
    assert "Tesla T4 has no TF32 tensor cores" in _cell(gpu="t4", technique="tf32").unsupported
    assert "has no TF32" in _cell(gpu="cpu", technique="tf32").unsupported
    # Under autocast the row keeps its 16-bit label.
    assert project(_cell(technique="amp-bf16+tf32")).trace.precision == "bf16-mixed"


def test_the_tf32_switch_is_restored_after_a_step():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


_TRUTH = {"issue_python_s": 3e-5, "issue_engine_s": 8e-6, "issue_inference_s": 1.2e-5, "issue_conv_s": 2e-5,
          "overlap": 3.0, "kernel_s": 3e-6, "saturation_flops_per_sm": 2e7, "conv_efficiency": 0.5,
          "attention_efficiency": 0.7, "unaligned_efficiency": 0.5, "bandwidth_efficiency": 0.8}
_START = {k: v * 1.8 for k, v in _TRUTH.items()} | {"overlap": 2.0}


def _synthetic_gemm_steps() -> list[SpeedPoint]:
    """GEMM-only steps of several shapes and issuers, timed by the constants in _TRUTH."""
    profile = PROFILES["h100-sxm"]
    base = constants_for(profile)
    points = []
    for index, (flops, count) in enumerate([(1e6, 500), (1e9, 300), (1e10, 200), (1e11, 100), (1e12, 40),
                                             (1e13, 10), (3e9, 800), (2e11, 60)]):
        for aligned in (True, False):
            ops = _gemm(flops, count, aligned=aligned, issuer=("python", "engine", "inference")[index % 3])
            point = SpeedPoint(f"p{index}{aligned}", f"g{index}{aligned}", "synthetic", "bf16-mixed", profile.id,
                               ops, base, 1.0, "synthetic")
            points.append(dataclasses.replace(point, measured_s=projected_s(point, _TRUTH)))
    return points


def test_the_fit_recovers_constants_from_steps_they_generated_and_held_out_errors_stay_small():
    """Synthetic steps of several shapes timed by known constants: the fit must find them again (those GEMM-only
    steps inform; convolution, attention and bandwidth constants leave no trace in them)."""
    points = _synthetic_gemm_steps()
    found = fit(points, _START)
    for name in ("issue_python_s", "issue_engine_s", "issue_inference_s", "overlap", "kernel_s",
                 "saturation_flops_per_sm", "unaligned_efficiency"):
        assert found[name] == pytest.approx(_TRUTH[name], rel=0.01), name
    for point in points:
        assert projected_s(point, found) == pytest.approx(point.measured_s, rel=0.02)
    errors = [abs(r.error) for r in held_out(points[:8], _START)]
    assert np.median(errors) < 0.05


def test_a_fit_towards_priors_leaves_what_no_row_informs_at_its_prior_and_still_fits_the_rows():
    """No synthetic step has a convolution: its constants are pulled to their priors (without priors they
    stay wherever a start put them), while the steps are still reproduced."""
    points = _synthetic_gemm_steps()
    # 1.5 x truth, except attention, whose 1.05 would lie beyond its bound of 0.84
    priors = {k: v * 1.5 for k, v in _TRUTH.items()} | {"attention_efficiency": 0.8}
    pulled, free = fit(points, _START, priors), fit(points, _START)
    for name in ("conv_efficiency", "issue_conv_s"):
        assert pulled[name] == pytest.approx(priors[name], rel=1e-3)
        assert free[name] != pytest.approx(priors[name], rel=0.05)
    for point in points:
        assert projected_s(point, pulled) == pytest.approx(point.measured_s, rel=0.05)
