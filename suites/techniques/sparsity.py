"""Sparsity (guide T10-T12): zero most weights or activations, then hope a kernel skips the zeros.

2:4 semi-structured sparsity keeps the 2 largest of every 4 consecutive weights, a pattern Ampere and
newer sparse tensor cores multiply at up to twice the dense rate from half the values plus 2-bit
indices (Mishra et al. 2021, arXiv:2104.08378; PyTorch's `torch.sparse.to_sparse_semi_structured` and
its tutorial "Accelerating BERT with semi-structured sparsity"). Unstructured pruning removes single
weights by global magnitude, iteratively with recovery training in between (Han et al. 2015,
arXiv:1506.02626; `torch.nn.utils.prune`). Dynamic sparsity (T12) is in dynamic_sparsity.py. A zero
stored densely costs as much as any other number: only sparse storage saves memory.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.ao.pruning import WeightNormSparsifier
from torch.nn.utils import prune

from suites.techniques.base import Phase, Run, Technique, Unsupported, always

# Buffer holding the bool mask that keeps pruned weights at zero while training (1 byte per weight).
MASK = "sparsity_mask"

# --- shared helpers ---------------------------------------------------------------------------------


def block_modules(run: Run, types: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every distinct module of `types` inside the workload's repeated blocks.

    Shared modules (ALBERT-style parameter sharing) appear once, under their first name.
    """
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks")
    inside = {id(m) for container in containers for m in container.modules() if isinstance(m, types)}
    return [(name, m) for name, m in run.model.named_modules() if id(m) in inside]


def replace_modules(model: nn.Module, replacements: dict[int, nn.Module]) -> None:
    """Swap every child whose id is a key for its replacement, wherever (and however often) it sits."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, name, replacements[id(child)])


def hold_masks(run: Run, modules: list[nn.Module], masks: list[torch.Tensor]) -> int:
    """Keep pruned weights at zero while training; returns the bytes the masks add.

    The optimizer would otherwise revive every pruned weight on its first step. As NVIDIA's ASP does for
    2:4 (apex.contrib.sparsity), each mask is applied again after every optimizer step; it is stored as a
    bool buffer of the module, so it moves with the model and counts in the parameter bytes.
    """
    for module, mask in zip(modules, masks, strict=True):
        module.register_buffer(MASK, mask.to(torch.bool))
    factory = run.optimizer_factory

    def optimizer_factory(params) -> torch.optim.Optimizer:
        optimizer = factory(params)
        optimizer.register_step_post_hook(lambda *_: apply_masks(modules))
        return optimizer

    run.optimizer_factory = optimizer_factory
    return sum(m.numel() for m in masks)


@torch.no_grad()
def apply_masks(modules: list[nn.Module]) -> None:
    for module in modules:
        weight, mask = module.weight, getattr(module, MASK)
        weight.mul_(mask if mask.device == weight.device else mask.to(weight.device))


def zero_fraction(tensors) -> float:
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    return sum(int((t == 0).sum()) for t in tensors) / total if total else 0.0


def tracing(model: nn.Module) -> bool:
    """Whether the model is made of fake tensors (the projection's trace): shapes are real, values are not.

    Which weights magnitude pruning removes depends on values, so a traced run skips the selection and
    builds only what has a shape: masks, sparse layouts sized by the known number of nonzeros.
    """
    return any(is_fake(p) for p in model.parameters())


TRACE_NOTE = ("projected from a fake-tensor trace: no weight values, so the pruning selection is skipped "
              "and only the resulting shapes are modelled")


# --- 2:4 semi-structured (T10) ----------------------------------------------------------------------

# cuSPARSELt and CUTLASS take fp16/bf16/int8 operands (not fp32); fp16 as in PyTorch's BERT tutorial.
SEMI_STRUCTURED_DTYPE = torch.float16


def two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 largest |w| of every 4 consecutive weights along the input dimension."""
    rows, cols = weight.shape
    if cols % 4:
        raise ValueError(f"2:4 groups need an input dimension divisible by 4, got {cols}")
    groups = weight.detach().abs().reshape(rows, cols // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).reshape(rows, cols)


def semi_structured_fits(weight: torch.Tensor) -> bool:
    """Whether both semi-structured backends take this shape: cuSPARSELt wants multiples of 16 and CUTLASS
    (fp16) rows in multiples of 32 and columns in multiples of 64 (torch.sparse.semi_structured)."""
    rows, cols = weight.shape
    return rows % 32 == 0 and cols % 64 == 0


def semi_structured_backend(device: torch.device) -> str | None:
    """The kernel library PyTorch's 2:4 tensors would use on `device`: cuSPARSELt where PyTorch was
    built with it, else CUTLASS, whose 2:4 kernels exist for compute capability 8.x only; None if neither."""
    cusparselt = getattr(torch.backends, "cusparselt", None)
    if cusparselt is not None and cusparselt.is_available():
        return "cusparselt"
    return "cutlass" if torch.cuda.get_device_capability(device)[0] == 8 else None


class SemiStructuredLinear(nn.Module):
    """A 2:4-pruned Linear whose weight becomes a semi-structured sparse tensor when moved to CUDA.

    The harness builds and transforms the model on the CPU and only then moves it to the device, and
    `to_sparse_semi_structured` takes CUDA tensors only; so the compression happens in `_apply`, the
    hook `Module.to` runs on every module. Inference only: PyTorch's semi-structured weights have no
    backward (sparse training keeps dense masked weights, as in NVIDIA's recipe).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Inference-only state: buffers, not frozen Parameters (nothing trains them, and PyTorch's MemTracker,
        # used by the projection, hooks the gradient of every Parameter).
        self.register_buffer("weight", linear.weight.detach())
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)

    @property
    def compressed(self) -> bool:
        return isinstance(self.weight, torch.sparse.SparseSemiStructuredTensor)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.is_cuda and not self.compressed and semi_structured_backend(self.weight.device):
            self.compress()  # without a backend the layer stays masked dense (same numbers, dense speed)
        return self

    @torch.no_grad()
    def compress(self) -> None:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        if semi_structured_backend(self.weight.device) == "cutlass":
            SparseSemiStructuredTensor._FORCE_CUTLASS = True  # the tutorial's fallback without cuSPARSELt
        dense = self.weight.detach().to(SEMI_STRUCTURED_DTYPE).contiguous()
        self.weight = to_sparse_semi_structured(dense)  # assigning to a buffer's name replaces the buffer
        if self.bias is not None:
            self.bias = self.bias.to(SEMI_STRUCTURED_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compressed:
            return F.linear(x, self.weight, self.bias)
        # The sparse kernel needs its own dtype on both operands: no autocast casts inside.
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x.to(self.weight.dtype).contiguous(), self.weight, self.bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 2:4 semi-structured"


def _sparse_kernels(profile) -> bool:
    cc = profile.cc_tuple
    return profile.vendor == "nvidia" and cc is not None and cc >= (8, 0) and profile.has("sparse_2to4")


def _check_2to4(profile, workload, mode) -> str | None:
    if workload.traits.convolutional:
        return ("2:4 sparsity here prunes the blocks' nn.Linear layers, as PyTorch's semi-structured kernels "
                f"are matmuls; {workload.name}'s blocks are convolutions")
    if profile.vendor == "cpu":
        return None  # the masked dense model runs, so accuracy is measurable; the notes say the rest
    cc = profile.cc_tuple
    if cc is not None and cc < (8, 0):
        return (f"2:4 sparsity needs sparse tensor cores: compute capability >= 8.0, {profile.name} is "
                f"{profile.compute_capability}")
    if not profile.has("sparse_2to4"):
        return f"{profile.name} has no 2:4 sparse kernel PyTorch can use (profile feature sparse_2to4 = false)"
    return None


def _apply_2to4(run: Run) -> None:
    layers = [(name, m) for name, m in block_modules(run, nn.Linear) if m.in_features % 4 == 0]
    if not layers:
        raise Unsupported(f"{run.workload.name} has no nn.Linear with an input dimension divisible by 4 "
                          "in its blocks")
    modules = [m for _, m in layers]
    weights = sum(m.weight.numel() for m in modules)
    traced = tracing(run.model)
    if traced:
        run.notes.append(TRACE_NOTE)
    else:
        # PyTorch's own 2:4 magnitude pruner, configured as in the semi-structured sparsity tutorial: blocks
        # of 1x4 along the input dimension, 2 zeros in each, every block sparsified.
        sparsifier = WeightNormSparsifier(sparsity_level=1.0, sparse_block_shape=(1, 4), zeros_per_block=2)
        sparsifier.prepare(run.model, [{"tensor_fqn": f"{name}.weight"} for name, _ in layers])
        sparsifier.step()
        sparsifier.squash_mask()
        run.notes.append(f"2:4 magnitude pruning of {len(modules)} block Linear layers ({weights:,} weights, "
                         f"{zero_fraction(m.weight for m in modules):.1%} zero)")
    if run.mode == "train":
        mask_bytes = hold_masks(run, modules, [m.weight != 0 for m in modules])
        run.notes.append(f"training keeps dense weights under a fixed 2:4 mask (NVIDIA ASP recipe); the bool "
                         f"masks add {mask_bytes:,} bytes; PyTorch's semi-structured weights have no backward")
    elif _sparse_kernels(run.profile):
        fits = [m for m in modules if semi_structured_fits(m.weight)]
        replace_modules(run.model, {id(m): SemiStructuredLinear(m) for m in fits})
        run.notes.append(f"{len(fits)} of {len(modules)} pruned layers become fp16 semi-structured sparse "
                         "tensors on the device (cuSPARSELt, CUTLASS without it); activations are cast to fp16 "
                         "for them")
        if len(fits) < len(modules):
            run.notes.append(f"{len(modules) - len(fits)} layers stay masked dense (shape not a multiple of "
                             "32 x 64)")
        if traced:
            run.notes.append("the trace runs on the CPU, where the layers stay masked dense: the memory and "
                             "speed of the semi-structured kernels are not modelled")
            # A projection must not cost the sparse kernels as the dense layers it traced: no step time.
            for module in run.model.modules():
                if isinstance(module, SemiStructuredLinear):
                    module.untraced_compute = "cuSPARSELt's 2:4 sparse products, traced as masked dense layers"
    if run.mode == "train":
        run.notes.append("memory/speed are of the masked dense model (zeros stored densely), as in any 2:4 "
                         "training")
    elif not _sparse_kernels(run.profile):
        run.notes.append(f"memory/speed are of the masked dense model (zeros stored densely); memory/speed "
                         f"of the sparse kernels not measured on this device ({run.profile.name})")


SPARSITY_2TO4 = Technique(
    id="sparsity-2to4", phase=Phase.COMPRESS, changes_numerics=True, guide="T10",
    summary="2:4 semi-structured magnitude pruning of block Linear weights (sparse kernels for inference)",
    check=_check_2to4, apply=_apply_2to4, exclusive="weight-sparsity",
    post_training=True, fine_tune=True, trace_key=_sparse_kernels)


# --- unstructured magnitude pruning (T11) -----------------------------------------------------------

# Fraction of the block weights pruned after each round; the last is the target (Han et al. prune in
# rounds with retraining in between, Zhu & Gupta 2017 arXiv:1710.01878 grow sparsity gradually).
SCHEDULE = (0.5, 0.75, 0.9)
# Optimizer steps of recovery training after every round but the last, on the workload's own batches
# (`RECOVERY_BATCH` samples each). Without them, iterative global magnitude pruning would select exactly
# the weights one-shot pruning selects.
RECOVERY_STEPS = 1
RECOVERY_BATCH = 2
RECOVERY_SEED = 1234


def prune_iteratively(modules: list[nn.Module], schedule=SCHEDULE, recover=None) -> list[torch.Tensor]:
    """Global L1 magnitude pruning of `modules`' weights in rounds; returns the final bool masks.

    After round i exactly ceil(schedule[i] * total) weights are zero; `recover()` trains in between, with
    `torch.nn.utils.prune`'s reparametrisation keeping pruned weights at zero. The pruning is made
    permanent with `prune.remove` at the end.
    """
    params = [(m, "weight") for m in modules]
    total = sum(m.weight.numel() for m in modules)
    pruned = 0
    for index, level in enumerate(schedule):
        target = math.ceil(level * total)
        # Score by the current effective weight: `module.weight` is only refreshed by a forward pass.
        scores = {(m, "weight"): (m.weight_orig * m.weight_mask if prune.is_pruned(m) else m.weight).detach()
                  for m in modules}
        if target > pruned:
            # An int amount prunes that many of the weights still unpruned (PruningContainer semantics).
            prune.global_unstructured(params, pruning_method=prune.L1Unstructured, importance_scores=scores,
                                      amount=target - pruned)
            pruned = target
        if recover is not None and index < len(schedule) - 1:
            recover()
    masks = [m.weight_mask.detach().to(torch.bool) for m in modules]
    for m in modules:
        prune.remove(m, "weight")
    return masks


def _recovery(run: Run):
    """A function that trains `run.model` for RECOVERY_STEPS steps on fresh batches of the workload."""
    generator = torch.Generator().manual_seed(RECOVERY_SEED)

    def recover() -> None:
        model, was_training = run.model, run.model.training
        model.train()
        optimizer = run.optimizer_factory(model.parameters())
        for _ in range(RECOVERY_STEPS):
            batch = run.workload.batch(run.size, min(RECOVERY_BATCH, run.batch_size), generator)
            run.workload.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.train(was_training)

    return recover


class CsrLinear(nn.Module):
    """An inference Linear whose pruned weight is stored in CSR: values, int32 column indices, row pointers.

    The parts are kept as plain buffers (inference-only state) and assembled into a
    `torch.sparse_csr_tensor` view per call, because a CSR tensor has no single storage to count.
    The product runs on PyTorch's sparse kernels (MKL on CPU, cuSPARSE on CUDA) in the weight's dtype.
    """

    # Fake tensors cannot form a CSR tensor, so a projection's trace sees only the product's output:
    # the projection reports no step time rather than one without these products (harness/project).
    untraced_compute = "CSR sparse products (cuSPARSE/MKL), which fake tensors cannot run"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": known, and used
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            csr = linear.weight.detach().to_sparse_csr()
        index = torch.int32 if csr.values().numel() < 2**31 else torch.int64
        self.register_buffer("values", csr.values())
        self.register_buffer("crow_indices", csr.crow_indices().to(index))
        self.register_buffer("col_indices", csr.col_indices().to(index))
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)

    @classmethod
    def sized(cls, linear: nn.Linear, nnz: int) -> CsrLinear:
        """A layer with the storage of `nnz` nonzeros and no meaningful values (for fake-tensor traces)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        weight = linear.weight
        layer.register_buffer("values", weight.new_empty(nnz))
        layer.register_buffer("crow_indices", weight.new_empty(linear.out_features + 1, dtype=torch.int32))
        layer.register_buffer("col_indices", weight.new_empty(nnz, dtype=torch.int32))
        layer.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)
        return layer

    def sparse_weight(self) -> torch.Tensor:
        return torch.sparse_csr_tensor(self.crow_indices, self.col_indices, self.values,
                                       (self.out_features, self.in_features), check_invariants=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        with torch.autocast(x.device.type, enabled=False):  # sparse CSR kernels take no 16-bit autocast
            flat_t = flat.to(self.values.dtype).t()
            if is_fake(self.values):
                # Fake tensors cannot form a CSR tensor: trace the product as its output allocation only.
                y = flat_t.new_empty(self.out_features, flat_t.shape[1])
            elif self.bias is None:
                y = torch.sparse.mm(self.sparse_weight(), flat_t)
            else:
                y = torch.addmm(self.bias.unsqueeze(1), self.sparse_weight(), flat_t)
        return y.t().reshape(*x.shape[:-1], self.out_features)  # W @ x^T, transposed back as a view

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nnz={self.values.numel()}, csr")


def _apply_unstructured(run: Run) -> None:
    layers = block_modules(run, (nn.Linear, nn.Conv2d))
    if not layers:
        raise Unsupported(f"{run.workload.name} has no nn.Linear or nn.Conv2d in its blocks to prune")
    modules = [m for _, m in layers]
    weights = sum(m.weight.numel() for m in modules)
    traced = tracing(run.model)
    if traced:
        masks = [torch.ones_like(m.weight, dtype=torch.bool) for m in modules]
        run.notes.append(TRACE_NOTE + f"; each layer is taken to keep {1 - SCHEDULE[-1]:.0%} of its weights")
    else:
        masks = prune_iteratively(modules, SCHEDULE, recover=_recovery(run) if RECOVERY_STEPS else None)
        params = list(run.model.parameters())
        run.notes.append(
            f"global magnitude pruning of {len(modules)} block Linear/Conv weights ({weights:,}) in rounds "
            f"{' -> '.join(f'{level:.0%}' for level in SCHEDULE)}, {RECOVERY_STEPS} recovery step(s) between "
            f"rounds: block weights {zero_fraction(m.weight for m in modules):.1%} zero, all parameters "
            f"{zero_fraction(params):.1%} zero")
    if run.mode == "train":
        mask_bytes = hold_masks(run, modules, masks)
        run.notes.append(f"dense storage: zeros save no memory; bool masks keep pruned weights at zero while "
                         f"training (+{mask_bytes:,} bytes)")
        return
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    if traced:  # global pruning decides each layer's share; the trace assumes the average density
        kept = {id(m): m.weight.numel() - math.ceil(SCHEDULE[-1] * m.weight.numel()) for m in linears}
        replace_modules(run.model, {id(m): CsrLinear.sized(m, kept[id(m)]) for m in linears})
    else:
        replace_modules(run.model, {id(m): CsrLinear(m) for m in linears})
    if linears:
        run.notes.append(f"{len(linears)} Linear weights stored as CSR (fp32 values + int32 indices) and "
                         "multiplied with torch.sparse kernels")
    if len(linears) < len(modules):
        run.notes.append(f"{len(modules) - len(linears)} conv weights keep dense storage: zeros save no memory "
                         "(PyTorch has no sparse convolution)")


UNSTRUCTURED_PRUNING = Technique(
    id="unstructured-pruning", phase=Phase.COMPRESS, changes_numerics=True, guide="T11",
    summary=f"iterative global magnitude pruning to {SCHEDULE[-1]:.0%} (CSR Linear weights for inference)",
    check=always, apply=_apply_unstructured, exclusive="weight-sparsity",
    post_training=True)


TECHNIQUES = (SPARSITY_2TO4, UNSTRUCTURED_PRUNING)
