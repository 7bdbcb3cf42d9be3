"""Model FLOPs of a cell: the numerator of MFU, shared by measured and projected rows.

MFU counts the work of the model being trained or served, without recomputation: the workload's
analytic count (PaLM's 6N-style formula, comparable with published MFU figures) for the model as
built. Techniques that change the architecture (the STRUCTURE phase: low-rank factors, pruned heads
and channels; sharing weights changes none) change that work, so the count is scaled by how much they
shrink one forward's FLOPs, counted by `FlopCounterMode` on fake tensors; adapters (LoRA, QLoRA) change
the training step's, whose frozen weights get no gradient, counted likewise over a forward and backward.
Techniques that store the same math differently (quantisation, sparsity, precision) leave it unchanged, by the usual
dense-equivalent convention; FlopCounterMode does not count their int8 or sparse kernels, so they
must not enter the ratio.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from harness.cell import ResolvedCell
from suites.techniques import Run, Stack
from suites.techniques.base import Phase
from suites.workloads.base import SizeSpec, Workload
from suites.workloads.fragmentation import loop_specs


def analytic_flops_per_sample(workload: Workload, spec: SizeSpec, mode: str) -> float:
    """The workload's analytic FLOPs per sample of the model as built (forward + backward in training; in
    a served decoder's generation, one forward of every token it processes: the prompt in the prefill and
    each generated token but the last in a decode step)."""
    if mode == "train":
        loop = loop_specs(workload, spec, mode) or [spec]  # a variable-length loop: its mean step's
        return sum(map(workload.train_flops_per_sample, loop)) / len(loop)
    if spec.gen_len is not None:
        spec = dataclasses.replace(spec, seq_len=spec.seq_len + spec.gen_len - 1, gen_len=None)
    return workload.forward_flops_per_sample(spec)


def model_flops_per_sample(cell: ResolvedCell) -> float:
    """Analytic FLOPs per sample of the model the cell's stack builds (forward + backward in training)."""
    workload, spec, mode = cell.workload, cell.spec, cell.mode
    analytic = analytic_flops_per_sample(workload, spec, mode)
    structure = tuple(t for t in cell.stack.techniques if t.phase == Phase.STRUCTURE)
    if structure:
        as_built = _counted(cell, Stack(()))
        analytic = analytic * _counted(cell, Stack(structure)) / as_built if as_built else analytic
    adapters = tuple(_dense_adapter(t) for t in cell.stack.techniques if t.exclusive == "adapters")
    if mode == "train" and adapters:
        # A frozen weight gets no weight gradient: LoRA trains with about 2/3 of full training's FLOPs.
        full = _counted_training(cell, Stack(structure))
        analytic = analytic * _counted_training(cell, Stack(structure + adapters)) / full if full else analytic
    return analytic


def _dense_adapter(technique):
    """The adapter technique whose math `technique` does: QLoRA's NF4 base weights are dequantised for each
    matmul (the dense-equivalent convention), so its FLOPs are LoRA's with the same options."""
    if technique.id.partition(":")[0] != "qlora":
        return technique
    from suites.techniques import parse_stack

    (lora,) = parse_stack("lora" + technique.id[len("qlora"):]).techniques
    return lora


def _counted_training(cell: ResolvedCell, stack: Stack) -> float:
    spec = cell.spec
    key = ("train-step", cell.workload.name, spec.name, tuple(sorted(spec.config.items())), spec.seq_len,
           spec.image_size, stack.name)
    if key not in _COUNTED:
        _COUNTED[key] = training_flops(cell.workload, spec, stack, cell.profile)
    return _COUNTED[key]


def training_flops(workload: Workload, spec: SizeSpec, stack: Stack, profile=None) -> float:
    """FLOPs of one training forward and backward per sample through the model `stack` builds, counted by
    FlopCounterMode on fake tensors: autograd computes no gradient for a weight the stack freezes."""
    from harness.project.lean_import import quiet_module_tracking  # harness.project builds on this module

    samples = 2  # BatchNorm in training needs more than one value per channel
    with FakeTensorMode(allow_non_fake_inputs=False):
        run = Run(workload=workload, size=spec, mode="train", profile=profile, model=workload.build(spec),
                  batch_size=samples)
        stack.apply(run)
        batch = workload.batch(spec, samples, torch.Generator().manual_seed(0))
        counter = FlopCounterMode(display=False)
        with counter, quiet_module_tracking(), sdpa_kernel(SDPBackend.MATH):
            workload.loss(run.model, batch).backward()
    return float(counter.get_total_flops()) / samples


BASELINE = Stack(())
# (size, stack, mode) -> one forward's counted FLOPs: each model is counted once per process (the
# model as built once for both modes: an empty stack does not depend on it).
_COUNTED: dict[tuple, float] = {}


def _counted(cell: ResolvedCell, stack: Stack) -> float:
    spec = cell.spec
    size_key = (cell.workload.name, spec.name, tuple(sorted(spec.config.items())), spec.seq_len, spec.image_size)
    key = (size_key, stack.name, cell.mode if stack.techniques else None)
    if key not in _COUNTED:
        _COUNTED[key] = forward_flops(cell.workload, spec, stack, cell.mode, cell.profile)
    return _COUNTED[key]


def forward_flops(workload: Workload, spec: SizeSpec, stack: Stack = BASELINE, mode: str = "infer",
                  profile=None) -> float:
    """FLOPs of one forward of one sample through the model `stack` builds, counted by FlopCounterMode."""
    from harness.project.lean_import import quiet_module_tracking  # harness.project builds on this module

    # Fake tensors: no memory and no real compute, so a large model counts in seconds.
    with FakeTensorMode(allow_non_fake_inputs=False):
        run = Run(workload=workload, size=spec, mode=mode, profile=profile, model=workload.build(spec),
                  batch_size=1)
        stack.apply(run)
        batch = workload.batch(spec, 1, torch.Generator().manual_seed(0))
        run.model.eval()  # same FLOPs; BatchNorm in training would refuse a batch of one
        counter = FlopCounterMode(display=False)
        # The math path: FlopCounterMode has no formula for the CPU's fused attention kernel, and
        # attention is part of the analytic count being scaled.
        with counter, quiet_module_tracking(), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            workload.forward(run.model, batch)
    return float(counter.get_total_flops())
