"""The accuracy-task contract: real data a workload is trained and scored on, offline.

A task names the workload it belongs to, the model size trained on it (small enough to train in
seconds per seed on a CPU), how training batches are drawn from its training split, the fixed batches
of its test split that score a model, and which positions of the output are predictions. Its
`workload()` is the workload with the task's size and real batches in place of random ones, so a
technique that calibrates or recovers on "the workload's batches" (PTQ ranges, pruning recovery) sees
real training data, as it would in practice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from suites.workloads.base import Batch, SizeSpec, Workload

# Metric kinds: how a model's log-probabilities at the scored positions become its figure.
ACCURACY = "accuracy"  # share of positions whose most likely class is the target (higher is better)
BITS_PER_BYTE = "bits-per-byte"  # mean cross entropy in bits of the next byte (lower is better)


@dataclass(frozen=True)
class Budget:
    """How much training a task gets at one scale.

    Attributes:
        steps: optimizer steps from scratch (AdamW, linear warm-up then cosine decay).
        batch_size: samples per step.
        lr: peak learning rate.
        eval_samples: test samples scored (the first ones of the fixed test batches).
        fine_tune_fraction: steps a post-training technique's prescribed fine-tuning gets, as a share
            of `steps` (pruning, low-rank and 2:4 recover, QAT fine-tunes with fake quantisation).
    """

    steps: int
    batch_size: int
    lr: float
    eval_samples: int
    fine_tune_fraction: float = 0.2

    @property
    def warmup_steps(self) -> int:
        return max(1, self.steps // 10)

    @property
    def fine_tune_steps(self) -> int:
        return max(1, round(self.steps * self.fine_tune_fraction))


@dataclass(frozen=True)
class Scored:
    """A model's output at the scored positions: log-probabilities [N, classes] and targets [N]."""

    log_probs: torch.Tensor
    targets: torch.Tensor


@dataclass(frozen=True)
class Task:
    """Real data for one workload.

    Attributes:
        name: `digits`, `stdlib-bytes-lm`, ...
        workload: the workload it trains (`resnet50`, `gpt`, `bert`).
        metric: the row's accuracy_metric (`top1`, `bits-per-byte`, `masked-byte-accuracy`).
        kind: ACCURACY (higher is better) or BITS_PER_BYTE (lower is better).
        size: the model trained on it.
        budgets: scale (`smoke`, `standard`) -> Budget.
        describe: -> what the data is (counts, fingerprint), for the rows' provenance.
        sample: (size, batch_size, generator) -> a training batch drawn from the training split.
        test_batches: (size, samples) -> the fixed test batches holding the first `samples` samples.
        served: the workload is scored as it is served (prefill, then one token at a time from the KV
            cache), so techniques acting on the cache (kv-int8) show their effect.
    """

    name: str
    workload: str
    metric: str
    kind: str
    size: SizeSpec
    budgets: Mapping[str, Budget]
    describe: Callable[[], str]
    sample: Callable[[SizeSpec, int, torch.Generator], Batch]
    test_batches: Callable[[SizeSpec, int], list[Batch]]
    served: bool = False

    @property
    def higher_is_better(self) -> bool:
        return self.kind == ACCURACY

    def budget(self, scale: str) -> Budget:
        """The budget of `scale`; `large` trains as `standard` does."""
        return self.budgets.get(scale) or self.budgets["standard"]

    def bind(self, workload: Workload) -> Workload:
        """`workload` with this task's size as its only one and real training batches."""
        return dataclasses.replace(workload, sizes={self.size.name: self.size}, batch=self.sample)


def metric_value(kind: str, scored: Scored) -> float:
    """The figure of `scored` under metric `kind`."""
    if kind == ACCURACY:
        return (scored.log_probs.argmax(dim=-1) == scored.targets).double().mean().item()
    if kind == BITS_PER_BYTE:
        nll = torch.nn.functional.nll_loss(scored.log_probs.double(), scored.targets)
        return (nll / torch.log(torch.tensor(2.0, dtype=torch.float64))).item()
    raise ValueError(f"unknown metric kind {kind!r} (valid: {ACCURACY}, {BITS_PER_BYTE})")
