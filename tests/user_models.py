"""Factories for `model:tests.user_models:<name>` workloads (tests/test_user_workloads.py): the forms a
user may bring, and a few that are wrong on purpose."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from suites.workloads.user import UserModel


def _classify(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["images"]), batch["labels"])


def resnet18_small() -> UserModel:
    """torchvision's ResNet-18 on 64 x 64 images and 10 classes, two samples in the example."""
    example = {"images": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 10, (2,))}
    return UserModel(torchvision.models.resnet18(num_classes=10), example, _classify)


def tiny_mlp():
    """The tuple form, one sample in the example, and a single input (so forward is positional)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    example = {"x": torch.randn(1, 16), "labels": torch.randint(0, 4, (1,))}
    return model, example, lambda m, b: F.cross_entropy(m(b["x"]), b["labels"])


# The kind of weights each `recording_mlp` call made (`Parameter`, or `FakeTensor` under FakeTensorMode).
BUILT: list[str] = []


def recording_mlp():
    model, example, loss = tiny_mlp()
    BUILT.append(type(model[0].weight).__name__)
    return model, example, loss


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyTokenModel(nn.Module):
    """Token ids in, logits out, through a ModuleList of identical blocks (uniform blocks)."""

    def __init__(self, vocab: int = 100, width: int = 32, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * attention_mask[..., None]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def token_model() -> UserModel:
    """Two inputs (passed by keyword) and labels, 16 tokens per sample."""
    ids = torch.randint(0, 100, (4, 16))
    example = {"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long), "labels": ids}

    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    return UserModel(TinyTokenModel(), example, loss)


NOT_A_FUNCTION = 3


def wrong_type():
    return 42


def not_a_module():
    return "resnet", {"x": torch.zeros(1, 2)}, _classify


def uneven_example():
    return nn.Linear(2, 2), {"x": torch.zeros(2, 2), "labels": torch.zeros(3, dtype=torch.long)}, _classify


def raises():
    raise RuntimeError("no GPU here\nsecond line")


class ValueBranching(nn.Module):
    """A forward that branches on a value: it runs, but fake tensors (FLOP counting) cannot follow it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if h.mean() > 0 else -h)


def value_branching():
    example = {"x": torch.randn(4, 16), "labels": torch.randint(0, 4, (4,))}
    return ValueBranching(), example, lambda m, b: F.cross_entropy(m(b["x"]), b["labels"])


def loss_reads_a_missing_key():
    """A factory whose loss reads a key its example lacks: every trace of it fails."""
    example = {"x": torch.randn(4, 16)}
    return nn.Linear(16, 4), example, lambda m, b: m(b["y"]).sum()
