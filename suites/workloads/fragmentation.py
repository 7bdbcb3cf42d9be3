"""The fragmentation workload (guide T18, claim C4: "fragmentation wastes 30-50% of GPU memory"): a GPT
decoder trained on sequences whose length is drawn per step, as fine-tuning data is, so every step asks
the caching allocator for blocks of other sizes than the last one freed.

It is GPT in every other way (model, loss, sizes); what differs is its `Traits.variable_length`, which the
harness reads: measured, the warm-up runs the whole loop of lengths once (every length's blocks are then
reserved), memory is read on the longest step and the timed steps run whole loops; projected, the longest
step is traced for the peak, the loop's allocation log is replayed through the allocator model for the
reserved peak (harness/fragmentation.py), and the step time is the loop's median step. Tokens and FLOPs per
sample are the loop's mean. Inference runs one forward at the size's whole length. Not in the default
plan (it asks an allocator question, not a model one): `headroom run --workload fragmentation --technique
baseline,alloc-expandable,alloc-async`.
"""

from __future__ import annotations

import dataclasses
import random

from suites.workloads import gpt
from suites.workloads.base import SizeSpec, Workload

# Steps in the loop, and what lengths are drawn from: uniform over multiples of 64 tokens up to the size's
# sequence (multiples of an eighth of it for short ones, so there are at least eight lengths to draw).
LOOP_STEPS = 8
LENGTH_MULTIPLE = 64
LOOP_SEED = 0


def step_lengths(spec: SizeSpec, steps: int = LOOP_STEPS, seed: int = LOOP_SEED) -> list[int]:
    """The sequence length of each step of the loop, the same on every machine for a given seed."""
    limit = spec.seq_len
    multiple = max(1, min(LENGTH_MULTIPLE, limit // 8))
    rng = random.Random(seed)
    return [rng.randrange(multiple, limit + 1, multiple) for _ in range(steps)]


def loop_specs(workload: Workload, spec: SizeSpec, mode: str) -> list[SizeSpec] | None:
    """The size at each step's length where `workload` trains on variable lengths, else None."""
    if not workload.traits.variable_length or mode != "train" or not spec.seq_len:
        return None
    return [dataclasses.replace(spec, seq_len=length) for length in step_lengths(spec)]


WORKLOAD = dataclasses.replace(
    gpt.WORKLOAD, name="fragmentation", kind="decoder trained on variable lengths (allocator probe)",
    sizes={name: gpt.SIZES[name] for name in ("smoke", "gpt2-124m", "gpt2-350m")},
    accuracy_metric="", serving=None, pipelining=None,
    traits=dataclasses.replace(gpt.WORKLOAD.traits, variable_length=True))
