"""Gradient accumulation (guide T6): N micro-batches per optimizer step, each loss divided by N.

The summed gradients equal those of one pass over the whole batch (for per-sample-mean losses with
equal micro-batches), while activation memory is that of one micro-batch.
"""

from __future__ import annotations

from torch.nn.modules.batchnorm import _BatchNorm

from suites.techniques.base import Phase, Run, Technique, Unsupported, train_only

DEFAULT_MICRO_BATCHES = 4


def _apply(run: Run) -> None:
    n = DEFAULT_MICRO_BATCHES
    if run.batch_size % n:
        raise Unsupported(f"grad-accumulation splits the batch into {n} micro-batches; "
                          f"batch size {run.batch_size} is not divisible by {n}")
    run.micro_batches = n
    run.notes.append(f"{n} micro-batches of {run.batch_size // n}")
    if any(isinstance(m, _BatchNorm) for m in run.model.modules()):
        run.notes.append("batch norm normalises each micro-batch separately, so numerics differ from one batch")


GRAD_ACCUMULATION = Technique(
    id="grad-accumulation", phase=Phase.STEP, changes_numerics=False, guide="T6",
    summary=f"{DEFAULT_MICRO_BATCHES} micro-batches per optimizer step, loss divided by {DEFAULT_MICRO_BATCHES}",
    check=train_only("grad-accumulation"), apply=_apply, exclusive="accumulation",
    # Declared before the stack applies: data-parallel techniques split the batch into ranks x micro-batches
    # and count FSDP's per-pass collectives, pipelines refuse it, all before this step-phase technique runs.
    declare=lambda run: setattr(run, "micro_batches", DEFAULT_MICRO_BATCHES))

TECHNIQUES = (GRAD_ACCUMULATION,)
