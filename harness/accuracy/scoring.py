"""Score a model on its task's test split, and how closely it agrees with the baseline.

The figure is the task's metric over the scored positions; fidelity compares a technique's output
distributions with the baseline's of the same seed at the same positions: top-1 agreement (share of
positions where both predict the same class) and the mean KL divergence KL(baseline || technique) in
nats, which catches a quantised model that keeps its argmax but loses its confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from suites.step import Step
from suites.tasks.base import Budget, Scored, Task
from suites.workloads.bert import IGNORE


@dataclass(frozen=True)
class Fidelity:
    agreement: float
    kl: float


def fidelity(baseline: Scored, other: Scored) -> Fidelity:
    """Agreement and KL of `other` against `baseline` at the same positions."""
    if baseline.log_probs.shape != other.log_probs.shape:
        raise ValueError(f"fidelity needs the same scored positions: {tuple(baseline.log_probs.shape)} vs "
                         f"{tuple(other.log_probs.shape)}")
    agreement = (baseline.log_probs.argmax(-1) == other.log_probs.argmax(-1)).double().mean().item()
    # Renormalised in float64: float32 log-probabilities sum to 1 only within ~1e-7, an error of the first
    # order that would swamp (and, clamped, zero) the KL of a change as small as an int8 KV cache's (~1e-9).
    kl = torch.nn.functional.kl_div(torch.log_softmax(other.log_probs.double(), dim=-1),
                                    torch.log_softmax(baseline.log_probs.double(), dim=-1), log_target=True,
                                    reduction="batchmean").item()
    return Fidelity(agreement, max(kl, 0.0))  # rounding can leave -1e-17 for identical distributions


def _on(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def _scored(logits: list[torch.Tensor], targets: list[torch.Tensor]) -> Scored:
    flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in logits]).float()
    labels = torch.cat([t.reshape(-1) for t in targets])
    keep = labels != IGNORE  # BERT scores its masked positions only
    return Scored(torch.log_softmax(flat[keep], dim=-1), labels[keep])


def score(step: Step, task: Task, budget: Budget) -> Scored:
    """The model of an inference `step` on the task's fixed test batches (log-probabilities on the CPU)."""
    logits, targets = [], []
    for batch in task.test_batches(task.size, budget.eval_samples):
        if task.served:
            out, target = _served(step, _on(batch, step.device))
        else:
            out, target = step(_on(batch, step.device)), batch["labels"]
        logits.append(out.float().cpu())
        targets.append(target.cpu())
    return _scored(logits, targets)


def _served(step: Step, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced generation: the first half of each window is prefilled into the KV cache, then each
    later byte is fed as a decode step; every prediction after the prompt is read from the cache, so a
    technique acting on the cache (kv-int8) shows in the score. Logits [B, S - P + 1, V] for the labels
    from position P - 1 on."""
    ids, labels = batch["input_ids"], batch["labels"]
    seq = ids.shape[1]
    prompt = seq // 2
    cache = step.new_cache(ids.shape[0], context=seq)
    out = [step.next_logits(ids[:, :prompt], cache, 0)]
    for position in range(prompt, seq):
        out.append(step.next_logits(ids[:, position:position + 1], cache, position))
    return torch.stack(out, dim=1), labels[:, prompt - 1:]
