"""ResNet-50: an image classifier built from 16 bottleneck blocks (1x1 reduce, 3x3, 1x1 expand x4).

A 7x7 stride-2 stem and a max-pool quarter the image, four stages of [3, 4, 6, 3] blocks halve it
three more times, and a global average pool feeds one linear classifier. torchvision's v1.5 puts the
stride on the 3x3 conv of a stage's first block, which is what we count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from suites.workloads.base import Batch, ConvRoles, SizeSpec, Traits, Workload

# (width, stride) of the four stages and ResNet-50's blocks per stage; outputs are 4x the width (He et al.
# 2015, Table 1). A size's config may take fewer blocks and a narrower 3x3 (`width_per_group`, torchvision's
# knob: the bottleneck's inner width is width * width_per_group / 64).
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))
RESNET50_LAYERS = (3, 4, 6, 3)
EXPANSION = 4

SIZES = {
    "smoke": SizeSpec(
        name="smoke",
        scale="smoke",
        # One bottleneck per stage with a quarter-width 3x3, 10 classes: the same kinds of layers
        # (stem, strided and projected shortcuts, BatchNorm) in seconds per cell on a CPU, where the full
        # network's bf16 and fp16 steps took minutes each (no native half-precision convolutions there).
        config={"num_classes": 10, "layers": (1, 1, 1, 1), "width_per_group": 16},
        # 8, so that 4 accumulation micro-batches still hold 2 samples: batch norm needs more than one
        # value per channel, and at 32 px the last stage's maps are 1x1.
        batch_size=8,
        image_size=32,
    ),
    "resnet50": SizeSpec(
        name="resnet50",
        scale="standard",
        config={"num_classes": 1000},
        batch_size=32,
        image_size=224,
        canonical_params=25_557_032,
        canonical_source="torchvision docs, ResNet50_Weights.IMAGENET1K_V1 num_params",
    ),
}


def build(size: SizeSpec) -> nn.Module:
    config = size.config
    # torchvision.models.resnet50 is exactly ResNet(Bottleneck, [3, 4, 6, 3]); smaller sizes change the knobs.
    # Imported here: torchvision's package import takes about a second (it loads torch._dynamo), which
    # every `headroom` command would pay even when no ResNet is built.
    import torchvision.models.resnet

    return torchvision.models.resnet.ResNet(
        torchvision.models.resnet.Bottleneck, list(config.get("layers", RESNET50_LAYERS)),
        num_classes=config["num_classes"], width_per_group=config.get("width_per_group", 64))


def make_batch(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = size.image_size
    images = torch.randn(batch_size, 3, n, n, generator=generator)
    labels = torch.randint(0, size.config["num_classes"], (batch_size,), generator=generator)
    return {"images": images, "labels": labels}


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["images"])


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(model, batch), batch["labels"])


def block_lists(model: nn.Module) -> list[nn.Module]:
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def _out(n: int, kernel: int, stride: int, padding: int) -> int:
    """Output side of a conv or pool (PyTorch's formula, floor rounding, no dilation)."""
    return (n + 2 * padding - kernel) // stride + 1


def _conv(c_in: int, c_out: int, kernel: int, n_out: int) -> int:
    """FLOPs of a square conv: 2 per multiply-accumulate, one MAC per weight per output pixel."""
    return 2 * c_in * c_out * kernel * kernel * n_out * n_out


def _flops(size: SizeSpec) -> tuple[int, int]:
    """(forward FLOPs of one image, of which the stem conv's), walking the architecture."""
    n = _out(size.image_size, 7, 2, 3)
    stem = _conv(3, 64, 7, n)
    total = stem
    n = _out(n, 3, 2, 1)  # max-pool: no FLOPs counted, only the resolution changes
    c_in = 64
    layers = size.config.get("layers", RESNET50_LAYERS)
    for (width, stride), blocks in zip(STAGES, layers, strict=True):
        inner = width * size.config.get("width_per_group", 64) // 64
        for i in range(blocks):
            s = stride if i == 0 else 1
            n_out = _out(n, 3, s, 1)
            total += _conv(c_in, inner, 1, n)  # reduce, at the input resolution
            total += _conv(inner, inner, 3, n_out)  # the 3x3 carries the stride (v1.5)
            total += _conv(inner, width * EXPANSION, 1, n_out)  # expand
            if i == 0:  # the shortcut needs a 1x1 projection when channels or resolution change
                total += _conv(c_in, width * EXPANSION, 1, _out(n, 1, s, 0))
            c_in, n = width * EXPANSION, n_out
    total += 2 * c_in * size.config["num_classes"]  # fc after the global average pool
    return total, stem


def forward_flops_per_sample(size: SizeSpec) -> float:
    return float(_flops(size)[0])


def train_flops_per_sample(size: SizeSpec) -> float:
    # Backward costs each conv/linear twice its forward (grad of the input and of the weight), except
    # the stem conv, whose input is the image and needs no grad.
    total, stem = _flops(size)
    return float(3 * total - stem)


WORKLOAD = Workload(
    name="resnet50",
    kind="vision",
    sizes=SIZES,
    build=build,
    batch=make_batch,
    loss=loss,
    forward=forward,
    block_lists=block_lists,
    forward_flops_per_sample=forward_flops_per_sample,
    train_flops_per_sample=train_flops_per_sample,
    accuracy_metric="top1",
    traits=Traits(convolutional=True, batch_norm=True, bottleneck=ConvRoles()),
)
