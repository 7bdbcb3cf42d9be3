"""LoRA and QLoRA (suites/techniques/adapters.py): what trains, what the frozen base costs, that the
adapters learn, their options, and their projection to a 7B model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.measure.tensors import gradient_bytes, optimizer_state_bytes, storage_bytes
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import project_outcome
from suites.step import Step
from suites.techniques import Run, Unsupported, parse_stack
from suites.techniques.adapters import NF4Linear, store_frozen_in
from suites.workloads import get_workload

PROFILES = load_profiles()


def _run(stack: str, workload: str = "gpt", batch_size: int = 4) -> tuple[Run, Step]:
    spec_workload = get_workload(workload)
    spec = spec_workload.size("smoke")
    torch.manual_seed(0)
    run = Run(workload=spec_workload, size=spec, mode="train", profile=PROFILES["cpu"],
              model=spec_workload.build(spec), batch_size=batch_size)
    parse_stack(stack).apply(run)
    return run, Step(run, torch.device("cpu"))


def _losses(run: Run, step: Step, steps: int = 4) -> list[float]:
    batch = run.workload.batch(run.size, run.batch_size, torch.Generator().manual_seed(1))
    return [float(step(batch)) for _ in range(steps)]


@pytest.mark.parametrize("stack, rank, targets", [("lora", 8, ("qkv", "proj", "up")),
                                                  ("lora:r=4:targets=qkv", 4, ("qkv",)),
                                                  ("qlora:r=16", 16, ("qkv", "proj", "up"))])
def test_only_the_adapters_train_and_their_count_is_r_times_in_plus_out(stack, rank, targets):
    workload = get_workload("gpt")
    whole = workload.build(workload.size("smoke"))
    adapted = [m for name, m in whole.named_modules()
               if isinstance(m, nn.Linear) and name.startswith("blocks.") and name.rsplit(".", 1)[-1] in targets]
    # LoRA's A is [r, in] and B is [out, r]: r (in + out) weights per adapted layer (Hu et al. 2021).
    expected = sum(rank * (m.in_features + m.out_features) for m in adapted)
    run, step = _run(stack)
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == expected
    _losses(run, step, steps=1)
    # Gradients and AdamW's two moments exist for the adapters only (fp32: 4 bytes each).
    assert gradient_bytes(run.model) == 4 * expected
    assert optimizer_state_bytes(step.optimizer) == pytest.approx(2 * 4 * expected, abs=8 * len(trainable))


def test_qlora_base_weights_take_a_quarter_of_bf16_plus_their_scales():
    run, _ = _run("qlora")
    bases = [m for m in run.model.modules() if isinstance(m, NF4Linear)]
    assert len(bases) == 8  # qkv, proj, up, proj in each of the smoke model's two blocks
    for base in bases:
        n = base.weight.numel()
        # 4 bits a weight (a quarter of bf16's 2 bytes) and an 8-bit scale per 64 weights (QLoRA's double
        # quantisation), plus under 1 KiB a tensor (the NF4 table, the scales' mean and factors, whose view
        # torchao keeps on a 512-byte storage).
        assert n // 2 + n // 64 <= storage_bytes([base.weight]) <= n // 2 + n // 64 + 1024
        assert not base.weight.requires_grad
    # QLoRA stores the whole frozen base in 4 bits, whichever layers carry adapters.
    qkv_only, _ = _run("qlora:targets=qkv")
    assert sum(isinstance(m, NF4Linear) for m in qkv_only.model.modules()) == 8
    assert {name.split(".")[3] for name, p in qkv_only.model.named_parameters() if p.requires_grad} == {"qkv"}


def test_a_target_that_names_no_layer_is_refused_with_the_names_there_are():
    # One typo among good targets would otherwise adapt fewer layers than asked, silently.
    with pytest.raises(Unsupported, match=r"named qkvv in gpt's blocks \(its blocks' Linear or Conv2d layers: "
                                          r"proj, qkv, up\)"):
        _run("lora:targets=qkv/qkvv")


@pytest.mark.parametrize("stack, workload", [("lora", "gpt"), ("qlora", "gpt"), ("lora", "bert"),
                                             ("qlora+amp-bf16", "bert"), ("lora", "resnet50")])
def test_adapters_learn_on_the_smoke_sizes(stack, workload):
    run, step = _run(stack, workload)
    losses = _losses(run, step)
    assert losses[-1] < losses[0]
    assert losses[0] == pytest.approx(_losses(*_run("baseline", workload), steps=1)[0], rel=1e-2)  # B starts at 0


def test_frozen_layers_stored_in_autocasts_dtype_compute_the_same():
    run, _ = _run("lora")
    batch = run.workload.batch(run.size, 2, torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = run.workload.forward(run.model, batch)
    assert store_frozen_in(run.model, torch.bfloat16) == 8
    assert store_frozen_in(run.model, torch.bfloat16) == 0  # already stored: a second call converts nothing
    assert all(p.dtype == torch.bfloat16 for n, p in run.model.named_parameters() if "base_layer" in n)
    assert all(p.dtype == torch.float32 for p in run.model.parameters() if p.requires_grad)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = run.workload.forward(run.model, batch)
    assert torch.equal(before, after)  # autocast cast these weights to bf16 for every matmul anyway


def test_options_are_checked_with_a_one_line_reason():
    assert parse_stack("lora:targets=qkv/proj:r=4+amp-bf16").name == "lora:r=4:targets=proj/qkv+amp-bf16"
    assert parse_stack("lora:r=08:alpha=16").name == "lora"  # one spelling per configuration
    for text, message in [("lora:", "key=value"), ("lora:r=4:r=8", "given twice"), ("lora:alpha=nan", "positive"),
                          ("amp-bf16:r=4", "takes no options"), ("lora:r", "key=value"),
                          ("lora:rank=4", "takes options r, alpha and targets"), ("lora:r=x", "whole number"),
                          ("lora:r=0", "at least 1"), ("lora+qlora", r"both of one kind \(adapters\)")]:
        with pytest.raises(ValueError, match=message):
            parse_stack(text)


def test_adapters_are_for_training_and_qlora_for_linear_layers():
    assert "merge into the weights" in Cell("gpt", "smoke", "infer", "lora", "cpu", 2).resolve(PROFILES).unsupported
    cell = Cell("resnet50", "smoke", "train", "qlora", "cpu", 2).resolve(PROFILES)
    row = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    assert row.status == "unsupported" and "NF4 base weights are for Linear layers" in row.reason


def test_a_lora_cell_is_measured_with_its_small_gradients():
    rows = {}
    for technique in ("baseline", "lora"):
        cell = Cell("gpt", "smoke", "train", technique, "cpu", 2).resolve(PROFILES)
        rows[technique] = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    assert rows["lora"].status == "ok"
    assert rows["lora"].grads_bytes < rows["baseline"].grads_bytes / 5
    assert rows["lora"].optimizer_bytes < rows["baseline"].optimizer_bytes / 5


def test_a_7b_fine_tune_fits_a_24gb_gpu_with_qlora_and_not_in_full():
    def projected(technique):
        return project_outcome(Cell("gpt", "gpt-7b", "train", technique, "l4", 1, source="projected")
                               .resolve(PROFILES))

    full, lora, qlora = (projected(t) for t in ("amp-bf16+checkpointing", "lora+amp-bf16+checkpointing",
                                                "qlora+amp-bf16+checkpointing"))
    assert full.status == "oom" and lora.status == "ok" and qlora.status == "ok"
    # Full fine-tuning: 16 bytes a parameter of model states (fp32 weights, gradients, two moments). LoRA:
    # the frozen blocks in bf16 (2 bytes); QLoRA: NF4 (about half a byte), the fp32 embeddings unchanged.
    assert full.memory.params + full.memory.grads + full.memory.optimizer > 7 * lora.memory.params
    assert qlora.memory.params < 0.4 * lora.memory.params
    assert lora.memory.grads < full.memory.grads / 100


@pytest.mark.parametrize("stack, message", [("qat-int8+lora", "replaced them with"),
                                            ("fp8+lora", "replaced them with")])
def test_adapters_refuse_layers_another_technique_replaced(stack, message):
    profile = PROFILES["h100-sxm"]
    workload = get_workload("gpt")
    spec = workload.size("smoke")
    run = Run(workload=workload, size=spec, mode="train", profile=profile, model=workload.build(spec), batch_size=2)
    with pytest.raises(Unsupported, match=message):
        parse_stack(stack).apply(run)


def test_storing_frozen_weights_keeps_tied_and_subclassed_layers_as_they_are():
    class OwnLinear(nn.Linear):  # stands for Float8Linear, a QAT layer or NF4Linear: its own forward
        pass

    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False), nn.Linear(8, 8), OwnLinear(8, 8))
    model[1].weight = model[0].weight  # a head tied to the embedding
    for p in model.parameters():
        p.requires_grad_(False)
    assert store_frozen_in(model, torch.bfloat16) == 1  # only the untied, plain Linear
    assert model[1].weight is model[0].weight and model[1].weight.dtype == torch.float32
    assert model[2].weight.dtype == torch.bfloat16
    assert model[3].weight.dtype == model[3].bias.dtype == torch.float32


def test_qlora_runs_under_fp16_autocast():
    run, step = _run("qlora+amp-fp16")
    losses = _losses(run, step, steps=2)
    assert all(math.isfinite(v) for v in losses)
    bases = [m for m in run.model.modules() if isinstance(m, NF4Linear)]
    assert bases and all(type(m.weight).__name__ == "NF4Tensor" for m in bases)  # still 4-bit after the step


@pytest.mark.parametrize("stack", ["lora", "lora:targets=proj", "qlora:targets=proj"])
def test_tensor_parallelism_refuses_layers_an_adapter_or_a_4_bit_base_replaced(stack):
    from suites.techniques.tensor_parallel import tp_modules

    workload = get_workload("gpt")
    assert tp_modules(workload.build(workload.size("smoke")), workload, 2)  # plain Linear layers shard
    run, _ = _run(stack)
    # An adapter's wrapper (PEFT) or an NF4 weight cannot be split by ColwiseParallel / RowwiseParallel.
    with pytest.raises(Unsupported, match="shards plain Linear layers"):
        tp_modules(run.model, workload, 2)
    # So the stack says so before anything runs or is projected; sharded data parallelism takes adapters.
    gpu = PROFILES["h100-sxm"]
    assert "adapters wrap them first" in parse_stack(f"{stack}+tensor-parallel").check(gpu, workload, "train")
    assert parse_stack(f"{stack}+fsdp").check(gpu, workload, "train") is None


def test_qlora_keeps_a_mixtures_router_in_its_dtype():
    from suites.techniques.expert import moe_layers

    workload = get_workload("gpt")
    spec = workload.size("moe-smoke")
    run = Run(workload=workload, size=spec, mode="train", profile=PROFILES["cpu"], model=workload.build(spec),
              batch_size=2)
    parse_stack("qlora").apply(run)
    routers = [getattr(layer.router, "base_layer", layer.router) for layer in moe_layers(run.model)]  # adapted or not
    assert routers and all(type(router) is nn.Linear for router in routers)  # not NF4: it picks the experts
    assert any(isinstance(m, NF4Linear) for m in run.model.modules())  # the rest of the base is


def test_a_projection_says_when_frozen_weights_are_held_in_autocasts_dtype():
    # amp-bf16+lora holds the frozen base in bf16: its parameter bytes fall below an fp32 lora's, and the row says why.
    from harness.project import project_outcome

    cells = {stack: Cell("gpt", "gpt2-124m", "train", stack, "h100-sxm", 2, "projected").resolve(PROFILES)
             for stack in ("lora", "amp-bf16+lora")}
    lora, mixed = (project_outcome(cell) for cell in cells.values())
    assert mixed.memory.params < 0.75 * lora.memory.params
    assert any(note.startswith("the weights of ") and "frozen layers held in bfloat16" in note for note in mixed.notes)
    assert not any("frozen layers held in" in note for note in lora.notes)
