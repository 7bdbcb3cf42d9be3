"""Projection: memory, fit and step time of a cell on any GPU profile, without that GPU.

One step is traced on fake tensors (trace.py), deep models at two small depths and extrapolated
(depth.py); memory is the trace replayed through a model of the CUDA caching allocator plus the
CUDA context and library workspaces (memory.py, allocator.py); time a per-op roofline with the host's
issue cost (roofline.py, constants in speed_constants.py), each with an error bar from the ledger of
projected-vs-measured pairs (harness/ledger.py); searches for the largest batch or model build on it
(search.py). `project_outcome`
returns the same `Outcome` a measurement does (harness/outcome.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from harness.cell import ResolvedCell
from harness.ledger import decode_interval, interval, shipped_ledger, unfitted_interval
from harness.outcome import MemoryFigures, Outcome, ServingFigures, SpeedFigures, failure
from harness.project.depth import traced_to_depth
from harness.project.memory import MemoryProjection, MiB, project_memory
from harness.project.roofline import TimeEstimate, estimate, where_the_step_goes
from harness.project.search import (
    MAX_BATCH_LIMIT,
    LargestModel,
    batch_step,
    fits_at,
    largest_model,
    max_batch,
    smallest_batch,
)
from harness.project.serving import GenerationTime, generation_time
from harness.project.speed_constants import constants_for, decode_fit_provenance, fit_provenance
from harness.project.trace import StepTrace, traced
from harness.project.variable_length import project_loop
from suites.techniques import Unsupported
from suites.workloads.fragmentation import loop_specs


@dataclass
class Projection:
    memory: MemoryProjection
    time: TimeEstimate | None
    trace: StepTrace
    generation: GenerationTime | None = None  # a served decoder's prefill and decode times


def project(cell: ResolvedCell) -> Projection:
    """Memory and time of one cell on its profile (raises Unsupported like a measured run would)."""
    loop = loop_specs(cell.workload, cell.spec, cell.mode)
    if loop:  # trained on a length drawn per step: the loop's reserved peak and mean step
        return project_loop(cell, loop, _project_fixed)
    return _project_fixed(cell)


def _project_fixed(cell: ResolvedCell) -> Projection:
    profile = cell.profile.per_device()  # a process runs on one device of a multi-device package
    trace, logged, depths = traced_to_depth(cell, profile)
    memory = project_memory(trace, logged, profile, cell.mode, depths)
    memory.notes[:0] = trace.notes
    if trace.untraced:
        memory.notes.append(f"no step time: the trace cannot see {', '.join(trace.untraced)}")
        return Projection(memory, None, trace)
    generation = generation_time(trace, profile) if trace.gen_len else None
    time = generation.as_step() if generation else (
        None if trace.gen_len else estimate(trace, profile, tf32_matmul=trace.tf32))
    if time is not None:
        memory.notes.extend(time.notes)
    if generation is not None and cell.batch_size > 1:
        memory.notes.append(f"ttft_ms is the prefill of all {cell.batch_size} prompts in one step (static batching, as "
                            "the measured cell runs it), not one request's wait under a server's continuous batching")
    return Projection(memory, time, trace, generation)


def project_outcome(cell: ResolvedCell) -> Outcome:
    """The projected outcome of `cell`: ok, oom (does not fit, with the numbers), unsupported or
    error; never raises for a problem of the cell itself."""
    started = time.perf_counter()
    if cell.unsupported:
        return failure("unsupported", cell.unsupported)
    try:
        if cell.stack.parallel and cell.mode == "infer":  # over a tensor-parallel group (served_parallel.py)
            from harness.project.served_parallel import project_served  # it builds on this module

            return project_served(cell, outcome_of, started)
        if cell.stack.parallel:  # on several GPUs: one rank's trace, sharded (harness/project/parallel.py)
            from harness.project.parallel import project_parallel  # it builds on this module

            return dataclasses.replace(project_parallel(cell), wall_time_s=time.perf_counter() - started)
        projection = project(cell)
    except Unsupported as exc:
        return failure("unsupported", str(exc))
    except Exception as exc:  # a projection bug must become a row, not end the run
        return failure("error", f"projection failed: {type(exc).__name__}: {exc}")
    return outcome_of(cell, projection, started)


def outcome_of(cell: ResolvedCell, projection: Projection, started: float, served_by: str | None = None) -> Outcome:
    """The outcome of `cell` from its projection; `served_by`: a served decoder's generation spread over a
    tensor-parallel group (its interval then says the collectives' model was never fitted)."""
    memory, step = projection.memory, projection.time
    status, reason = ("oom", oom_reason(memory, cell.profile.id)) if memory.fits is False else ("ok", "")
    if status == "oom" and projection.trace.gen_len:
        # fp32 weights (no weight technique) take twice bf16's memory: the first thing to try.
        halve = "bf16-weights, " if projection.trace.precision == "fp32" else ""
        more = "more GPUs (a larger --tp)" if served_by else "several GPUs (--technique tensor-parallel+... --tp N)"
        reason += (f"; try {halve}quantised weights (group-quant, group-quant-int4), kv-int8, a shorter context or "
                   f"serving it over {more}")
    speed = None
    # A cell that cannot run has no speed or cost, as a measured oom row has none.
    ledger = shipped_ledger()
    kind = dict(ledger=ledger, workload=cell.workload.name, precision=projection.trace.precision,
                generation=cell.profile.generation)
    basis = []
    if step is not None and status == "ok":
        # One projected step time: median, mean and the throughput all come from it.
        fit = fit_provenance()
        # Never narrower than the fit's held-out median error; from other GPU generations only, never
        # narrower than its held-out worst (the bias across generations is what the fit saw least of).
        if projection.generation is not None:
            # The ledger's pairs are training and one-pass inference steps: none says how far off a
            # projected prefill + decode is. Published one-row compiled decodes do (decode_fit.toml), for a
            # vendor whose decode constants were fitted on them; other batches and eager decodes were never judged.
            decode_fit = decode_fit_provenance()
            bar = (unfitted_interval(step.step_s * 1e3, served_by) if served_by else
                   decode_interval(step.step_s * 1e3, decode_fit) if decode_fit and _decode_judged(cell, projection)
                   else unfitted_interval(step.step_s * 1e3, "no generation (prefill + decode) of this kind measured "
                                          "(published decodes judge " + JUDGED_DECODES + ")"))
        elif step.fitted:
            bar = interval(step.step_s * 1e3, measured_column="measured_step_ms", projected_column="projected_step_ms",
                           floor=fit.get("held_out_median_abs_error", 0.0),
                           other_generations_floor=fit.get("held_out_worst_abs_error", 1.0), **kind)
        else:
            bar = unfitted_interval(step.step_s * 1e3)
        basis.append(f"step time: {bar.basis}")
        speed = SpeedFigures(step_time_ms_p50=step.step_s * 1e3, step_time_ms_mean=step.step_s * 1e3,
                             throughput_samples_s=cell.batch_size / step.step_s, step_time_ms_low=bar.low,
                             step_time_ms_high=bar.high, step_time_cells=bar.cells)
        breakdown = where_the_step_goes(step)
        if breakdown:
            memory.notes.append(breakdown)
    train = cell.mode == "train"
    if projection.trace.compiled:
        # torch.compile cannot run on the trace's fake tensors (harness/project/trace.py): the step is traced
        # eagerly, and only the speed model sees the compiled kernels.
        memory.notes.append("memory as the eager step's (the trace cannot run torch.compile)"
                            + (": usually an upper bound, as AOTAutograd's partitioner recomputes cheap elementwise"
                               " ops in the backward rather than saving their outputs" if train else "")
                            + "; compile time not projected (warmup_s empty)")
    reserved = memory.chosen_reserved
    reserved_bar = None
    if reserved:
        reserved_bar = interval(reserved, measured_column="measured_peak_reserved_bytes",
                                projected_column="projected_peak_reserved_bytes", **kind)
        basis.append(f"peak reserved: {reserved_bar.basis}")
    figures = MemoryFigures(
        peak_allocated=memory.peak_allocated, peak_reserved=memory.chosen_reserved,
        reserved_expandable=memory.reserved.get("expandable_segments"),
        reserved_async=memory.reserved.get("cudaMallocAsync"), device_overhead=memory.overhead,
        library_workspaces=memory.workspaces, params=memory.params, grads=memory.grads if train else None,
        optimizer=memory.optimizer if train else None, activations=memory.activations,
        temporaries=memory.temporaries, param_count=projection.trace.param_count,
        peak_reserved_low=round(reserved_bar.low) if reserved_bar else None,
        peak_reserved_high=round(reserved_bar.high) if reserved_bar else None,
        peak_reserved_cells=reserved_bar.cells if reserved_bar else None,
        kv_cache=projection.trace.kv_cache_bytes if projection.trace.gen_len else None,
        host=projection.trace.host.host_bytes if projection.trace.host else None)
    return Outcome(status=status, reason=reason, precision=projection.trace.precision, memory=figures, speed=speed,
                   fits=memory.fits, device_name=cell.profile.name, wall_time_s=time.perf_counter() - started,
                   notes=memory.notes, interval_basis="; ".join(basis) or None,
                   serving=_serving(projection) if speed is not None else None)


# What the published decodes of benchmarks/data/published_decode.csv are: the kind of generation whose error
# the decode fit measured, and so the only kind its held-out error bounds.
JUDGED_DECODES = ("one-row compiled decodes of a 7B-70B model's bf16, int8 or int4 weights, over a cache of at most "
                  "512 tokens, on A100s and H100s")
JUDGED_GENERATIONS = ("ampere", "hopper")
JUDGED_WEIGHTS = ("bf16-weights", "fp16-weights")


def _decode_judged(cell: ResolvedCell, projection: Projection) -> bool:
    """Whether `cell` is a generation of the kind the published decodes judge (JUDGED_DECODES): batch 1,
    compiled, 16-bit weights (weight-only int8/int4 on top allowed, an int8 KV cache not), weights of at least
    a gigabyte (a smaller model's step is launches, not its weights' read), a short cache, a GPU generation
    the rows ran on whose decode constants were fitted."""
    names = {technique.id for technique in cell.stack.techniques}
    return (cell.batch_size == 1 and projection.trace.compiled and "kv-int8" not in names
            and any(weights in names for weights in JUDGED_WEIGHTS) and projection.trace.params_bytes >= 1e9
            and (cell.spec.seq_len or 0) + (cell.spec.gen_len or 0) <= 512
            and cell.profile.generation in JUDGED_GENERATIONS
            and constants_for(cell.profile.per_device()).gpu.decode_fitted)


def _serving(projection: Projection) -> ServingFigures | None:
    generation, trace = projection.generation, projection.trace
    if generation is None:
        return None
    return ServingFigures(gen_len=generation.gen_len, ttft_ms=generation.prefill_s * 1e3,
                          decode_ms_p50=generation.decode_s(0.5) * 1e3, decode_ms_p90=generation.decode_s(0.9) * 1e3,
                          decode_ms_mean=generation.decode_mean_s * 1e3,
                          streamed_bytes=trace.params_bytes - trace.gathered_bytes)


def _mib(size: int, up: bool = True) -> str:
    """`size` in whole MiB, rounded up (what is needed) or down (what there is), so that a stated
    `needed + context > capacity` stays true in the rounded figures too."""
    return f"{(math.ceil if up else math.floor)(size / MiB):,} MiB"


def oom_reason(memory: MemoryProjection, gpu: str) -> str:
    context = f"{_mib(memory.overhead)} CUDA context > {_mib(memory.capacity, up=False)} on {gpu}"
    if memory.peak_allocated + memory.overhead > memory.capacity:
        return f"needs {_mib(memory.peak_allocated)} allocated at its peak + {context}"
    if memory.allocator != "native":
        return f"needs {_mib(memory.chosen_reserved)} reserved under {memory.allocator} + {context}"
    # The live bytes would fit, but not in the segments the allocator can keep.
    return (f"needs {_mib(memory.chosen_reserved)} reserved + {context}, and freeing the cached "
            f"blocks on a failed cudaMalloc does not make room for its {_mib(memory.peak_allocated)} allocated")


__all__ = ["MAX_BATCH_LIMIT", "LargestModel", "Projection", "batch_step", "estimate", "fits_at", "largest_model",
           "max_batch", "project", "project_outcome", "smallest_batch", "traced"]
