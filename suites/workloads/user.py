"""Bring your own model: `model:package.module:factory` names a function returning a `UserModel` (or a
tuple `(model, example_batch, loss_fn)`), and `workload(name)` wraps it in the workload contract: batches
are tiled from the example, blocks and traits are found by looking at the model, FLOPs are counted.

The factory takes no arguments and is called again for every build (fresh random weights), also under
`torch.device("meta")` and `FakeTensorMode` (how the harness counts parameters and traces steps without
memory): so it must only construct modules and tensors, never read tensor values (`.item()`, `.tolist()`,
`if x.sum() > 0`), load checkpoints or move the model to a GPU. Build on the CPU in float32: precision and
device are the harness's business. For example, `headroom run --workload model:mymodels:make` with

    def make():  # in mymodels.py, importable from the working directory or PYTHONPATH
        example = {"images": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 10, (2,))}
        model = torchvision.models.resnet18(num_classes=10)
        return model, example, lambda m, batch: F.cross_entropy(m(batch["images"]), batch["labels"])
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.utils.flop_counter import FlopCounterMode

from suites.workloads.base import ANY_SCALE, Batch, SizeSpec, Traits, Workload

PREFIX = "model:"
# Keys of the example that hold targets, not inputs: the default forward leaves them out.
LABEL_KEYS = ("labels", "label", "targets", "target")
# The default batch when the example holds one sample: one sample says what a sample looks like, not
# how many to train on (and BatchNorm cannot train on one).
SINGLE_SAMPLE_BATCH = 8
EXAMPLE_SEED = 0


@dataclass(frozen=True)
class UserModel:
    """What a factory returns.

    Attributes:
        model: the nn.Module, freshly initialised on the CPU in float32.
        example: input name -> tensor, with one sample or more along dim 0 (all keys the same count).
            Integer and bool tensors (token ids, labels, masks) are tiled, so their values stay valid;
            floating ones are redrawn with the example's mean and std.
        loss: (model, batch) -> scalar training loss.
        forward: (model, batch) -> inference output; None: `default_forward`. Both are taken from one
            call and used with every model built, so they must not capture tensors the factory made.
        traits: what techniques may assume (see `Traits`); None: inferred conservatively from the model.
        flops_per_sample: FLOPs of one forward of one sample; None: counted by FlopCounterMode.
        batch_size: the default batch; None: the example's count (8 if it holds one sample).
    """

    model: nn.Module
    example: Mapping[str, torch.Tensor]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    forward: Callable[[nn.Module, Batch], Any] | None = None
    traits: Traits | None = None
    flops_per_sample: float | None = None
    batch_size: int | None = None


def default_forward(model: nn.Module, batch: Batch) -> Any:
    """Call the model on the batch without its label keys (`LABEL_KEYS`): positionally when one input
    remains (`model(images)`), by keyword otherwise (`model(input_ids=..., attention_mask=...)`)."""
    inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
    if len(inputs) == 1:
        return model(next(iter(inputs.values())))
    return model(**inputs)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def load_factory(name: str) -> Callable[[], Any]:
    """The function `model:package.module:factory` names; ValueError (one line) saying how to fix it."""
    spec = name[len(PREFIX):]
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"{name}: expected model:package.module:factory (e.g. model:mymodels:make_resnet)")
    # `headroom` runs as a console script, whose sys.path lacks the working directory that the cell's
    # `python -m` child has: add it (as uvicorn and gunicorn do) so both import the same modules.
    if os.getcwd() not in sys.path:
        # First, as `python -m` puts it: an installed module of the same name (nvidia-ml-py ships a
        # top-level `example`) must not hide the user's.
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"{name}: module {module_name} not found (is it on PYTHONPATH?)") from None
        raise ValueError(f"{name}: importing {module_name} failed: {_one_line(exc)}") from None
    except Exception as exc:
        raise ValueError(f"{name}: importing {module_name} raised {_one_line(exc)}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            close = difflib.get_close_matches(part, [n for n in dir(target) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{name}: module {module_name} has no attribute {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{name}: {module_name}.{attr} is a {type(target).__name__}, not a function")
    return target


def call_factory(name: str, factory: Callable[[], Any]) -> UserModel:
    """Call the factory and check what it returned; ValueError (one line) naming what is wrong."""
    try:
        made = factory()
    except Exception as exc:
        where = "" if _creating_real_tensors() else (" (on the meta device or fake tensors, where a factory may "
                                                     "only build modules and tensors, never read values)")
        raise ValueError(f"{name}: the factory raised {_one_line(exc)}{where}") from None
    expected = "return UserModel(model, example, loss) or a tuple (model, example_batch, loss_fn)"
    if isinstance(made, tuple) and len(made) == 3:
        made = UserModel(*made)
    if not isinstance(made, UserModel):
        raise ValueError(f"{name}: the factory returned a {type(made).__name__}; {expected}")
    if not isinstance(made.model, nn.Module):
        raise ValueError(f"{name}: the model is a {type(made.model).__name__}, not an nn.Module; {expected}")
    if not callable(made.loss) or (made.forward is not None and not callable(made.forward)):
        raise ValueError(f"{name}: loss and forward must be functions (model, batch) -> tensor; {expected}")
    example = made.example
    if not isinstance(example, Mapping) or not example:
        raise ValueError(f"{name}: the example batch must be a non-empty dict of tensors, got "
                         f"{type(example).__name__}")
    bad = [k for k, v in example.items() if not isinstance(v, torch.Tensor) or v.dim() == 0]
    if bad:
        raise ValueError(f"{name}: example[{bad[0]!r}] is not a tensor with a batch dim 0")
    rows = {k: v.shape[0] for k, v in example.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"{name}: the example's tensors hold different sample counts along dim 0: {rows}")
    for p in made.model.parameters():
        if p.device.type not in ("cpu", "meta") or p.dtype != torch.float32:
            raise ValueError(f"{name}: build the model on the CPU in float32 (found a {p.dtype} parameter on "
                             f"{p.device}); device and precision are set by the harness")
    if made.traits is not None and made.traits.depth_key is not None:
        raise ValueError(f"{name}: a factory takes no config, so traits.depth_key cannot change its depth; "
                         f"leave it None")
    return made


def _creating_real_tensors() -> bool:
    """False under FakeTensorMode or torch.device('meta'), where a batch's values are never read."""
    probe = torch.empty(0)
    return type(probe) is torch.Tensor and probe.device.type != "meta"


def count_forward_flops(build: Callable[[], nn.Module], batch: Callable[[], Batch],
                        forward: Callable[[nn.Module, Batch], Any]) -> float:
    """FLOPs of `forward(build(), batch())`, counted by FlopCounterMode on fake tensors (as
    harness/model_flops.py counts): no memory and no real compute, so any size counts in seconds."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build().eval()  # same FLOPs; BatchNorm in training would refuse a batch of one
        inputs = batch()
        counter = FlopCounterMode(display=False)
        # The math path: FlopCounterMode has no formula for the CPU's fused attention kernel.
        with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            forward(model, inputs)
    return float(counter.get_total_flops())


def counted_flops(build: Callable[[SizeSpec], nn.Module], batch: Callable[[SizeSpec, int, torch.Generator], Batch],
                  forward: Callable[[nn.Module, Batch], Any], key: Callable[[SizeSpec], tuple]):
    """(forward, training) FLOPs-per-sample functions for a workload without an analytic count: one
    sample's forward counted once per `key(size)`, and training taken as 3x forward (backward computes
    each matmul's or conv's gradient for both operands, ~2x forward; a little less where the first
    layer's input needs no gradient, e.g. images)."""
    counted: dict[tuple, float] = {}

    def forward_flops(spec: SizeSpec) -> float:
        if key(spec) not in counted:
            counted[key(spec)] = count_forward_flops(lambda: build(spec), lambda: batch(spec, 1, torch.Generator()),
                                                     forward)
        return counted[key(spec)]

    return forward_flops, lambda spec: 3 * forward_flops(spec)


def find_block_lists(model: nn.Module) -> list[nn.Module]:
    """The containers of the model's repeated blocks, found generically: among the nn.ModuleList /
    nn.Sequential containers whose children (two or more, with parameters) share one type, the type
    whose containers hold the most parameters wins (a transformer's layer list rather than the expert
    lists inside its layers; all four of ResNet's stages), and all its containers are returned."""
    groups: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and all(any(True for _ in child.parameters()) for child in module):
            groups.setdefault(kinds.pop(), []).append(module)
    if not groups:
        return []

    def weight(containers: list[nn.Module]) -> int:
        return sum(p.numel() for c in containers for p in c.parameters())

    return max(groups.values(), key=weight)


def uniform_blocks(containers: list[nn.Module]) -> bool:
    """Some blocks, and every block has the same parameter names and shapes, so one can stand for all (sharing)."""
    shapes = {tuple((n, tuple(p.shape)) for n, p in block.named_parameters()) for c in containers for block in c}
    return bool(containers) and len(shapes) == 1


def infer_traits(model: nn.Module) -> Traits:
    """Traits read off the model, conservatively: convolutional when its conv weights outnumber its
    Linear weights, batch_norm when it has any, uniform blocks only when all blocks match exactly."""
    conv = sum(p.numel() for m in model.modules() if isinstance(m, _ConvNd) for p in m.parameters(recurse=False))
    linear = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False))
    containers = find_block_lists(model)
    return Traits(convolutional=conv > linear,
                  batch_norm=any(isinstance(m, _BatchNorm) for m in model.modules()),
                  uniform_blocks=uniform_blocks(containers))


def workload(name: str) -> Workload:
    """The workload of `model:package.module:factory`; the factory is called once on the meta device
    to read the example's shapes and the model's structure (a model of any size loads in seconds)."""
    factory = load_factory(name)
    with torch.device("meta"):
        probe = call_factory(name, factory)
    # Per key: (shape of one sample, dtype); the count of samples the example holds.
    shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in probe.example.items()}
    rows = next(iter(probe.example.values())).shape[0]
    forward = probe.forward or default_forward
    traits = probe.traits or infer_traits(probe.model)
    # Tokens from a 2-D integer `input_ids`, pixels from a 4-D float input: what rows report per sample.
    ids, images = probe.example.get("input_ids"), [v for v in probe.example.values() if v.dim() == 4]
    seq_len = ids.shape[1] if ids is not None and ids.dim() == 2 and not ids.is_floating_point() else None
    image_size = images[0].shape[-1] if images and images[0].is_floating_point() else None
    batch_size = probe.batch_size or (rows if rows > 1 else SINGLE_SAMPLE_BATCH)
    size_name = name.rpartition(":")[2].rpartition(".")[2]
    sizes = {size_name: SizeSpec(size_name, ANY_SCALE, {}, batch_size=batch_size, seq_len=seq_len,
                                 image_size=image_size)}
    real_example: dict[str, torch.Tensor] = {}

    def build(spec: SizeSpec) -> nn.Module:
        return call_factory(name, factory).model

    def example() -> dict[str, torch.Tensor]:
        # The values to tile, from one more call made real and seeded (the model is discarded), so a
        # fresh process makes the same batches; made once, and only where real values are read.
        if not real_example:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(EXAMPLE_SEED)
                made = call_factory(name, factory).example
            real_example.update({k: v.detach().cpu() for k, v in made.items()})
        return real_example

    def batch(spec: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        real = _creating_real_tensors()
        values = example() if real else {}
        out = {}
        for key, (shape, dtype) in shapes.items():
            if dtype.is_floating_point or dtype.is_complex:
                drawn = torch.randn((batch_size, *shape), generator=generator)
                if real:  # the example's scale: raw pixels in [0, 255] stay that large
                    source = values[key].double()
                    drawn = drawn * source.std(correction=0).item() + source.mean().item()
                out[key] = drawn.to(dtype)
            elif real:  # sample i is example row i mod rows: ids and labels stay valid
                out[key] = values[key][torch.arange(batch_size) % rows].clone()
            else:  # fake or meta: only shapes count
                out[key] = torch.zeros((batch_size, *shape), dtype=dtype)
        return out

    if probe.flops_per_sample is not None:  # the factory's own count; training 3x it, as counted_flops says
        given = float(probe.flops_per_sample)
        forward_flops_per_sample, train_flops_per_sample = (lambda spec: given), (lambda spec: 3 * given)
    else:
        forward_flops_per_sample, train_flops_per_sample = counted_flops(
            build, batch, forward, key=lambda spec: (spec.seq_len, spec.image_size))

    return Workload(
        name=name, kind="vision" if image_size else "user", sizes=sizes, build=build, batch=batch,
        loss=probe.loss, forward=forward, block_lists=find_block_lists,
        forward_flops_per_sample=forward_flops_per_sample, train_flops_per_sample=train_flops_per_sample,
        traits=traits)
