"""Searches over projections: the largest batch that fits a GPU, and the largest model size.

Memory is affine in the batch for fixed shapes, so two projections give a guess, the allocation logs
traced there give every batch between (batch_model.py) for the search, and two real projections
confirm its answer; sizes are tried from the smallest model up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness.cell import ResolvedCell
from harness.project.batch_model import BatchModel
from harness.project.layout import base_name
from suites.techniques import Phase, Stack, Unsupported
from suites.techniques.accumulation import DEFAULT_MICRO_BATCHES
from suites.workloads.base import SizeSpec, Workload, count_parameters

# --max-batch searches up to this batch (an inference cell of a small model can fit far more).
MAX_BATCH_LIMIT = 1 << 16


def fits_at(cell: ResolvedCell, batch_size: int | None = None, steady: bool = False) -> bool:
    """Whether the cell (at `batch_size`, default its own) fits its profile, as projected; `steady`: without
    the allocator freeing its cache and retrying each step."""
    from harness.project import project

    memory = project(cell if batch_size is None else cell.with_batch(batch_size)).memory
    return runs_steadily(memory) if steady else bool(memory.fits)


def runs_steadily(memory) -> bool:
    """Fits, and without a cache-freeing retry: where the caching allocator's reserve would outgrow the card,
    cudaMalloc fails and the allocator frees every cached block and retries, each step. PyTorch's CUDA notes
    call those retries slow (`num_alloc_retries`, a synchronising cudaFree each); a batch a user would pick
    for throughput has none."""
    return bool(memory.fits) and not memory.fits_by_freeing_cache


def max_batch(cell: ResolvedCell, step: int = 1, limit: int = MAX_BATCH_LIMIT, smallest: int | None = None) -> int:
    """The largest batch (a multiple of `step`, at least `smallest`) whose projected memory fits the
    cell's profile without the allocator's cache-freeing retries (runs_steadily), 0 if none.

    Memory is affine in the batch for fixed shapes: two projections give the slope and a guess, the
    search runs on the batch model between the first batch and the guess (batch_model.py), and its
    answer is confirmed by real projections there and one step above, or searched again with real ones.
    """
    from harness.project import project

    profile = cell.profile.per_device()
    if profile.vendor == "cpu":
        raise ValueError(f"profile {profile.id} is the host CPU, whose memory the system shares (no device memory a "
                         "batch is fitted to): pick a GPU profile to solve for the largest batch")
    if profile.capacity_bytes is None:
        raise ValueError(f"profile {profile.id} has no memory size to fit in: cannot solve for the largest batch")
    start = max(step, smallest or step)
    first = project(cell.with_batch(start)).memory
    if not runs_steadily(first):
        return 0
    second = project(cell.with_batch(start + step)).memory
    slope = (second.chosen_reserved - first.chosen_reserved) / step
    budget = profile.capacity_bytes - first.overhead - first.chosen_reserved
    guess = limit if slope <= 0 else min(limit, start + int(budget / slope) // step * step)
    guess = max(start, guess - guess % step)

    def fits(batch: int) -> bool:
        return fits_at(cell, batch, steady=True)

    # Probe the batch model (interpolated allocation logs: two traces in all), then confirm its answer
    # with real projections at it and one step above; where they disagree, search with real ones from there.
    if guess > start:
        model = BatchModel(cell, start, guess)
        modelled = _modelled_fits(model)
        try:
            answer = _largest(modelled, start, guess, step, limit)
        except _NoModel:
            answer = None
        if answer is not None:
            if fits(answer) and (answer + step > limit or not fits(answer + step)):
                return answer
            guess = max(start, answer)
    return _largest(fits, start, guess, step, limit)


# --max-context answers in multiples of this many prompt tokens (a search of a 131k-token context
# then takes about a dozen projections).
CONTEXT_STEP = 64


def context_limit(cell: ResolvedCell) -> int:
    """The longest prompt the model itself takes with the cell's generated tokens: its longest sequence
    (positions it was built for) less `gen_len`."""
    spec = cell.spec
    return (cell.workload.max_seq_len(spec) or spec.seq_len + spec.gen_len) - spec.gen_len


def max_context(cell: ResolvedCell, step: int = CONTEXT_STEP) -> int:
    """The longest prompt (a multiple of `step`, or 1..step-1 when only a short one fits) that a served
    decoder's cell fits at its batch with its `gen_len` generated tokens (without cache-freeing retries:
    runs_steadily), 0 if none; up to the model's
    longest sequence. Memory is affine in the context (KV cache, attention and activations grow with
    it): two projections give a guess, real projections bracket and bisect from there."""
    from harness.project import project

    spec = cell.spec
    limit = context_limit(cell)

    def at(prompt: int):
        return project(cell.with_spec(dataclasses.replace(spec, seq_len=prompt))).memory

    def fits(prompt: int) -> bool:
        return runs_steadily(at(prompt))

    start = min(step, limit)
    first = at(start)
    if not runs_steadily(first):
        return _largest(fits, 1, 1, 1, start - 1) if start > 1 and fits(1) else 0
    if start == limit:
        return start
    second = at(min(limit, 2 * start))
    slope = (second.chosen_reserved - first.chosen_reserved) / (min(limit, 2 * start) - start)
    room = cell.profile.per_device().capacity_bytes - first.overhead - first.chosen_reserved
    guess = limit if slope <= 0 else min(limit, start + int(room / slope))
    guess = max(start, guess - guess % step)
    answer = _largest(fits, start, guess, step, limit - limit % step)
    # The multiple of `step` below the limit fits: the limit itself may too.
    return limit if answer == limit - limit % step and limit % step and fits(limit) else answer


class _NoModel(Exception):
    """The two traced logs differ in shape: the batch model cannot answer."""


def _modelled_fits(model: BatchModel):
    def fits(batch: int) -> bool:
        memory = model.memory(batch)
        if memory is None:
            raise _NoModel
        return runs_steadily(memory)

    return fits


def _largest(fits, start: int, guess: int, step: int, limit: int) -> int:
    """The largest multiple of `step` in [start, limit] for which `fits` holds (it holds at `start` and is
    monotone), bracketed around `guess` (low fits, high does not), then bisected."""
    if fits(guess):
        low, high, jump = guess, guess + step, step
        while high <= limit and fits(high):
            low, jump = high, jump * 2
            high = low + jump
        if high > limit:
            return low
    else:
        low, high = start, guess
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def max_parallel_batch(cell: ResolvedCell, limit: int = MAX_BATCH_LIMIT) -> int:
    """The largest global batch on which every rank of a parallel cell fits, 0 if none: a multiple of one
    sample per data-parallel rank and micro-batch (and accumulated pass). A rank's memory is affine in its
    batch, so two projections give the slope and a guess; real projections bracket and bisect from there."""
    from harness.project import project_outcome
    from harness.project.layout import layout_of

    layout = layout_of(cell)
    step = layout.dp * layout.micro_batches * batch_step(cell.stack)
    reserved = {}

    def fits(batch: int) -> bool:
        outcome = project_outcome(cell.with_batch(batch))
        reserved[batch] = outcome.memory.peak_reserved if outcome.memory else None
        return outcome.status == "ok"

    if not fits(step):
        return 0
    if 2 * step > limit or not fits(2 * step):
        return step
    slope = (reserved[2 * step] or 0) - (reserved[step] or 0)
    capacity = cell.profile.per_device().capacity_bytes
    guess = limit if slope <= 0 or not reserved[2 * step] else \
        2 * step + int((capacity - reserved[2 * step]) // slope) * step
    guess = max(2 * step, min(limit, guess) // step * step)
    return _largest(fits, 2 * step, guess, step, limit)


def batch_step(stack: Stack) -> int:
    """The batch must be a multiple of this: accumulation splits it into equal micro-batches."""
    return DEFAULT_MICRO_BATCHES if any(t.id == "grad-accumulation" for t in stack.techniques) else 1


def smallest_batch(stack: Stack, workload: Workload, mode: str) -> int:
    """The smallest batch the cell can take: one sample per micro-batch, two where BatchNorm trains
    (it needs more than one value per channel, and a conv net's last feature map may be 1 x 1)."""
    return batch_step(stack) * (2 if workload.traits.batch_norm and mode == "train" else 1)


@dataclass(frozen=True)
class LargestModel:
    """The answer of `largest_model`: a size id or None, the batch it was judged at, and why none."""

    size: str | None
    batch_size: int
    reason: str = ""


# A stack that keeps every weight on the device, dense, holds none in fewer than 4 bits (int4 and NF4 are
# the smallest formats here), and a parallel cell's ranks share the weights at best evenly: a size whose
# weights alone pass that floor cannot fit, so the search stops there rather than trace every larger size.
WEIGHT_FLOOR_BYTES = 0.5
# Techniques under which the floor does not hold: they store weights sparse (CSR) or on the host. Those of
# the STRUCTURE phase (sharing, low-rank, structured pruning) drop weights from the model and are excluded too.
BELOW_THE_FLOOR = ("unstructured-pruning", "dynamic-sparsity", "cpu-offload")


def _weight_floor_holds(stack: Stack) -> bool:
    return not any(t.phase == Phase.STRUCTURE or base_name(t) in BELOW_THE_FLOOR for t in stack.techniques)


def largest_model(cell: ResolvedCell) -> LargestModel:
    """The largest size of the cell's workload that fits its profile at its smallest batch under its
    stack (the cell's own size and batch are ignored). Sizes are tried by parameter count, but a smaller
    size may need more (a longer sequence): one that does not fit is noted and the search goes on."""
    workload, stack = cell.workload, cell.stack
    batch = smallest_batch(stack, workload, cell.mode)
    if cell.unsupported:
        return LargestModel(None, batch, f"unsupported: {cell.unsupported}")
    capacity = (cell.profile.per_device().memory_bytes if _weight_floor_holds(stack) else None) or float("inf")
    sizes = sorted((_param_estimate(workload, spec), spec.name, spec) for spec in workload.sizes.values())
    best, best_params, missed = None, 0, []  # missed: (parameters, size, why) of the sizes that did not fit
    for params, name, spec in sizes:
        if params * WEIGHT_FLOOR_BYTES / cell.cell.world_size > capacity:
            break
        try:
            fits = fits_at(cell.with_spec(spec).with_batch(batch))
        except Unsupported as exc:
            missed.append((params, name, f"unsupported: {exc}"))
            continue
        except Exception as exc:  # a model that fails to trace (a user's): the answer says so, not a traceback
            missed.append((params, name, f"projection failed: {type(exc).__name__}: {exc}"))
            continue
        if fits:
            best, best_params = name, params
        else:
            missed.append((params, name, "does not fit" + (f" (sequence {spec.seq_len})" if spec.seq_len else "")))
    failed = [f"{name} {why}" for _, name, why in missed if not why.startswith("does not fit")]
    if best is None:
        smallest = next((name for _, name, why in missed if why.startswith("does not fit")), None)
        return LargestModel(None, batch, "; ".join(([f"even {smallest} does not fit"] if smallest else []) + failed))
    # What a buyer would not guess from the answer: a size with fewer parameters that does not fit.
    smaller = [f"{name}, with fewer parameters, {why}" for params, name, why in missed
               if params < best_params and why.startswith("does not fit")]
    return LargestModel(best, batch, "; ".join(smaller + failed))


def _param_estimate(workload: Workload, spec: SizeSpec) -> int:
    with torch.device("meta"):
        return count_parameters(workload.build(spec))
