"""Model FLOPs, MFU's numerator: the analytic count, scaled only by techniques that change the architecture."""

from __future__ import annotations

import dataclasses

import pytest

from harness.cell import Cell
from harness.model_flops import forward_flops, model_flops_per_sample
from harness.profiles import load_profiles
from suites.techniques import Stack, parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()
H100 = PROFILES["h100-sxm"]


def _flops(technique: str, mode: str = "train", workload: str = "gpt") -> float:
    cell = Cell(workload, "smoke", mode, parse_stack(technique).name, H100.id, 2, source="projected")
    return model_flops_per_sample(cell.resolve(PROFILES))


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_the_model_as_built_keeps_the_analytic_count(mode):
    spec = WORKLOADS["gpt"].sizes["smoke"]
    # Inference of a decoder is a generation: a 56-token prompt and 8 generated tokens, each token but the
    # last going through one forward.
    analytic = WORKLOADS["gpt"].train_flops_per_sample(spec) if mode == "train" else (
        WORKLOADS["gpt"].forward_flops_per_sample(dataclasses.replace(spec, seq_len=56 + 8 - 1)))
    assert _flops("baseline", mode) == analytic
    # Same math in other storage or precision, or recomputed: the same model FLOPs (dense-equivalent).
    for technique in ("amp-bf16", "checkpointing", "param-sharing", "qat-int8"):
        assert _flops(technique, mode) == analytic, technique


@pytest.mark.parametrize("workload", ["gpt", "resnet50"])
def test_techniques_that_shrink_the_architecture_shrink_the_model_flops(workload):
    baseline = _flops("baseline", workload=workload)
    for technique in ("low-rank", "structured-pruning"):
        ratio = _flops(technique, workload=workload) / baseline
        assert 0.3 < ratio < 0.95, f"{technique}: {ratio}"
    # Stacked with a precision, the ratio is the architecture's alone.
    assert _flops("low-rank+amp-bf16", workload=workload) == _flops("low-rank", workload=workload)


@pytest.mark.parametrize("workload", ["gpt", "bert", "resnet50"])
def test_the_counted_forward_of_the_model_as_built_is_the_analytic_count(workload):
    # So the ratio scales like with like: attention included (counted on its math path).
    spec = WORKLOADS[workload].sizes["smoke"]
    counted = forward_flops(WORKLOADS[workload], spec, Stack(()), "infer", H100)
    assert counted == pytest.approx(WORKLOADS[workload].forward_flops_per_sample(spec), rel=1e-9)


def test_adapters_train_without_the_frozen_weights_gradients():
    # Training a frozen weight's layer computes its input's gradient but not the weight's: about 2/3 of full
    # training's FLOPs (attention's score products keep both gradients), plus the small adapters'. QLoRA
    # dequantises to the same matmuls (dense-equivalent), so it counts as LoRA does.
    def flops(technique: str) -> float:
        cell = Cell("gpt", "gpt2-124m", "train", parse_stack(technique).name, H100.id, 8, source="projected")
        return model_flops_per_sample(cell.resolve(PROFILES))

    full, lora = flops("amp-bf16"), flops("amp-bf16+lora")
    assert 2 / 3 < lora / full < 0.8
    assert flops("amp-bf16+qlora") == lora and flops("lora") == lora
    assert flops("amp-bf16+lora:r=64") > lora  # wider adapters, more of their own FLOPs
