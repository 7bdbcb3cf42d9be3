"""Techniques: stack parsing, support checks, and numerics-preserving techniques matching baseline."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.profiles import load_profiles
from suites.step import Step
from suites.techniques import TECHNIQUES, Phase, Run, Stack, parse_stack, technique_names
from suites.workloads import WORKLOADS

PROFILES = load_profiles()
CPU = PROFILES["cpu"]


def test_stack_is_applied_in_phase_order_and_named_canonically():
    stack = parse_stack("grad-accumulation+amp-bf16+checkpointing")
    assert stack.name == "checkpointing+amp-bf16+grad-accumulation"
    assert parse_stack("amp-bf16+grad-accumulation+checkpointing").name == stack.name
    phases = [t.phase for t in stack.techniques]
    assert phases == sorted(phases)
    assert parse_stack("baseline").techniques == ()
    assert parse_stack("baseline").name == "baseline"


@pytest.mark.parametrize("text, fragment", [
    ("amp-bf17", "did you mean amp-bf16"),
    ("amp-bf16+amp-fp16", "incompatible stack"),
    ("checkpointing+checkpointing", "appears twice"),
    ("baseline+amp-bf16", "cannot be stacked"),
    ("", "empty technique stack"),
])
def test_bad_stacks_are_one_line_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        parse_stack(text)
    assert "\n" not in str(info.value)


def test_registry_lists_the_first_techniques():
    assert {"baseline", "amp-bf16", "amp-fp16", "checkpointing", "grad-accumulation"} <= set(technique_names())


def test_bf16_is_unsupported_on_a_t4_with_the_reason():
    reason = parse_stack("amp-bf16").check(PROFILES["t4"], WORKLOADS["gpt"], "train")
    assert reason and "bf16" in reason and "7.5" in reason
    assert parse_stack("amp-bf16").check(PROFILES["a100-sxm4-80gb"], WORKLOADS["gpt"], "train") is None


@pytest.mark.parametrize("technique", ["checkpointing", "grad-accumulation"])
def test_training_only_techniques_are_unsupported_for_inference(technique):
    reason = parse_stack(technique).check(CPU, WORKLOADS["bert"], "infer")
    assert reason and "training" in reason


def _one_step(workload_name: str, stack_text: str, model, batch):
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=model,
              batch_size=next(iter(batch.values())).shape[0],
              optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1))
    parse_stack(stack_text).apply(run)
    step = Step(run, torch.device("cpu"))
    loss = step(batch)
    grads = {name: p.grad.clone() for name, p in run.model.named_parameters()}
    return loss, grads, run


def _clean(name: str) -> str:
    # checkpoint_wrapper inserts `_checkpoint_wrapped_module.` into parameter names.
    return name.replace("_checkpoint_wrapped_module.", "")


# Parallel techniques need a process group: their numerics are checked on two gloo ranks (test_parallel.py).
NUMERICS_CASES = [(w, t) for w in WORKLOADS for t in TECHNIQUES
                  if not TECHNIQUES[t].changes_numerics and TECHNIQUES[t].phase not in (Phase.PARALLEL,
                                                                                       Phase.DATA_PARALLEL)]


@pytest.mark.parametrize("workload_name, technique", NUMERICS_CASES)
def test_numerics_preserving_techniques_match_baseline(workload_name, technique):
    workload = WORKLOADS[workload_name]
    if technique == "grad-accumulation" and workload.traits.batch_norm:
        pytest.skip("batch norm normalises over each micro-batch, so accumulation changes ResNet's numerics")
    # Checked against a GPU, so only the workload's limits skip a case (the CPU refuses CUDA-only settings).
    reason = TECHNIQUES[technique].check(PROFILES["a100-sxm4-80gb"], workload, "train")
    if reason:
        pytest.skip(f"{technique} does not run on {workload_name}: {reason}")
    spec = workload.sizes["smoke"]
    torch.manual_seed(0)
    model = workload.build(spec)
    batch = workload.batch(spec, spec.batch_size, torch.Generator().manual_seed(1))
    base_loss, base_grads, _ = _one_step(workload_name, "baseline", copy.deepcopy(model), batch)
    loss, grads, run = _one_step(workload_name, technique, copy.deepcopy(model), batch)
    torch.testing.assert_close(loss, base_loss, rtol=1e-5, atol=1e-6)
    grads = {_clean(name): g for name, g in grads.items()}
    assert grads.keys() == base_grads.keys()
    for name, grad in base_grads.items():
        # Rounding of reassociated sums (another convolution algorithm, for another layout) scales with the
        # tensor's largest values, not with each element: the absolute tolerance follows that scale.
        atol = max(1e-6, 1e-5 * grad.abs().max().item())
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=atol, msg=f"gradient of {name}")


def test_grad_accumulation_really_splits_the_batch():
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    calls = []
    original_loss = workload.loss

    model = workload.build(spec)
    batch = workload.batch(spec, 8, torch.Generator().manual_seed(0))
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=model, batch_size=8)
    parse_stack("grad-accumulation").apply(run)
    run.workload = copy.copy(workload)
    object.__setattr__(run.workload, "loss", lambda m, b: calls.append(b["input_ids"].shape[0]) or original_loss(m, b))
    Step(run, torch.device("cpu"))(batch)
    assert calls == [2, 2, 2, 2]


def test_grad_accumulation_rejects_an_indivisible_batch():
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=workload.build(spec), batch_size=6)
    from suites.techniques import Unsupported

    with pytest.raises(Unsupported, match="not divisible by 4"):
        parse_stack("grad-accumulation").apply(run)


def test_checkpointing_wraps_every_block():
    workload = WORKLOADS["bert"]
    spec = workload.sizes["smoke"]
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=workload.build(spec), batch_size=4)
    parse_stack("checkpointing").apply(run)
    blocks = workload.blocks(run.model)
    assert blocks and all(type(b).__name__ == "CheckpointWrapper" for b in blocks)


@pytest.mark.parametrize("technique, dtype", [("amp-bf16", torch.bfloat16), ("amp-fp16", torch.float16)])
def test_mixed_precision_runs_matmuls_in_16_bit(technique, dtype):
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    run = Run(workload=workload, size=spec, mode="infer", profile=CPU, model=workload.build(spec), batch_size=2)
    parse_stack(technique).apply(run)
    step = Step(run, torch.device("cpu"))
    out = step(workload.batch(spec, 2, torch.Generator().manual_seed(0)))
    assert out.dtype == dtype
    assert run.loss_scaling is False  # no backward in inference, so no loss scaling


def test_fp16_training_uses_a_grad_scaler():
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=workload.build(spec), batch_size=4)
    parse_stack("amp-fp16").apply(run)
    step = Step(run, torch.device("cpu"))
    loss = step(workload.batch(spec, 4, torch.Generator().manual_seed(0)))
    assert step.scaler is not None and step.scaler.get_scale() > 1
    assert torch.isfinite(loss)


@pytest.mark.parametrize("stack, exchanged", [("checkpointing", 4), ("checkpointing+amp-bf16", 2),
                                               ("checkpointing+amp-fp16", 2)])
def test_techniques_applied_before_autocast_know_the_bytes_of_the_outputs_they_exchange(stack, exchanged):
    # Tensor and expert parallelism (applied before the step's autocast) count the layer outputs they
    # all-reduce or send back in autocast's dtype: amp declares it before any technique applies.
    from dataclasses import replace

    from suites.techniques.base import output_bytes

    workload = WORKLOADS["gpt"]
    spec = workload.size("smoke")
    seen = []
    techniques = parse_stack(stack).techniques
    spy = replace(techniques[0], apply=lambda run: seen.append(output_bytes(run)))  # the CHECKPOINT phase
    run = Run(workload=workload, size=spec, mode="train", profile=CPU, model=workload.build(spec), batch_size=2)
    Stack((spy, *techniques[1:])).apply(run)
    assert seen == [exchanged] and output_bytes(run) == exchanged


def test_torchaos_pytree_enum_notice_is_filtered_and_other_pytree_warnings_are_not(caplog):
    import logging

    import suites.techniques  # noqa: F401  (installs the filter)

    logger = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        logger.warning("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile")
        logger.warning("something else about pytrees")
    assert [r.getMessage() for r in caplog.records] == ["something else about pytrees"]
