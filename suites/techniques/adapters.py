"""Adapters (LoRA, QLoRA): fine-tune a frozen model through small trainable low-rank updates.

`lora` (Hu et al. 2021, arXiv:2106.09685) freezes every weight and adds to each adapted layer a path
(alpha / r) B A x, A [r, in] and B [out, r], B starting at zero so step 0 is the base model: only r (in
+ out) weights per layer get gradients and optimizer state. `qlora` (Dettmers et al. 2023,
arXiv:2305.14314) also stores the frozen base weights in 4-bit NormalFloat (NF4: 64-weight blocks,
their scales quantised again to 8 bits) and dequantises them for each matmul. The adapters are PEFT's
(`inject_adapter_in_model`, in place, so other techniques still find the model's blocks); NF4 is torchao's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from suites.techniques.base import Phase, Run, Technique, Unsupported, train_only

# Hu et al. used r = 4-8 on GPT-3; PEFT's examples and most recipes start at r = 8 with alpha = 2r. The
# QLoRA paper adapts every linear layer of the blocks (attention only does not match full fine-tuning).
DEFAULT_RANK = 8
# NF4's block of weights sharing one absmax, and the block of those absmaxes sharing one 8-bit scale
# (QLoRA's double quantisation; torchao's defaults).
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


def parse_options(technique: str, options: dict[str, str]) -> dict:
    """`r`, `alpha` and `targets` (module names joined by `/`, e.g. `qkv/proj`) from a stack's options;
    ValueError naming the bad one."""
    unknown = set(options) - {"r", "alpha", "targets"}
    if unknown:
        raise ValueError(f"{technique} takes options r, alpha and targets, not {', '.join(sorted(unknown))} "
                         f"(e.g. {technique}:r=16:targets=qkv/proj)")
    try:
        rank = int(options.get("r", DEFAULT_RANK))
        alpha = float(options.get("alpha", 2 * rank))
    except ValueError:
        raise ValueError(f"{technique}: r must be a whole number and alpha a number, got "
                         f"r={options.get('r')!r} alpha={options.get('alpha')!r}") from None
    if rank < 1:
        raise ValueError(f"{technique}: r must be at least 1, got {rank}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{technique}: alpha must be a positive number, got {options['alpha']!r}")
    targets = tuple(sorted({name for name in options.get("targets", "").split("/") if name}))
    return {"rank": rank, "alpha": alpha, "targets": targets}


def canonical_name(technique: str, settings: dict) -> str:
    """One spelling per configuration, defaults left out: `lora:r=08` and `lora:r=8:alpha=16` are `lora`."""
    options = []
    if settings["rank"] != DEFAULT_RANK:
        options.append(f"r={settings['rank']}")
    if settings["alpha"] != 2 * settings["rank"]:
        options.append(f"alpha={settings['alpha']:g}")
    if settings["targets"]:
        options.append(f"targets={'/'.join(settings['targets'])}")
    return ":".join([technique, *options])


def adapted_layers(run: Run, kinds: tuple[type, ...], targets: tuple[str, ...], what: str) -> list[str]:
    """Qualified names of the layers to adapt: those of `kinds` inside the workload's repeated blocks
    (the head and embeddings are left as they are), restricted to names ending in one of `targets`."""
    containers = run.workload.block_lists(run.model)
    if not containers:
        raise Unsupported(f"workload {run.workload.name!r} exposes no repeated blocks to adapt")
    names = {id(module): name for name, module in run.model.named_modules()}
    prefixes = tuple(f"{names[id(container)]}." for container in containers)
    wanted = [(name, module) for name, module in run.model.named_modules()
              if name.startswith(prefixes) and isinstance(module, kinds)
              and (not targets or name.rsplit(".", 1)[-1] in targets)]
    # A layer another technique replaced by its own subclass (QAT's fake-quantised Linear, fp8's
    # Float8Linear) computes in a way PEFT's wrapper would bypass or break.
    replaced = sorted({type(module).__name__ for _, module in wanted if type(module) not in kinds})
    if replaced:
        raise Unsupported(f"adapters wrap plain layers, and another technique of the stack replaced them with "
                          f"{', '.join(replaced)}")
    found = [name for name, _ in wanted]
    # A target that names nothing is a typo or another model's name: said with the names there are, rather than
    # adapting fewer layers than asked.
    present = {name.rsplit(".", 1)[-1] for name, module in run.model.named_modules()
               if name.startswith(prefixes) and isinstance(module, kinds)}
    unmatched = [target for target in targets if target not in present]
    if unmatched or not found:
        named = f" named {'/'.join(unmatched or targets)}" if targets else ""
        there = f" (its blocks' {what}s: {', '.join(sorted(present))})" if present else ""
        raise Unsupported(f"no {what}{named} in {run.workload.name}'s blocks{there}")
    return found


@contextlib.contextmanager
def _moves_that_change_nothing_skipped():
    """PEFT moves each new adapter to its base layer's device and dtype with `Module.to`. On fake tensors
    (the projection's trace) `Module.to` always swaps parameters (torch.utils.swap_tensors), which fails
    even when nothing would change; the adapters are created where their base lives, so such a move is
    skipped. A move that changes a device or dtype still runs (and fails loudly)."""
    original = nn.Module.to

    def to(module: nn.Module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if tensors and all(is_fake(t) and (device is None or t.device == device)
                           and (dtype is None or t.dtype == dtype or not t.is_floating_point()) for t in tensors):
            return module
        return original(module, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def _inject(run: Run, technique: str, layers: list[str], rank: int, alpha: float) -> int:
    """PEFT's LoRA layers around `layers`, everything else frozen; returns the trainable parameter count."""
    from peft import LoraConfig, inject_adapter_in_model

    try:
        with _moves_that_change_nothing_skipped():
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=layers),
                                    run.model)
    except (ValueError, TypeError) as exc:  # a layer another technique replaced with a kind PEFT cannot wrap
        raise Unsupported(f"{technique}: PEFT cannot adapt these layers: {str(exc).splitlines()[0]}") from exc
    return sum(p.numel() for p in run.model.parameters() if p.requires_grad)


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the weights of frozen Linear and Conv2d layers in autocast's `dtype`; returns how many it converted.

    Autocast casts these layers' weights to `dtype` for every matmul anyway, so the numerics do not
    change; a weight that is never updated needs no fp32 master copy (adapter recipes load the base in
    bf16). Layers autocast keeps in fp32 (norms, embeddings) are left alone."""
    stored = 0
    # A weight shared with another module (a head tied to the embedding) stays as it is: a copy would
    # untie it and cost more, not less.
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    for module in model.modules():
        # Exactly these classes: subclasses (torchao's Float8Linear, QAT's, NF4Linear) compute from their
        # stored weight in their own way, which autocast does not cast.
        if type(module) not in (nn.Linear, nn.Conv2d):
            continue
        tensors = [t for t in (module.weight, module.bias) if t is not None]
        if any(t.requires_grad or seen[id(t)] > 1 or is_traceable_wrapper_subclass(t) for t in tensors):
            continue
        converted = False
        for name in ("weight", "bias"):
            tensor = getattr(module, name)
            if tensor is not None and tensor.dtype != dtype and tensor.is_floating_point():
                setattr(module, name, nn.Parameter(tensor.detach().to(dtype), requires_grad=False))
                converted = True
        stored += converted  # a layer already in `dtype` (a second call) is not counted again
    return stored


def store_frozen(run) -> None:
    """`store_frozen_in` for a run's model in its autocast dtype, said in its notes (a row's parameter bytes then
    fall below an fp32 model's: the frozen weights are 16-bit)."""
    stored = store_frozen_in(run.model, run.autocast_dtype)
    if stored:
        dtype = str(run.autocast_dtype).removeprefix("torch.")
        run.notes.append(f"the weights of {stored} frozen layers held in {dtype} (autocast computes them in it "
                         "anyway; a weight never updated needs no fp32 master copy)")


def _needs_peft(profile, workload, mode: str) -> str | None:
    reason = train_only("adapters")(profile, workload, mode)
    if reason:
        return (f"{reason}; served, LoRA's adapters merge into the weights (PEFT's merge_and_unload) and the "
                "model is the baseline's")
    if importlib.util.find_spec("peft") is None:
        return "adapters come from PEFT, which is not installed (pip install peft)"
    return None


def _apply_lora(run: Run, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    layers = adapted_layers(run, (nn.Linear, nn.Conv2d), targets, "Linear or Conv2d layer")
    total = sum(p.numel() for p in run.model.parameters())
    trainable = _inject(run, "lora", layers, rank, alpha)
    run.notes.append(f"lora r={rank} alpha={alpha:g} on {len(layers)} layers: {trainable:,} of "
                     f"{total + trainable:,} parameters trainable, the rest frozen")


class NF4Linear(nn.Linear):
    """A frozen Linear whose weight is torchao's NF4Tensor, dequantised to the input's dtype in each
    matmul (torchao's `linear_nf4`, whose backward gives the input's gradient only)."""

    def __init__(self, linear: nn.Linear, weight: torch.Tensor) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a full-precision weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        device = x.device.type
        if torch.is_autocast_enabled(device):
            # Dequantise straight to autocast's dtype with autocast off: under fp16 autocast torchao's
            # dequantisation (which stacks bf16 tensors) fails autocast's type promotion.
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                out = linear_nf4(x.to(dtype), self.weight)
        else:
            out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def scaler_block(numel: int) -> int | None:
    """The largest scale block up to NF4_SCALER_BLOCK that tiles a weight of `numel` values, or None when
    64-weight blocks cannot tile it (torchao's NF4 asserts both divisions)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    return next(size for size in range(min(NF4_SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


def quantise_to_nf4(run: Run, layers: list[str]) -> tuple[int, list[str]]:
    """Give the blocks' Linear `layers` NF4 weights (through bf16, as QLoRA loads them): an adapted layer's
    base becomes an NF4Linear, a layer without adapters is replaced by one (QLoRA stores the whole frozen
    base in 4 bits, whichever layers carry adapters). Returns how many were quantised and the names left in
    their dtype because NF4's blocks cannot tile them. Done after PEFT wrapped them: PEFT moves new
    adapters to the base weight's dtype with `Module.to`, which fake tensors (the projection's trace)
    cannot swap, and keeps them in the model's float dtype."""
    from torchao.quantization import to_nf4

    quantised, kept = 0, []
    for name in layers:
        module = run.model.get_submodule(name)
        adapted = hasattr(module, "base_layer")  # PEFT's wrapper around the layer
        linear = module.base_layer if adapted else module
        scales = scaler_block(linear.weight.numel())
        if scales is None:
            kept.append(name)
            continue
        nf4 = NF4Linear(linear, to_nf4(linear.weight.detach().to(torch.bfloat16).contiguous(), NF4_BLOCK, scales))
        if adapted:
            module.base_layer = nf4
        else:
            parent, _, child = name.rpartition(".")
            setattr(run.model.get_submodule(parent), child, nf4)
        quantised += 1
    return quantised, kept


def _needs_nf4(profile, workload, mode: str) -> str | None:
    reason = _needs_peft(profile, workload, mode)
    if reason:
        return reason
    if importlib.util.find_spec("torchao") is None:
        return "qlora's 4-bit base weights are torchao's NF4, and torchao is not installed (pip install torchao)"
    return None


def _apply_qlora(run: Run, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    what = "Linear layer (NF4 base weights are for Linear layers)"
    from suites.techniques.expert import router_ids

    # Every block Linear is the frozen base, all in NF4, but a mixture's router (group-quant does the same).
    routers = router_ids(run.model)
    base = [name for name in adapted_layers(run, (nn.Linear,), (), what)
            if id(run.model.get_submodule(name)) not in routers]
    layers = adapted_layers(run, (nn.Linear,), targets, what)
    trainable = _inject(run, "qlora", layers, rank, alpha)
    quantised, kept = quantise_to_nf4(run, base)
    if not quantised:
        raise Unsupported(f"qlora: none of the blocks' {len(base)} Linear layers tiles into NF4's 64-weight blocks")
    run.notes.append(f"qlora r={rank} alpha={alpha:g}: {quantised} base layers in NF4"
                     + (f" ({len(kept)} too small for NF4's blocks kept as they were)" if kept else "")
                     + f", adapters on {len(layers)} of them, {trainable:,} adapter parameters trainable; each NF4 "
                     "weight is dequantised to 16 bits in every matmul, forward and backward (torchao's linear_nf4: "
                     "several elementwise passes over the weight uncompiled, where bitsandbytes runs one fused kernel)")


def _technique(id_: str, summary: str, check, apply, options: dict | None = None) -> Technique:
    """The technique with these options baked in; `configure` gives a variant for other options."""
    settings = parse_options(id_, options or {})
    name = canonical_name(id_, settings)
    base = Technique(
        id=name, phase=Phase.COMPRESS, changes_numerics=True, summary=summary, check=check,
        apply=lambda run: apply(run, **settings), exclusive="adapters", order=3, guide="",
        post_training=True, fine_tune=True)
    return replace(base, configure=lambda given: _technique(id_, summary, check, apply, given))


# A fine-tuning recipe: applied to a trained model, then trained (the accuracy stage's post-training,
# fine-tuned role). COMPRESS order 3: after quantisation and fp8 swap their layers, before checkpointing
# wraps the blocks.
LORA = _technique(
    "lora", "LoRA: frozen weights, trainable rank-r adapters on the blocks' Linear/Conv layers (PEFT)",
    _needs_peft, _apply_lora)
QLORA = _technique(
    "qlora", "QLoRA: frozen NF4 4-bit base weights (torchao), trainable rank-r adapters (PEFT)",
    _needs_nf4, _apply_qlora)

TECHNIQUES = (LORA, QLORA)
