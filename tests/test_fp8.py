"""fp8 (T1): support reasons per GPU, and torchao's Linear swap as far as it runs without fp8 hardware."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import TECHNIQUES, Run, parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()


def _reason(profile: str, workload: str = "gpt", mode: str = "train") -> str | None:
    return parse_stack("fp8").check(PROFILES[profile], WORKLOADS[workload], mode)


def test_fp8_is_a_precision_technique():
    assert TECHNIQUES["fp8"].exclusive == "precision" and TECHNIQUES["fp8"].changes_numerics
    with pytest.raises(ValueError, match="incompatible"):
        parse_stack("amp-bf16+fp8")


def test_fp8_needs_fp8_tensor_cores():
    assert _reason("cpu") == "fp8: fp8 training needs CUDA fp8 tensor cores; the host CPU has none"
    for profile, cc in (("t4", "7.5"), ("a100-sxm4-80gb", "8.0"), ("a10", "8.6")):
        reason = _reason(profile)
        assert "compute capability >= 8.9" in reason and reason.endswith(f"is {cc}"), reason
    assert "no fp8 tensor cores" in _reason("mi250x")


def test_fp8_reasons_on_capable_gpus():
    if importlib.util.find_spec("torchao") is None:
        assert "torchao is not installed" in _reason("h100-sxm")
        return
    for profile in ("h100-sxm", "h200", "l4", "l40s", "b200"):
        assert _reason(profile) is None and _reason(profile, "bert") is None
    assert "convolutions" in _reason("h100-sxm", "resnet50")
    assert "inference_mode" in _reason("h100-sxm", mode="infer")


@pytest.mark.parametrize("workload_name", ["gpt", "bert"])
def test_fp8_swaps_linear_layers_for_float8(workload_name):
    try:
        from torchao.float8.float8_linear import Float8Linear
    except Exception as exc:  # not installed, or built for another torch (it then fails in other ways)
        pytest.skip(f"torchao's float8 does not import here ({type(exc).__name__}): fp8 is then unsupported")

    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    torch.manual_seed(0)
    model = workload.build(spec)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # Built for an H100 but applied here: the conversion is module surgery and runs on any device.
    run = Run(workload=workload, size=spec, mode="train", profile=PROFILES["h100-sxm"], model=model,
              batch_size=spec.batch_size)
    parse_stack("fp8").apply(run)
    modules = dict(run.model.named_modules())
    assert linears and all(isinstance(modules[name], Float8Linear) for name in linears)
    assert run.precision == "fp8-mixed" and run.autocast_dtype == torch.bfloat16
    # A training step, as far as torchao runs fp8 matmuls on this machine's CPU (emulated, no tensor cores).
    batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(0))
    try:
        loss = Step(run, torch.device("cpu"))(batch)
    except (NotImplementedError, RuntimeError) as exc:
        pytest.skip(f"torchao's float8 matmul does not run on this CPU: {exc}")
    assert torch.isfinite(loss)
    assert all(modules[name].weight.grad is not None for name in linears)
