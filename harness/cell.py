"""Measure one cell in this process: build, transform, warm up, measure memory, time, and make its row.

`python -m harness.cell SPEC.json RESULT.json` is what the runner starts in a fresh process per
cell, so allocator settings apply before the device starts and an OOM or crash stays contained.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from harness.measure.memory import probe_for
from harness.measure.tensors import gradient_bytes, optimizer_state_bytes, parameter_bytes
from harness.measure.timing import time_steps
from harness.metrics import speed_and_cost
from harness.model_flops import analytic_flops_per_sample, model_flops_per_sample
from harness.plan import Cell
from harness.profiles import GpuProfile, load_profiles
from harness.provenance import git_sha, nvml_info
from harness.records import DEFAULT_NOISE_THRESHOLD, Record, atomic_write_text
from suites.step import Step
from suites.techniques import Run, Unsupported
from suites.workloads import get_workload
from suites.workloads.base import count_parameters

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


class RestartWithEnvironment(Exception):
    """The stack sets environment variables this process did not start with.

    Allocator settings are read before any technique runs: the backend (`cudaMallocAsync`) when the
    CUDA library loads with `import torch`, the rest when the device starts (c10/cuda's
    CUDAAllocatorConfig). So the cell's process starts again with them (`main`)."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(f"restart with {env}")
        self.env = env


# Set in a cell process that restarted with its stack's environment: a second restart would loop.
RESTARTED = "HEADROOM_CELL_RESTARTED"


def base_record(cell: Cell, run_id: str, source: str, status: str, reason: str = "", **values) -> Record:
    """A row with the cell's identity and provenance filled in."""
    workload = get_workload(cell.workload)
    spec = workload.sizes.get(cell.size)
    return Record(
        run_id=run_id, workload=cell.workload, size=cell.size, mode=cell.mode, technique=cell.technique,
        gpu=cell.gpu, source=source, status=status, reason=reason, cell_id=cell.cell_id,
        batch_size=cell.batch_size, image_size=spec.image_size if spec else None,
        accuracy_metric=workload.accuracy_metric or None, torch_version=torch.__version__,
        cuda_version=torch.version.cuda if torch.cuda.is_available() else None, git_sha=git_sha(),
        hostname=socket.gethostname(), created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        **{"seq_len": spec.seq_len if spec else None, **values})


def failure_status(exc: BaseException) -> str:
    """`oom` for out-of-memory errors on any device, `error` for everything else."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom"
    text = str(exc)
    # cuBLAS and cuDNN report their own allocation failures near the memory limit (CUBLAS_STATUS_ALLOC_FAILED,
    # CUDNN_STATUS_ALLOC_FAILED) as RuntimeErrors, not OutOfMemoryError.
    if "out of memory" in text.lower() or "can't allocate memory" in text or "_STATUS_ALLOC_FAILED" in text:
        return "oom"
    return "error"


def measure_cell(cell: Cell, profile: GpuProfile, run_id: str, settings: MeasureSettings) -> Record:
    """Run and measure one cell on the local device; exceptions propagate to the caller."""
    started = time.perf_counter()
    workload = get_workload(cell.workload)
    spec = workload.sizes[cell.size]
    stack = cell.stack
    device = torch.device("cuda" if profile.vendor != "cpu" else "cpu")
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)

    probe = probe_for(device)
    with probe:
        model = workload.build(spec)
        run = Run(workload=workload, size=spec, mode=cell.mode, profile=profile, model=model,
                  batch_size=cell.batch_size)
        try:
            stack.apply(run)
        except Unsupported as exc:
            return base_record(cell, run_id, "measured", "unsupported", str(exc), device_name=profile.name)
        unset = {name: value for name, value in run.env.items() if os.environ.get(name) != value}
        if unset:
            raise RestartWithEnvironment(unset)
        run.model = run.model.to(device)
        step = Step(run, device)
        batch = {k: v.to(device) for k, v in workload.batch(spec, cell.batch_size, generator).items()}
        for _ in range(settings.warmup):
            step(batch)
        # fp16 loss scaling starts at 2**16 and skips the optimizer step while gradients overflow; warm
        # up until a step was really taken, or the optimizer state (and its memory) would be missing.
        for _ in range(MAX_SCALER_WARMUP):
            if step.optimizer is None or step.optimizer.state:
                break
            step(batch)
        probe.begin_measured_step()
        loss = step(batch, mark=probe.mark)
        probe.end_measured_step()
    reading = probe.reading()
    if cell.mode == "train" and not torch.isfinite(loss).all():
        return base_record(cell, run_id, "measured", "error", f"non-finite loss {loss.item()}",
                           device_name=profile.name)

    timing = time_steps(lambda: step(batch), settings.steps, settings.repeats, device)

    live = reading.live_at
    if cell.mode == "train" and "forward_start" in live and "forward_end" in live:
        # What one micro-batch's forward leaves alive for backward: saved tensors and the loss.
        activations = live["forward_end"][0] - live["forward_start"][0]
    elif "forward" in reading.peak_in and "forward_start" in live:
        # Inference keeps nothing for backward: its activations are the forward's transient peak.
        activations = reading.peak_in["forward"] - live["forward_start"][0]
    else:
        activations = None

    throughput = timing.throughput(cell.batch_size)
    try:
        flops_per_sample = model_flops_per_sample(workload, spec, stack, cell.mode, profile)
    except Exception as exc:  # a finished measurement must not be lost to its MFU's numerator
        flops_per_sample = analytic_flops_per_sample(workload, spec, cell.mode)
        run.notes.append(f"model FLOPs of the model as built, not as transformed ({type(exc).__name__}: {exc})")
    derived = speed_and_cost(profile, run.precision, flops_per_sample, throughput, spec.seq_len,
                             convolutional=workload.kind == "vision")
    # ru_maxrss is in KiB on Linux: the process's peak resident memory, a check on everything above.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return base_record(
        cell, run_id, "measured", "ok", precision=run.precision, device_name=_device_name(device),
        peak_allocated_bytes=reading.peak_allocated, peak_reserved_bytes=reading.peak_reserved,
        process_peak_rss_bytes=rss, params_bytes=parameter_bytes(run.model),
        grads_bytes=gradient_bytes(run.model) if cell.mode == "train" else None,
        optimizer_bytes=optimizer_state_bytes(step.optimizer), activations_bytes=activations,
        param_count=count_parameters(run.model),
        step_time_ms_p50=timing.percentile_ms(0.5), step_time_ms_p90=timing.percentile_ms(0.9),
        step_time_cv=timing.cv, noisy=timing.cv > settings.noise_threshold if timing.cv is not None else None,
        timed_steps=len(timing.step_s), throughput_samples_s=throughput,
        flops_per_step=flops_per_sample * cell.batch_size, **derived,
        alloc_retries=reading.alloc_retries, allocator=reading.allocator,
        driver_version=nvml_info()["driver_version"] if device.type == "cuda" else None,
        wall_time_s=time.perf_counter() - started, notes="; ".join(run.notes))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"


def main(argv: list[str]) -> int:
    """Child-process entry: read the cell spec, measure, write the row; failures become rows too."""
    spec_path, result_path = argv
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    cell = Cell(**spec["cell"])
    try:
        profiles = load_profiles(spec.get("profiles_dir"))
        settings = MeasureSettings(**spec["settings"])
        record = measure_cell(cell, profiles[cell.gpu], spec["run_id"], settings)
    except RestartWithEnvironment as restart:
        if os.environ.get(RESTARTED):
            record = base_record(cell, spec["run_id"], "measured", "error",
                                 f"the stack's environment {restart.env} did not hold after a restart")
        else:
            # The same command line (`sys.orig_argv`: tests run other entry modules) in a fresh image.
            try:
                os.execve(sys.executable, sys.orig_argv, {**os.environ, **restart.env, RESTARTED: "1"})
            except OSError as exc:
                record = base_record(cell, spec["run_id"], "measured", "error",
                                     f"could not restart with the stack's environment: {exc}")
    except BaseException as exc:  # the row must say what happened, whatever it was
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0][:500]
        record = base_record(cell, spec["run_id"], "measured", failure_status(exc), detail)
    atomic_write_text(Path(result_path), json.dumps(record.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
