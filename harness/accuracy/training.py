"""Train a task's model under a stack, and turn the trained model into the one the stack deploys.

A stack's techniques play one of three roles. Training techniques (mixed precision, sharing,
checkpointing...) train the model from scratch with the baseline's budget and seed. Post-training
techniques compress the trained model: those whose recipe fine-tunes (pruning, low-rank, 2:4, QAT) are
applied to it and trained for a fraction of the budget at a tenth of the learning rate; the others
(PTQ, weight-only int8/int4, 16-bit weights, the int8 KV cache) are applied as they are deployed.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from suites.step import Step
from suites.tasks.base import Budget, Task
from suites.techniques import Stack
from suites.techniques.base import Phase, Run, Technique
from suites.workloads.base import Workload

FINE_TUNE_LR_SCALE = 0.1  # fine-tuning a trained model takes a smaller step than training it


@dataclass(frozen=True)
class Roles:
    train: tuple[Technique, ...]
    fine_tuned: tuple[Technique, ...]
    post: tuple[Technique, ...]

    @property
    def step_settings(self) -> tuple[Technique, ...]:
        """Training techniques that only change how a step runs (autocast, accumulation, the optimizer,
        the allocator), not the model: a fine-tuning or an inference of the trained model keeps them."""
        return tuple(t for t in self.train if t.phase >= Phase.STEP)


def roles(stack: Stack) -> Roles:
    techniques = stack.techniques
    return Roles(train=tuple(t for t in techniques if not t.post_training),
                 fine_tuned=tuple(t for t in techniques if t.fine_tune),
                 post=tuple(t for t in techniques if t.post_training and not t.fine_tune))


# Adapters train from B = 0 with few parameters and take a learning rate about ten times full fine-tuning's
# (QLoRA's recipes: 2e-4 for 7-13B models where full fine-tuning of LLaMA/Alpaca used 2e-5).
ADAPTER_LR_SCALE = 1.0


def adapts(parts: Roles) -> bool:
    """Whether the stack fine-tunes through adapters (LoRA, QLoRA): its reference is then a full fine-tune."""
    return any(t.exclusive == "adapters" for t in parts.fine_tuned)


def fine_tune_lr_scale(parts: Roles) -> float:
    return ADAPTER_LR_SCALE if adapts(parts) else FINE_TUNE_LR_SCALE


def in_phase_order(techniques) -> Stack:
    return Stack(tuple(sorted(techniques, key=lambda t: (t.phase, t.order))))


def check(stack: Stack, profile, workload: Workload) -> str | None:
    """Why the stack's accuracy cannot be measured here: each technique is checked in the mode it acts in."""
    if stack.missing:
        return stack.check(profile, workload, "train")
    parts = roles(stack)
    for technique in (*parts.train, *parts.fine_tuned):
        reason = technique.check(profile, workload, "train")
        if reason:
            return f"{technique.id}: {reason}"
    for technique in parts.post:
        reason = technique.check(profile, workload, "infer")
        if reason:
            return f"{technique.id}: {reason}"
    return None


def _schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to the peak, then cosine decay to a tenth of it (nanoGPT's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# A seed can train for minutes (bf16 autocast on a CPU without bf16 instructions runs ~17x slower than fp32:
# gpt smoke, 522 s against 31 s a seed): say where it is at least this often.
HEARTBEAT_S = 30.0
Heartbeat = Callable[[int, int, float], None]  # (steps done, steps in all, seconds a step so far)


def train(run: Run, device: torch.device, steps: int, lr: float, batch_size: int, seed: int,
          heartbeat: Heartbeat | None = None) -> float:
    """Train `run.model` for `steps` optimizer steps as the stack's Step runs them; the last loss.
    `heartbeat` hears how far it is every HEARTBEAT_S seconds."""
    step = Step(run, device)
    for group in step.optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit optimizers keep it as a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda i: _schedule(i, warmup, steps))
    generator = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    started = last_beat = time.perf_counter()
    for done in range(1, steps + 1):
        batch = {k: v.to(device) for k, v in run.workload.batch(run.size, batch_size, generator).items()}
        loss = step(batch)
        with warnings.catch_warnings():  # fp16 loss scaling skips the first steps' updates, by design
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
            scheduler.step()
        now = time.perf_counter()
        if heartbeat is not None and done < steps and now - last_beat >= HEARTBEAT_S:
            heartbeat(done, steps, (now - started) / done)
            last_beat = now
    if not torch.isfinite(loss).all():
        raise FloatingPointError(f"training diverged: loss {loss.item()}")
    return loss.item()


@dataclass
class Trainer:
    """One task's training on one device, for the stacks of one workload."""

    task: Task
    workload: Workload  # the task-bound workload (real batches, the task's size)
    profile: object
    device: torch.device
    budget: Budget
    heartbeat: Heartbeat | None = None  # told how far a long training run is (set per stack and seed)

    def _run(self, model: torch.nn.Module, mode: str) -> Run:
        return Run(workload=self.workload, size=self.task.size, mode=mode, profile=self.profile, model=model,
                   batch_size=self.budget.batch_size)

    def trained(self, techniques: tuple[Technique, ...], seed: int) -> torch.nn.Module:
        """A model trained from the seed's initialisation under `techniques`."""
        torch.manual_seed(seed)
        run = self._run(self.workload.build(self.task.size), "train")
        in_phase_order(techniques).apply(run)
        run.model.to(self.device)
        train(run, self.device, self.budget.steps, self.budget.lr, self.budget.batch_size, seed, self.heartbeat)
        return run.model

    def deployed(self, trained: torch.nn.Module, parts: Roles, seed: int, in_full: bool = False) -> Step:
        """The inference step of the model the stack deploys, made from a copy of `trained`; `in_full`: the
        copy is fine-tuned whole, as the stack's fine-tuning would be (the reference adapters compare with)."""
        model = copy.deepcopy(trained)
        if parts.fine_tuned or in_full:
            run = self._run(model, "train")
            in_phase_order((*parts.step_settings, *parts.fine_tuned)).apply(run)
            run.model.to(self.device)
            train(run, self.device, self.budget.fine_tune_steps, self.budget.lr * fine_tune_lr_scale(parts),
                  self.budget.batch_size, seed + 10_000, self.heartbeat)
            model = run.model
        run = self._run(model, "infer")
        kept = tuple(t for t in parts.step_settings if t.check(self.profile, self.workload, "infer") is None)
        in_phase_order((*kept, *parts.post)).apply(run)
        run.model.to(self.device)
        # QAT's fake quantisers keep observing in eval mode: freeze their ranges so scoring cannot move them.
        run.model.apply(torch.ao.quantization.disable_observer)
        return Step(run, self.device)
