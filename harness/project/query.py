"""`headroom project`'s questions, answered: one cell's projected row (at a given batch or the
largest that fits, at a chosen sequence length), or the largest model size that fits a GPU.

The CLI parses and prints; what is valid and what is searched is decided here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import MODES, Cell, ResolvedCell
from harness.outcome import to_record
from harness.profiles import unknown_name
from harness.project import project_outcome
from harness.project.search import MAX_BATCH_LIMIT, batch_step, largest_model, max_batch, smallest_batch
from harness.records import Record
from suites.techniques import Unsupported, parse_stack
from suites.workloads import get_workload

# The run id of rows `headroom project` prints (they are not part of a results folder).
PROJECT_RUN_ID = "project"


@dataclass(frozen=True)
class ProjectRequest:
    """One `headroom project` question (None: the default)."""

    workload: str
    gpu: str
    technique: str = "baseline"
    mode: str = "train"
    size: str | None = None
    batch_size: int | None = None
    max_batch: bool = False
    seq_len: int | None = None


def _resolve(request: ProjectRequest, profiles) -> ResolvedCell:
    """The request's cell, its size's default batch and sequence length unless it sets them."""
    if request.gpu not in profiles:
        raise ValueError(unknown_name("GPU profile id", request.gpu, sorted(profiles)))
    if request.mode not in MODES:
        raise ValueError(f"unknown mode {request.mode!r} (valid: {', '.join(MODES)})")
    workload = get_workload(request.workload)
    stack = parse_stack(request.technique)
    spec = workload.size(request.size) if request.size else next(iter(workload.sizes_at("standard")))
    if request.seq_len is not None:
        if spec.seq_len is None:
            raise ValueError(f"--seq-len applies to language models; {workload.name} takes images")
        limit = workload.max_seq_len(spec)
        if request.seq_len < 1 or (limit and request.seq_len > limit):
            raise ValueError(f"--seq-len must be between 1 and {limit} for {spec.name}, got {request.seq_len}")
        spec = dataclasses.replace(spec, seq_len=request.seq_len)
    if request.batch_size is not None and request.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {request.batch_size}")
    batch = spec.batch_size if request.batch_size is None else request.batch_size
    cell = Cell(workload.name, spec.name, request.mode, stack.name, request.gpu, batch, source="projected")
    return cell.resolve(profiles, spec=spec)


def projected_row(request: ProjectRequest, profiles) -> Record:
    """The projected row of the request's cell; with `max_batch`, at the largest batch that fits."""
    cell = _resolve(request, profiles)
    notes = []
    if request.max_batch:
        profile = cell.profile
        if profile.vendor == "cpu" or profile.capacity_bytes is None:
            raise ValueError(f"--max-batch needs a profile with a memory size to fit in; {profile.id} has none "
                             "(the host's memory is not modelled): pick a GPU profile")
        if not cell.unsupported:  # an unsupported stack is reported as such by its row
            least = smallest_batch(cell.stack, cell.workload, cell.mode)
            batch = least
            try:
                batch = max_batch(cell, step=batch_step(cell.stack), smallest=least) or least
            except Unsupported:
                pass  # raised by the stack at this size: the row reports it
            if batch >= MAX_BATCH_LIMIT:
                notes.append(f"--max-batch stopped at its search limit {MAX_BATCH_LIMIT}: a larger batch may fit")
            cell = cell.with_batch(batch)
    record = to_record(cell, project_outcome(cell), PROJECT_RUN_ID)
    record.notes = "; ".join(filter(None, [record.notes, *notes]))
    return record


def largest_model_answer(request: ProjectRequest, profiles) -> dict:
    """The largest size of the request's workload that fits its GPU at its smallest batch."""
    ignored = [flag for flag, value in (("--size", request.size), ("--batch-size", request.batch_size),
                                        ("--max-batch", request.max_batch or None), ("--seq-len", request.seq_len))
               if value is not None]
    if ignored:
        raise ValueError(f"--largest-model searches every size of {request.workload} at its smallest batch: "
                         f"drop {', '.join(ignored)}")
    cell = _resolve(request, profiles)
    answer = largest_model(cell)
    return {"gpu": cell.profile.id, "workload": cell.workload.name, "technique": cell.stack.name,
            "mode": cell.mode, "largest_size_that_fits": answer.size, "batch_size": answer.batch_size,
            "reason": answer.reason}
