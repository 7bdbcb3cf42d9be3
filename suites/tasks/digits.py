"""Handwritten digits for image classification: scikit-learn's copy of the UCI optical digits set.

1,797 greyscale 8x8 images of the digits 0-9 ship inside scikit-learn (`load_digits` reads a file of
the package; nothing is downloaded). They are upscaled to the classifier's input size with bilinear
interpolation, normalised with the training split's mean and deviation, and repeated over 3 channels,
so the ImageNet-shaped ResNet-50 takes them unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from suites.tasks.base import ACCURACY, Budget, Task
from suites.workloads.base import Batch, SizeSpec

SPLIT_SEED = 0  # the permutation that deals images into splits: fixed, so every run sees the same ones
TEST_FRACTION = 0.2
VAL_FRACTION = 0.2


@dataclass(frozen=True)
class ImageSplit:
    """Images [N, 3, S, S] (normalised float32) and their labels [N] (int64)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Digits:
    train: ImageSplit
    val: ImageSplit
    test: ImageSplit
    classes: int = 10


def _sklearn_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("the digits task needs scikit-learn, which ships the data: pip install scikit-learn "
                           "(nox installs it)") from None
    return load_digits()


def split_indices(count: int) -> dict[str, torch.Tensor]:
    """Which of `count` images each split holds: a fixed permutation dealt 20% test, 20% val, 60% train."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test, n_val = round(TEST_FRACTION * count), round(VAL_FRACTION * count)
    return {"test": order[:n_test], "val": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}


@functools.lru_cache(maxsize=4)
def load(image_size: int = 32) -> Digits:
    """The three disjoint splits (60/20/20 by a fixed permutation), each image `image_size` pixels square."""
    data = _sklearn_digits()
    pixels = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # 0..16 grey levels
    images = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target, dtype=torch.int64)
    parts = split_indices(len(labels))
    train = images[parts["train"]]
    mean, std = train.mean(), train.std()

    def split(index: torch.Tensor) -> ImageSplit:
        normalised = ((images[index] - mean) / std).expand(-1, 3, -1, -1).contiguous()
        return ImageSplit(normalised, labels[index])

    return Digits(train=split(parts["train"]), val=split(parts["val"]), test=split(parts["test"]))


# The task: the smoke ResNet-50 shape (every kind of layer, one bottleneck per stage) at 32 pixels,
# which trains to well above 90% top-1 in seconds per seed on a CPU.
SIZE = SizeSpec(name="digits", scale="any", config={"num_classes": 10, "layers": (1, 1, 1, 1), "width_per_group": 16},
                batch_size=64, image_size=32)
EVAL_BATCH = 128


def describe() -> str:
    data = load(SIZE.image_size)
    return (f"scikit-learn digits (UCI optical digits), {len(data.train)}/{len(data.val)}/{len(data.test)} "
            f"images train/val/test, 8x8 upscaled to {SIZE.image_size}x{SIZE.image_size}")


def sample(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    """A training batch drawn with replacement from the training split."""
    train = load(size.image_size).train
    index = torch.randint(0, len(train), (batch_size,), generator=generator)
    return {"images": train.images[index], "labels": train.labels[index]}


def test_batches(size: SizeSpec, samples: int) -> list[Batch]:
    test = load(size.image_size).test
    n = min(samples, len(test))
    return [{"images": test.images[i:i + EVAL_BATCH], "labels": test.labels[i:i + EVAL_BATCH]}
            for i in range(0, n, EVAL_BATCH)]


TASK = Task(
    name="digits", workload="resnet50", metric="top1", kind=ACCURACY, size=SIZE,
    budgets={"smoke": Budget(steps=120, batch_size=64, lr=2e-3, eval_samples=359),
             "standard": Budget(steps=600, batch_size=64, lr=2e-3, eval_samples=359)},
    describe=describe, sample=sample, test_batches=test_batches)
