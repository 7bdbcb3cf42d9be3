"""`headroom project`'s questions, answered: one cell's projected row (at a given batch or the
largest that fits, at a chosen sequence length), or the largest model size that fits a GPU.

The CLI parses and prints; what is valid and what is searched is decided here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import Cell, ResolvedCell
from harness.outcome import to_record
from harness.profiles import resolve_gpus
from harness.project import project_outcome
from harness.project.search import (
    MAX_BATCH_LIMIT,
    batch_step,
    context_limit,
    largest_model,
    max_batch,
    max_context,
    max_parallel_batch,
    smallest_batch,
)
from harness.project.served_parallel import search_cell, tensor_degree
from harness.records import Record
from suites.techniques import Unsupported

# The run id of rows `headroom project` prints (they are not part of a results folder).
PROJECT_RUN_ID = "project"


@dataclass(frozen=True)
class ProjectRequest:
    """One `headroom project` question (None: the default). `gpu` is a profile id or a family name (every
    variant of it, as `headroom run --gpu` takes it)."""

    gpu: str
    workload: str = "gpt"
    technique: str = "baseline"
    mode: str = "train"
    size: str | None = None
    batch_size: int | None = None
    max_batch: bool = False
    seq_len: int | None = None
    prompt_len: int | None = None  # serving: prompt and generated tokens per sequence
    gen_len: int | None = None
    max_context: bool = False  # serving: the longest prompt that fits at the batch
    dp: int | None = None  # data-parallel / sharded ranks of a parallel stack
    tp: int | None = None  # tensor-parallel ranks per group
    pp: int | None = None  # pipeline stages
    ep: int | None = None  # expert-parallel ranks
    min_gpus: bool = False  # solve for the fewest data-parallel ranks (powers of two) on which the stack fits

    @property
    def world_size(self) -> int:
        return (self.dp or 1) * (self.tp or 1) * (self.pp or 1) * (self.ep or 1)


def with_degrees(technique: str, tp: int | None, pp: int | None, ep: int | None = None) -> str:
    """The stack with --tp and --pp written into its parallel techniques (`tensor-parallel:t=8`); ValueError
    where a degree has no technique to take it or contradicts one the stack already names."""
    parts = technique.split("+")
    for flag, name, option, value in (("--tp", "tensor-parallel", "t", tp), ("--pp", "pipeline-parallel", "p", pp),
                                      ("--ep", "expert-parallel", "e", ep)):
        if value is None:
            continue
        found = [i for i, part in enumerate(parts) if part.strip().partition(":")[0] == name]
        if not found:
            raise ValueError(f"{flag} {value} needs {name} in the stack (e.g. --technique {name}+{technique})")
        part = parts[found[0]].strip()
        given = dict(item.partition("=")[::2] for item in part.split(":")[1:])
        if option in given and given[option] != str(value):
            raise ValueError(f"{flag} {value} contradicts {part} in the stack: give the degree once")
        given[option] = str(value)
        parts[found[0]] = ":".join([name, *(f"{key}={val}" for key, val in given.items())])
    return "+".join(parts)


def _resolve_all(request: ProjectRequest, profiles) -> list[ResolvedCell]:
    """The request's cell on each GPU it names."""
    return [_resolve(dataclasses.replace(request, gpu=profile.id), profiles)
            for profile in resolve_gpus([request.gpu], profiles)]


def _resolve(request: ProjectRequest, profiles) -> ResolvedCell:
    """The request's cell on one profile id: its size (default: the workload's first standard one) at
    the size's batch and sequence length unless the request sets them."""
    if request.batch_size is not None and request.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {request.batch_size}")
    degrees = [flag for flag, value in (("--dp", request.dp), ("--tp", request.tp), ("--pp", request.pp),
                                        ("--ep", request.ep)) if value and value > 1]
    degrees += ["--min-gpus"] if request.min_gpus else []
    if request.mode == "infer" and set(degrees) - {"--tp"}:
        raise ValueError(f"{', '.join(sorted(set(degrees) - {'--tp'}))}: a served model is projected over a tensor-"
                         "parallel group alone (--technique tensor-parallel+... --tp N); data, pipeline and expert "
                         "parallelism split training steps here. To fit one GPU, try bf16-weights, group-quant, "
                         "group-quant-int4 or kv-int8 (headroom advise --mode infer tries them)")
    # Batch 1 until the size is known; the empty size resolves to the workload's default (Cell.resolve).
    technique = with_degrees(request.technique, request.tp, request.pp, request.ep)
    cell = Cell(request.workload, request.size or "", request.mode, technique, request.gpu,
                request.batch_size or 1, source="projected", prompt_len=request.prompt_len,
                gen_len=request.gen_len, world_size=request.world_size).resolve(profiles)
    spec = cell.spec
    if cell.stack.parallel and request.world_size == 1 and request.dp is None and not request.min_gpus \
            and not (request.tp or request.pp or request.ep):
        raise ValueError(f"{cell.stack.name} runs on several GPUs: give how many (--dp N, --tp N, --pp N, --ep N) "
                         "or --min-gpus")
    if (request.dp or request.min_gpus) and not cell.stack.parallel:
        raise ValueError("--dp and --min-gpus apply to parallel stacks (data-parallel, zero1, fsdp, fsdp-zero2, "
                         f"cpu-offload, tensor-parallel, pipeline-parallel, expert-parallel); {cell.stack.name} runs "
                         "on one GPU")
    if request.max_context and spec.gen_len is None:
        raise ValueError("--max-context solves for a served decoder's longest prompt: it needs --mode infer and a "
                         "decoder workload (gpt)")
    if request.seq_len is not None and spec.gen_len is not None:
        raise ValueError("a served decoder's sequence is a prompt and generated tokens: use --prompt-len and "
                         "--gen-len instead of --seq-len")
    if request.seq_len is not None:
        limit = cell.workload.max_seq_len(spec)
        if spec.seq_len is None or limit is None:
            raise ValueError(f"--seq-len applies to language models that declare their longest sequence; "
                             f"{cell.workload.name} " + ("takes images" if spec.seq_len is None else
                                                         "keeps its example's sequence length"))
        if not 1 <= request.seq_len <= limit:
            raise ValueError(f"--seq-len must be between 1 and {limit} for {spec.name}, got {request.seq_len}")
        spec = dataclasses.replace(spec, seq_len=request.seq_len)
    if request.mode == "infer" and cell.stack.parallel:
        try:  # a layout the served group cannot take is the request's mistake: refused at the door
            tensor_degree(cell)
        except Unsupported as exc:
            raise ValueError(str(exc)) from None
    # Data (and expert) parallelism keeps each GPU's batch and multiplies the global one (weak scaling), and a pipeline
    # runs its micro-batches of the size's batch, unless the batch is given.
    return cell.with_spec(spec).with_batch(request.batch_size or spec.batch_size * (request.dp or 1)
                                           * (request.ep or 1) * _micro_batches(cell))


def _micro_batches(cell: ResolvedCell) -> int:
    from suites.techniques.pipeline import options_of

    pipeline = next((t for t in cell.stack.techniques if t.id.partition(":")[0] == "pipeline-parallel"), None)
    if pipeline is None:
        return 1
    options = options_of(pipeline)
    stages = options.stages or cell.cell.world_size
    return options.micro_batches_for(stages) if stages > 1 else 1


def projected_rows(request: ProjectRequest, profiles) -> list[Record]:
    """The projected row of the request's cell on each GPU it names; with `max_batch`, at the largest
    batch that fits each; with `min_gpus`, on the fewest GPUs that hold it."""
    if request.min_gpus:
        if request.max_batch:
            raise ValueError("--min-gpus and --max-batch each solve for one unknown: give --min-gpus with a batch "
                             "(--batch-size N, or the size's per group), or --max-batch with --dp N")
        if request.ep:
            raise ValueError("--min-gpus searches data-parallel groups, which expert parallelism shares its ranks "
                             "with: give --ep N (at most the size's experts) instead")
        return [fewest_gpus(request, profile.id, profiles) for profile in resolve_gpus([request.gpu], profiles)]
    return [_projected_row(cell, request.max_batch, request.max_context) for cell in _resolve_all(request, profiles)]


MAX_GPUS = 16384


def fewest_gpus(request: ProjectRequest, gpu: str, profiles) -> Record:
    """The row on the fewest GPUs on which the stack fits: data-parallel groups of 1, 2, 4, ... (up to
    MAX_GPUS in all) of the tensor- and pipeline-parallel degrees given, each at the size's batch per group
    unless --batch-size fixes the global one; the last row tried if none fits."""
    ranks, record, hopeless = 1, None, None
    while ranks * (request.tp or 1) * (request.pp or 1) <= MAX_GPUS:
        cell = _resolve(dataclasses.replace(request, gpu=gpu, dp=ranks, min_gpus=False), profiles)
        previous, record = record, to_record(cell, project_outcome(cell), PROJECT_RUN_ID)
        if record.status != "oom":
            break
        hopeless = _cannot_fit(previous, record, cell.profile.per_device().capacity_bytes)
        if hopeless:
            break
        ranks *= 2
    verdict = "fits" if record.status == "ok" else record.status
    found = f"--min-gpus: {verdict} on {record.world_size} GPUs"
    if record.status == "oom":
        found += f" (still out of memory at {record.world_size}, " + (hopeless or "the most tried") + ")"
    record.notes = "; ".join(filter(None, [record.notes, found]))
    return record


def _cannot_fit(before: Record | None, now: Record, capacity: int | None) -> str | None:
    """Why no larger data-parallel degree can fit, or None. Doubling the ranks halves each one's share of
    the sharded states, so the next doublings together take off at most what the last one did; a rank still
    short by more than that never fits (what is left is not sharded: activations, buffers, cast copies)."""
    if before is None or not capacity or before.peak_allocated_bytes is None or now.peak_allocated_bytes is None:
        return None
    drop = before.peak_allocated_bytes - now.peak_allocated_bytes
    short = now.peak_allocated_bytes + (now.device_overhead_bytes or 0) - capacity
    if short <= max(drop, 0):
        return None
    return (f"and more cannot fit: doubling to {now.world_size} took {max(drop, 0) / 2**30:,.1f} GiB off each rank's "
            f"peak allocated, further doublings at most as much again, and it is {short / 2**30:,.1f} GiB short; the "
            "rest is not sharded (activations, buffers, cast copies)")


def _projected_row(cell: ResolvedCell, search_batch: bool, search_context: bool = False) -> Record:
    notes = []
    if search_context and not cell.unsupported:
        _needs_memory_size(cell.profile, "--max-context")
        prompt = max_context(search_cell(cell))
        if prompt:
            if prompt == context_limit(cell) and cell.workload.max_seq_len(cell.spec) is not None:
                notes.append(f"--max-context: the model's own limit binds, not memory ({prompt + cell.spec.gen_len:,} "
                             f"positions, {cell.spec.gen_len} of them generated)")
            cell = cell.with_spec(dataclasses.replace(cell.spec, seq_len=prompt))
        else:
            notes.append(f"--max-context: not even a 1-token prompt and {cell.spec.gen_len} generated tokens fit "
                         f"at batch {cell.batch_size}")
    if search_batch:
        _needs_memory_size(cell.profile, "--max-batch")
        if not cell.unsupported:  # an unsupported stack is reported as such by its row
            least = smallest_batch(cell.stack, cell.workload, cell.mode)
            batch = least
            try:
                if cell.stack.parallel and cell.mode == "infer":
                    batch = max_batch(search_cell(cell), step=batch_step(cell.stack), smallest=least) or least
                elif cell.stack.parallel:  # every rank's memory, at a batch its ranks and micro-batches split
                    least = batch = cell.batch_size
                    batch = max_parallel_batch(cell) or batch
                else:
                    batch = max_batch(cell, step=batch_step(cell.stack), smallest=least) or least
            except Unsupported:
                pass  # raised by the stack at this size: the row reports it
            except Exception as exc:  # a model that fails to trace (a user's): its row below says how
                notes.append(f"--max-batch: the search failed ({type(exc).__name__}: {exc}); batch {least} shown")
            if batch >= MAX_BATCH_LIMIT:
                notes.append(f"--max-batch stopped at its search limit {MAX_BATCH_LIMIT}: a larger batch may fit")
            cell = cell.with_batch(batch)
    record = to_record(cell, project_outcome(cell), PROJECT_RUN_ID)
    if search_batch and record.status == "ok":
        notes.append(_margin_note(record, cell.profile.per_device().capacity_bytes))
    elif search_batch and record.status == "oom":
        # A single-device row shown is the smallest batch the search tried: that it does not fit answers the
        # question. A parallel training search starts at a batch every rank and micro-batch splits, and shows the
        # size's own batch when none fits.
        parallel_training = cell.stack.parallel and cell.mode != "infer"
        record.reason = (f"no batch the search tried fits; at batch {cell.batch_size} it {record.reason}"
                         if parallel_training else f"no batch fits: even batch {cell.batch_size} {record.reason}")
    if search_context and record.status == "ok" and not any(n.startswith("--max-context: the model's") for n in notes):
        notes.append(_margin_note(record, cell.profile.per_device().capacity_bytes, context=True))
    record.notes = "; ".join(filter(None, [record.notes, *notes]))
    return record


def _margin_note(record: Record, capacity: int | None, context: bool = False) -> str:
    """What the largest batch (`context`: the longest prompt) leaves to spare (after the CUDA context, as
    `headroom advise` counts it), and whether the projection's error bar stays inside the card."""
    from harness.advise import memory_row, row_memory_left, row_memory_left_worst  # advise builds on this module

    row = memory_row(record)
    left = row_memory_left(row, capacity) if capacity else None
    if left is None:
        return ""
    found = (f"--max-context: a {record.seq_len:,}-token prompt at batch {record.batch_size}" if context else
             f"--max-batch: batch {record.batch_size}")
    note = (f"{found} leaves {left / 2**30:.1f} GiB of the card's "
            f"{capacity / 2**30:.0f} GiB" + (" after the CUDA context" if row["device_overhead_bytes"] else ""))
    worst = row_memory_left_worst(row, capacity)
    if worst is not None and worst < 0:
        note += (f", but at the error bar's upper end ({row['peak_reserved_high_bytes'] / 2**30:.1f} GiB reserved) "
                 f"it is short by {-worst / 2**30:.1f} GiB: a smaller {'prompt' if context else 'batch'} is safer "
                 "until a run on the card "
                 "confirms this one")
    return note


def _needs_memory_size(profile, flag: str) -> None:
    if profile.vendor == "cpu" or profile.capacity_bytes is None:
        raise ValueError(f"{flag} needs a profile with a memory size to fit in; {profile.id} has none "
                         "(the host's memory is not modelled): pick a GPU profile")


def largest_model_answers(request: ProjectRequest, profiles) -> list[dict]:
    """The largest size of the request's workload that fits each GPU it names, at its smallest batch."""
    ignored = [flag for flag, value in (("--size", request.size), ("--batch-size", request.batch_size),
                                        ("--max-batch", request.max_batch or None), ("--seq-len", request.seq_len),
                                        ("--max-context", request.max_context or None))
               if value is not None]
    if ignored:
        raise ValueError(f"--largest-model searches every size of {request.workload} at its smallest batch: "
                         f"drop {', '.join(ignored)}")
    if request.mode == "infer" and request.tp:
        raise ValueError("--largest-model does not search a tensor-parallel group yet: ask each --size with --tp N "
                         "(or headroom serve-matrix --tp N), or drop --tp for one GPU")
    answers = []
    for cell in _resolve_all(request, profiles):
        answer = largest_model(cell)
        answers.append({"gpu": cell.profile.id, "workload": cell.workload.name, "technique": cell.stack.name,
                        "mode": cell.mode, "largest_size_that_fits": answer.size, "batch_size": answer.batch_size,
                        "reason": answer.reason})
    return answers
