"""The outcome of a cell, and the one function that turns it into a row.

Measuring a cell (harness/measure/) and projecting it (harness/project/) each return an `Outcome`:
status, memory, speed, fit and notes, in the same types and units. `to_record` adds the cell's
identity, the figures derived from speed (tokens/s, MFU, cost: harness/metrics.py) and provenance,
so a measured and a projected row cannot disagree on what a column means, and a new column is added
here (and in records.py and the report) once. The two paths still share no *measuring* code, so one
checks the other.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch

from harness.cell import Cell, ResolvedCell
from harness.measure.nvml import NvmlFigures
from harness.metrics import speed_and_cost
from harness.model_flops import analytic_flops_per_sample, model_flops_per_sample
from harness.provenance import git_sha
from harness.records import Record


@dataclass
class MemoryFigures:
    """Bytes (None: unknown). Measured rows fill what their device reports; projected rows what the
    trace and the allocator model give (see the Record's columns for each figure's meaning)."""

    peak_allocated: int | None = None
    peak_reserved: int | None = None
    reserved_expandable: int | None = None  # projected only
    reserved_async: int | None = None  # projected only
    device_overhead: int | None = None
    library_workspaces: int | None = None
    params: int | None = None
    grads: int | None = None
    optimizer: int | None = None
    activations: int | None = None
    temporaries: int | None = None
    param_count: int | None = None
    process_peak_rss: int | None = None  # measured only
    alloc_retries: int | None = None  # measured CUDA only
    allocator: str | None = None  # measured CUDA only: the setting the process ran under
    peak_reserved_low: int | None = None  # projected only: the ledger's interval
    peak_reserved_high: int | None = None
    peak_reserved_cells: int | None = None
    kv_cache: int | None = None  # a served decoder's KV cache (apart from `params`, the weights)
    host: int | None = None  # offloaded state in host memory (not in any device figure above)


@dataclass
class SpeedFigures:
    """One step's time and the throughput it gives (samples per second of timed loops)."""

    step_time_ms_p50: float
    throughput_samples_s: float
    step_time_ms_p90: float | None = None
    step_time_ms_mean: float | None = None  # batch / throughput: the figure throughput is computed from
    step_time_cv: float | None = None
    noisy: bool | None = None
    timed_steps: int | None = None
    step_time_ms_low: float | None = None  # projected only: the ledger's interval
    step_time_ms_high: float | None = None
    step_time_cells: int | None = None
    warmup_s: float | None = None  # measured only: the warm-up steps (compilation), kept out of step times


@dataclass
class ServingFigures:
    """A served decoder's generation: prompt prefill (time to first token) and decode from the KV cache.

    `streamed_bytes` is what a decode step must read besides the cache: the weights, less tables read one
    row per token (embeddings). The KV cache's size is a memory figure (MemoryFigures.kv_cache)."""

    gen_len: int
    ttft_ms: float
    decode_ms_p50: float | None
    decode_ms_p90: float | None
    decode_ms_mean: float | None
    streamed_bytes: int


@dataclass
class Outcome:
    """What measuring or projecting a cell gave.

    Attributes:
        status: `ok`, `oom`, `unsupported`, `error` or `timeout` (records.STATUSES).
        reason: why, for any status but `ok`.
        precision: the label the stack left on the run (`fp32`, `bf16-mixed`, ...).
        memory, speed: the figures; None where the cell has none (an oom has no speed).
        fits: whether the step runs in the device's memory (None: no memory size to judge against).
        notes: facts worth keeping beside the figures.
    """

    status: str
    reason: str = ""
    precision: str | None = None
    memory: MemoryFigures | None = None
    speed: SpeedFigures | None = None
    fits: bool | None = None
    device_name: str | None = None
    driver_version: str | None = None
    wall_time_s: float | None = None
    notes: list[str] = field(default_factory=list)
    interval_basis: str | None = None  # projected only: what the intervals rest on
    serving: ServingFigures | None = None  # a served decoder's generation
    nvml: NvmlFigures | None = None  # measured CUDA only: what NVML saw over the timed steps
    samples_timed: int | None = None  # samples the timed steps processed (energy per sample)
    usd_per_kwh: float | None = None  # the electricity price energy is costed at (`--usd-per-kwh`)
    comm_bytes_per_step: int | None = None  # parallel stacks: bytes each rank sends per step


def failure(status: str, reason: str, **values) -> Outcome:
    """An outcome without figures: unsupported, error, timeout, or an oom without a reading."""
    return Outcome(status=status, reason=reason, **values)


def to_record(cell: Cell | ResolvedCell, outcome: Outcome, run_id: str) -> Record:
    """The row of `outcome`. A cell that could not be resolved (an unknown name in a crashed
    process's spec) still gets its identity; figures derived from speed need the resolved cell."""
    resolved = cell if isinstance(cell, ResolvedCell) else None
    named = resolved.cell if resolved else cell
    notes = list(outcome.notes)
    values: dict = {}
    if resolved is not None:
        # A variable-length loop's rows count its mean length (tokens/s, cost per token).
        values.update(seq_len=resolved.workload.tokens_per_sample(resolved.spec, resolved.mode),
                      image_size=resolved.spec.image_size, gen_len=resolved.spec.gen_len,
                      accuracy_metric=resolved.workload.accuracy_metric or None)
        values["device_name"] = outcome.device_name or resolved.profile.name
    if outcome.memory is not None:
        values.update(_memory_columns(outcome.memory))
    if outcome.nvml is not None:
        values.update(_nvml_columns(outcome.nvml, outcome.samples_timed, outcome.usd_per_kwh, notes))
    if resolved is not None and (outcome.memory is not None or outcome.speed is not None):
        # A cell with figures (ok, or a projected oom) has its model FLOPs; MFU and cost need speed too.
        flops_per_sample = flops_per_sample_of(resolved, notes)
        values["flops_per_step"] = flops_per_sample * resolved.batch_size if flops_per_sample else None
        if outcome.speed is not None:
            values.update(_speed_columns(resolved, outcome, flops_per_sample))
        if outcome.serving is not None:
            kv_bytes = outcome.memory.kv_cache if outcome.memory is not None else None
            values.update(_serving_columns(resolved, outcome.serving, kv_bytes))
    fits = outcome.fits
    if (fits is None and named.source == "measured" and outcome.status in ("ok", "oom") and resolved
            and resolved.profile.vendor != "cpu"):
        # On a GPU a measured step that ran did fit, one that ran out did not; the host CPU has no
        # memory size to fit in (as its projected twin says: None).
        fits = outcome.status == "ok"
    return Record(
        run_id=run_id, workload=named.workload, size=named.size, mode=named.mode, technique=named.technique,
        gpu=named.gpu, source=named.source, status=outcome.status, reason=outcome.reason, cell_id=named.cell_id,
        batch_size=named.batch_size, precision=outcome.precision, fits=fits,
        torch_version=torch.__version__, cuda_version=torch.version.cuda if torch.cuda.is_available() else None,
        driver_version=outcome.driver_version, git_sha=git_sha(), hostname=socket.gethostname(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"), wall_time_s=outcome.wall_time_s,
        interval_basis=outcome.interval_basis, notes="; ".join(filter(None, notes)), world_size=named.world_size,
        comm_bytes_per_step=outcome.comm_bytes_per_step, **values)


def _memory_columns(memory: MemoryFigures) -> dict:
    return dict(
        peak_allocated_bytes=memory.peak_allocated, peak_reserved_bytes=memory.peak_reserved,
        peak_reserved_expandable_bytes=memory.reserved_expandable, peak_reserved_async_bytes=memory.reserved_async,
        host_bytes=memory.host, device_overhead_bytes=memory.device_overhead,
        library_workspace_bytes=memory.library_workspaces,
        params_bytes=memory.params, grads_bytes=memory.grads, optimizer_bytes=memory.optimizer,
        activations_bytes=memory.activations, temporaries_bytes=memory.temporaries, param_count=memory.param_count,
        process_peak_rss_bytes=memory.process_peak_rss, alloc_retries=memory.alloc_retries,
        allocator=memory.allocator, peak_reserved_low_bytes=memory.peak_reserved_low,
        peak_reserved_high_bytes=memory.peak_reserved_high, peak_reserved_cells=memory.peak_reserved_cells,
        kv_cache_bytes=memory.kv_cache)


def _speed_columns(resolved: ResolvedCell, outcome: Outcome, flops_per_sample: float | None) -> dict:
    """Speed as measured or projected, and what derives from it (tokens/s, MFU, cost)."""
    speed = outcome.speed
    # A generation's tokens are the ones it generates (tokens/s and USD per million generated tokens).
    tokens = resolved.spec.gen_len or resolved.workload.tokens_per_sample(resolved.spec, resolved.mode)
    # N ranks are N GPUs: utilisation and cost are per GPU, at the global throughput's Nth.
    world = resolved.cell.world_size
    per_gpu = speed.throughput_samples_s / world if speed.throughput_samples_s is not None else None
    derived = speed_and_cost(resolved.profile, outcome.precision or "fp32", flops_per_sample or 0.0,
                             per_gpu, tokens, convolutional=resolved.workload.traits.convolutional)
    if derived.get("tokens_per_s") is not None:
        derived["tokens_per_s"] *= world
    if not flops_per_sample:
        derived["mfu"] = None  # unknown model FLOPs: no utilisation, rather than a 0
    return dict(step_time_ms_p50=speed.step_time_ms_p50, step_time_ms_p90=speed.step_time_ms_p90,
                step_time_ms_mean=speed.step_time_ms_mean,
                step_time_cv=speed.step_time_cv, noisy=speed.noisy, timed_steps=speed.timed_steps,
                step_time_ms_low=speed.step_time_ms_low, step_time_ms_high=speed.step_time_ms_high,
                step_time_cells=speed.step_time_cells, warmup_s=speed.warmup_s,
                throughput_samples_s=speed.throughput_samples_s, **derived)


def _nvml_columns(nvml: NvmlFigures, samples: int | None, usd_per_kwh: float | None, notes: list[str]) -> dict:
    """What the driver saw: this process's memory (context included), power, energy per sample, and
    what that energy costs at `usd_per_kwh` (3.6 MJ per kWh)."""
    per_sample = nvml.energy_j / samples if nvml.energy_j is not None and samples else None
    if nvml.energy_basis:
        notes.append(f"energy from the GPU's {nvml.energy_basis} over {nvml.seconds:.2f} s "
                     f"({nvml.samples} NVML samples)")
    return dict(nvml_process_bytes=nvml.process_peak_bytes, nvml_device_used_bytes=nvml.device_used_peak_bytes,
                power_w_mean=nvml.power_w_mean,
                energy_j_per_sample=per_sample, sm_clock_mhz_mean=nvml.sm_clock_mhz_mean,
                temperature_c_max=nvml.temperature_c_max,
                energy_usd_per_million_samples=per_sample * 1e6 / 3.6e6 * usd_per_kwh
                if per_sample is not None and usd_per_kwh else None)


def _serving_columns(resolved: ResolvedCell, serving: ServingFigures, kv_bytes: int | None) -> dict:
    """A generation's figures, and the bandwidth its decode uses: the bytes a decode step reads (the
    streamed weights once for the batch, and every sequence's cache up to its mean position) over the
    mean decode step time, against the profile's datasheet bandwidth. An unknown cache size leaves both
    unknown (counting it as 0 would understate them)."""
    batch, prompt = resolved.batch_size, resolved.spec.seq_len
    context = prompt + serving.gen_len
    # Decode steps feed positions prompt .. context - 2 and each reads the cache up to its own position.
    mean_tokens = prompt + serving.gen_len / 2
    bytes_per_step = serving.streamed_bytes + kv_bytes * mean_tokens / context if kv_bytes is not None else None
    bandwidth = resolved.profile.per_device().memory_bandwidth_bytes_s
    mean_s = serving.decode_ms_mean / 1e3 if serving.decode_ms_mean else None
    return dict(
        ttft_ms=serving.ttft_ms, decode_ms_per_token_p50=serving.decode_ms_p50,
        decode_ms_per_token_p90=serving.decode_ms_p90, decode_tokens_s=batch / mean_s if mean_s else None,
        prefill_tokens_s=batch * prompt / (serving.ttft_ms / 1e3) if serving.ttft_ms else None,
        decode_bytes_per_step=round(bytes_per_step) if bytes_per_step is not None else None,
        decode_bandwidth_util=bytes_per_step / mean_s / bandwidth if bytes_per_step and mean_s and bandwidth else None)


def flops_per_sample_of(resolved: ResolvedCell, notes: list[str]) -> float | None:
    """Model FLOPs per sample of the model the stack builds; where counting the transformed model fails,
    the model as built, and where that fails too (a user's model whose forward branches on values fake
    tensors cannot hold), None: each with a note, as a finished measurement must not be lost to its
    MFU's numerator."""
    try:
        return model_flops_per_sample(resolved)
    except Exception as exc:
        notes.append(f"model FLOPs of the model as built, not as transformed ({type(exc).__name__}: {exc})")
    try:
        return analytic_flops_per_sample(resolved.workload, resolved.spec, resolved.mode)
    except Exception as exc:
        notes[-1] = f"model FLOPs unknown, so no MFU: {type(exc).__name__}: {str(exc)[:200]}"
        return None
