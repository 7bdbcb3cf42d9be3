"""Measure one resolved cell on the local device: build, transform, warm up, read memory, time steps.

Returns an `Outcome` (harness/outcome.py), as projection does; nothing here is shared with projection,
so each checks the other. Exceptions propagate: the cell's process turns them into rows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.cell import ResolvedCell
from harness.measure import artifacts
from harness.measure.comm_volume import bytes_sent
from harness.measure.distributed import RANK_ROW_SUFFIX, rank_slice
from harness.measure.generation import time_generation
from harness.measure.memory import probe_for
from harness.measure.nvml import NvmlSampler, open_source
from harness.measure.tensors import gradient_bytes, holding_state, optimizer_state_bytes, parameter_bytes
from harness.measure.timing import time_steps
from harness.outcome import MemoryFigures, Outcome, ServingFigures, SpeedFigures, failure
from harness.provenance import nvml_info
from harness.records import DEFAULT_NOISE_THRESHOLD
from suites.step import Step
from suites.techniques import Run, Unsupported
from suites.techniques.adapters import store_frozen
from suites.techniques.offload import host_state_bytes
from suites.workloads.base import count_parameters
from suites.workloads.fragmentation import loop_specs
from suites.workloads.moe import unread_expert_bytes

# Extra warm-up steps allowed for fp16 loss scaling to settle (each overflow halves the scale).
MAX_SCALER_WARMUP = 30


@dataclass(frozen=True)
class MeasureSettings:
    """How hard to measure: warm-up steps, timed steps per repeat, repeats, and when a cell is noisy."""

    warmup: int = 2
    steps: int = 10
    repeats: int = 3
    seed: int = 0
    noise_threshold: float = DEFAULT_NOISE_THRESHOLD
    # Artifacts kept beside the rows (harness/measure/artifacts.py), in `artifacts_dir` (the results folder)
    artifacts_dir: str | None = None
    memory_timeline: bool = False
    profile: bool = False
    tensorboard_dir: str | None = None
    usd_per_kwh: float | None = None  # electricity price for the energy cost of measured CUDA rows

    def __post_init__(self) -> None:
        # Percentiles and the spread need enough steps: p90 of fewer than 10 is one step's time.
        if self.steps < 10:
            raise ValueError(f"--steps must be at least 10 timed steps, got {self.steps}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats} and {self.warmup}")


class RestartWithEnvironment(Exception):
    """The stack sets environment variables this process did not start with.

    Allocator settings are read before any technique runs: the backend (`cudaMallocAsync`) when the
    CUDA library loads with `import torch`, the rest when the device starts (c10/cuda's
    CUDAAllocatorConfig). So the cell's process starts again with them (harness/measure/process.py)."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(f"restart with {env}")
        self.env = env


def measure(cell: ResolvedCell, settings: MeasureSettings) -> Outcome:
    """Run and measure `cell` on the local device (its profile is this machine's)."""
    started = time.perf_counter()
    workload, spec, profile = cell.workload, cell.spec, cell.profile
    device = torch.device("cuda" if profile.vendor != "cpu" else "cpu")
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)

    probe = probe_for(device)
    with probe:
        run = Run(workload=workload, size=spec, mode=cell.mode, profile=profile, model=workload.build(spec),
                  batch_size=cell.batch_size)
        try:
            cell.stack.apply(run)
        except Unsupported as exc:
            return failure("unsupported", str(exc), device_name=profile.name)
        unset = {name: value for name, value in run.env.items() if os.environ.get(name) != value}
        if unset:
            raise RestartWithEnvironment(unset)
        if cell.mode == "train" and run.autocast_dtype is not None:
            # Before placement (Step would do it after): frozen weights never reach the device in fp32.
            store_frozen(run)
        if not run.placed:  # parallel stacks put their shards where they belong (host memory for cpu-offload)
            run.model = run.model.to(device)
        try:
            step = Step(run, device)  # a step can refuse what the stack's techniques leave together
        except Unsupported as exc:
            return failure("unsupported", str(exc), device_name=profile.name)
        # Every rank draws the same global batch and keeps its slice (data-parallel and sharded stacks); a
        # variable-length workload draws one per step of its loop of lengths.
        loop = loop_specs(workload, spec, cell.mode) or [spec]
        batches = [{k: v.to(device) for k, v in rank_slice(workload.batch(size, cell.batch_size, generator),
                                                            run.data_parallel, run.data_rank).items()}
                   for size in loop]
        batch = batches[max(range(len(loop)), key=lambda i: loop[i].seq_len or 0)]  # memory is read on the longest
        warm_up_started = time.perf_counter()
        for _ in range(settings.warmup):
            step(batch)
        if len(batches) > 1:
            for each in batches:  # the whole loop once: every length's blocks go through the cache
                step(each)
            run.notes.append(f"variable-length loop: sequence lengths {', '.join(str(s.seq_len) for s in loop)}, "
                             f"one per step (timed steps run whole loops); memory read on the longest step, "
                             f"reserved over the whole loop")
        # fp16 loss scaling starts at 2**16 and skips the optimizer step while gradients overflow; warm
        # up until a step was really taken, or the optimizer state (and its memory) would be missing.
        for _ in range(MAX_SCALER_WARMUP):
            if _optimizer_state_started(step.optimizer):
                break
            step(batch)
        else:
            if step.scaler is not None and not _optimizer_state_started(step.optimizer):
                return failure("error", f"fp16 loss scaling skipped every optimizer step of {MAX_SCALER_WARMUP} "
                               "warm-up steps (gradients overflow at every scale): the optimizer state, and its "
                               "memory, never appeared; try amp-bf16, which needs no loss scaling",
                               device_name=profile.name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the warm-up's kernels are done before its time is read
        warmup_s = time.perf_counter() - warm_up_started
        probe.begin_measured_step()
        loss = step(batch, mark=probe.mark)
        probe.end_measured_step()
    reading = probe.reading()
    if cell.mode == "train" and not torch.isfinite(loss).all():
        return failure("error", f"non-finite loss {loss.item()}", device_name=profile.name)

    serving = None
    source, _ = open_source(device)
    sampler = NvmlSampler(source) if source is not None else contextlib.nullcontext()
    with sampler:
        timing, generation = _timed(step, batches if len(batches) > 1 else batch, settings, device)
    if step.generates:
        serving = ServingFigures(
            gen_len=spec.gen_len, ttft_ms=generation.ttft_ms, decode_ms_p50=generation.decode_percentile_ms(0.5),
            decode_ms_p90=generation.decode_percentile_ms(0.9),
            decode_ms_mean=generation.decode_mean_s * 1e3 if generation.decode_mean_s else None,
            streamed_bytes=parameter_bytes(run.model) - workload.serving.gathered_bytes(run.model)
            - unread_expert_bytes(run.model, run.batch_size))
    # ru_maxrss is in KiB on Linux: the process's peak resident memory, a check on everything above.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # On an accelerator, state kept in host memory (FSDP2's CPU offload, the offloaded optimizer) is the
    # row's host_bytes, not device memory; on the CPU everything is the device's.
    where = "device" if device.type != "cpu" else None
    host = _host_bytes(run, step) if where else None
    memory = MemoryFigures(
        peak_allocated=reading.peak_allocated, peak_reserved=reading.peak_reserved, process_peak_rss=rss,
        params=parameter_bytes(run.model, where),
        grads=gradient_bytes(run.model, where) if cell.mode == "train" else None,
        optimizer=optimizer_state_bytes(step.optimizer, where), host=host,
        activations=_activations(reading, cell.mode),
        param_count=count_parameters(run.model), alloc_retries=reading.alloc_retries, allocator=reading.allocator,
        kv_cache=step.cache_bytes(cell.batch_size) if step.generates else None)
    speed = SpeedFigures(
        step_time_ms_p50=timing.percentile_ms(0.5), step_time_ms_p90=timing.percentile_ms(0.9),
        step_time_ms_mean=timing.mean_ms, throughput_samples_s=timing.throughput(cell.batch_size),
        step_time_cv=timing.cv, noisy=timing.noisy(settings.noise_threshold), timed_steps=len(timing.step_s),
        warmup_s=warmup_s)
    comm, comm_note = _communication(run, lambda: step(batch))
    notes = list(run.notes) + comm_note + _artifacts(cell, lambda: step(batch), device, settings, timing, memory)
    return Outcome(
        status="ok", precision=run.precision, memory=memory, speed=speed, device_name=_device_name(device),
        driver_version=nvml_info()["driver_version"] if device.type == "cuda" else None,
        wall_time_s=time.perf_counter() - started, notes=notes, serving=serving,
        nvml=sampler.figures() if source is not None else None,
        # The cell's global batch, on every rank: a rank's energy per sample is then its GPU's share, and the
        # shares of the cell's GPUs add up (distributed.fold), whatever the split (data, tensor, pipeline).
        samples_timed=len(timing.step_s) * cell.batch_size, usd_per_kwh=settings.usd_per_kwh,
        comm_bytes_per_step=comm)


def _optimizer_state_started(optimizer) -> bool:
    """Whether the optimizer has taken a step (its state exists, where ZeRO-1 keeps it too); torchao's offload
    optimizer has no `state` at all (taken as started)."""
    return optimizer is None or bool(getattr(holding_state(optimizer), "state", True))


def _communication(run: Run, one_step) -> tuple[int | None, list[str]]:
    """Bytes this rank sends per step, counted over one more step after the timed ones (the counting
    dispatch mode slows every op): the row's figure, with the technique's ring formula beside it in a note.
    Where nothing can be counted (no process group, or a compiled step whose collectives run inside its
    graph, out of the mode's sight) the measured row has no figure: the formula is not a measurement."""
    import torch.distributed as dist

    formula = run.comm_bytes_per_step
    if formula is None:
        return None, []
    if not dist.is_available() or not dist.is_initialized():
        return None, [f"communication not counted (no process group); the techniques' ring formula gives {formula:,}"]
    if run.compiled:
        return None, [f"communication not counted (a compiled step's collectives run inside its graph); "
                      f"the techniques' ring formula gives {formula:,}"]
    sent, by_op = bytes_sent(one_step)
    split = ", ".join(f"{name} {value:,}" for name, value in sorted(by_op.items(), key=lambda item: -item[1]))
    return sent, [f"communication counted over one step: {sent:,} bytes sent by this rank ({split or 'none'}); "
                  f"the techniques' ring formula gives {formula:,}"
                  + (f" (counted / formula {sent / formula:.2f})" if formula else "")]


def _artifacts(cell: ResolvedCell, one_step, device: torch.device, settings: MeasureSettings, timing,
               memory: MemoryFigures) -> list[str]:
    """The files asked for beside the rows (after the timed steps, so they cost no timed time); notes
    saying where they are."""
    import torch.distributed as dist

    notes = []
    folder, cell_id = Path(settings.artifacts_dir or "."), cell.cell.cell_id
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank keeps its own files, named as its row is (harness/measure/distributed.py), not one file the
        # ranks overwrite in turn.
        cell_id = f"{cell_id}{RANK_ROW_SUFFIX}{dist.get_rank()}"
    figures = {"peak_allocated": memory.peak_allocated, "peak_reserved": memory.peak_reserved,
               "params": memory.params, "activations": memory.activations}
    wanted = [("memory timeline", settings.memory_timeline,
               lambda: artifacts.memory_timeline(one_step, device, folder, cell_id)),
              ("profiler trace", settings.profile, lambda: artifacts.profiler_trace(one_step, device, folder, cell_id)),
              ("TensorBoard scalars", settings.tensorboard_dir, lambda: [artifacts.tensorboard_scalars(
                  Path(settings.tensorboard_dir), cell_id, timing.step_s, figures)])]
    for name, asked, keep in wanted:
        if not asked:
            continue
        try:
            notes += keep()
        except Exception as exc:  # the cell's figures are measured already: a lost artifact must not lose them
            notes.append(f"{name} not kept: {type(exc).__name__}: {str(exc)[:200]}")
    return notes


def _timed(step: Step, batch, settings: MeasureSettings, device: torch.device):
    """The timed steps (a step is one generation for a served decoder, whose gen_len - 1 decode steps are
    timed one by one besides; `batch` a list: a variable-length loop's batches, taken in turn): (their
    Timing, the GenerationTiming or None)."""
    if step.generates:
        generation = time_generation(step, batch["input_ids"], settings.steps, settings.repeats, device)
        return generation.generations, generation
    if isinstance(batch, list):
        # A variable-length loop: each timed step takes the loop's next batch, and every repeat runs whole
        # loops from its start, so repeats compare like with like.
        loop = itertools.cycle(batch)
        steps = -(-settings.steps // len(batch)) * len(batch)
        return time_steps(lambda: step(next(loop)), steps, settings.repeats, device), None
    return time_steps(lambda: step(batch), settings.steps, settings.repeats, device), None


def _host_bytes(run: Run, step: Step) -> int | None:
    """Host memory holding the run's state while it trains on an accelerator; None when it holds none."""
    offloaded = host_state_bytes(step.optimizer) or 0
    resident = (parameter_bytes(run.model, "host") + gradient_bytes(run.model, "host")
                + (optimizer_state_bytes(step.optimizer, "host") or 0))
    return (offloaded + resident) or None


def _activations(reading, mode: str) -> int | None:
    live = reading.live_at
    if mode == "train" and "forward_start" in live and "forward_end" in live:
        # What one micro-batch's forward leaves alive for backward: saved tensors and the loss.
        return live["forward_end"][0] - live["forward_start"][0]
    if "forward" in reading.peak_in and "forward_start" in live:
        # Inference keeps nothing for backward: its activations are the forward's transient peak.
        return reading.peak_in["forward"] - live["forward_start"][0]
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"
