"""Projection: memory, fit, step time and cost of a cell on any GPU profile, without that GPU.

Memory comes from a fake-tensor trace of one step (trace.py) replayed through a model of the CUDA
caching allocator (allocator.py), plus the CUDA context and library workspaces; time from a
roofline over the traced ops (roofline.py). Deep uniform models are traced at two small depths and
extrapolated (memory, FLOPs and bytes are affine in the number of identical layers), so GPT-3 175B
projects in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from harness.metrics import speed_and_cost
from harness.model_flops import model_flops_per_sample
from harness.project.allocator import SETTINGS, replay
from harness.project.roofline import TimeEstimate, estimate
from harness.project.trace import OpCost, StepTrace, trace_step, with_depth
from harness.records import Record
from suites.techniques import Run, Stack, Unsupported
from suites.techniques.accumulation import DEFAULT_MICRO_BATCHES
from suites.workloads import get_workload
from suites.workloads.base import SizeSpec, Workload

# Models deeper than this are traced at TRACE_DEPTHS layers and extrapolated.
EXTRAPOLATE_ABOVE = 4
TRACE_DEPTHS = (2, 3)
# Outside the allocator: the CUDA context (driver dependent; "hundreds of MiB", calibration.md) [M].
CUDA_CONTEXT_BYTES = 512 * 2**20
KiB, MiB = 2**10, 2**20
# Inside the allocator: a cuBLAS handle gets its workspace from PyTorch's caching allocator on its first
# matmul and keeps it for the life of the process, so it counts in max_memory_allocated
# (aten/src/ATen/cuda/CublasHandlePool.cpp). Handles are per thread: training also runs matmuls on
# autograd's device thread, which holds its own. Sizes: CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
# (8 MiB + 128 KiB), 32 MiB on sm90, and on sm100/sm120 too since pytorch/pytorch#175344 (2026-02-19,
# taken as torch 2.11). cuBLASLt: a separate persistent 1 MiB from torch 2.8 until it began sharing
# the cuBLAS workspace in 2.11 (before 2.8 it was allocated per call and freed). ROCm: hipBLAS 32 MiB
# (128 MiB on gfx94x/gfx95x) and hipBLASLt 76 MiB.
CUBLAS_WORKSPACE_BYTES = 2 * 4096 * KiB + 8 * 16 * KiB
CUBLAS_WORKSPACE_LARGE_BYTES = 32 * MiB
CUBLASLT_WORKSPACE_BYTES = 1 * MiB
HIPBLAS_WORKSPACE_BYTES = {True: 128 * MiB, False: 32 * MiB}  # keyed by gfx94x/gfx95x
HIPBLASLT_WORKSPACE_BYTES = 76 * MiB


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def library_workspaces(profile, mode: str, torch_version: str = torch.__version__) -> tuple[int, ...]:
    """Bytes of the BLAS workspaces PyTorch `torch_version` holds in its caching allocator on `profile`:
    one set for the thread running the forward and, in training, one for autograd's device thread."""
    release = _release(torch_version)
    if profile.vendor == "nvidia":
        cc = profile.cc_tuple or (0, 0)
        large = cc[0] == 9 or (release >= (2, 11) and cc[0] in (10, 12))
        per_thread = [CUBLAS_WORKSPACE_LARGE_BYTES if large else CUBLAS_WORKSPACE_BYTES]
        if (2, 8) <= release < (2, 11):
            per_thread.append(CUBLASLT_WORKSPACE_BYTES)
    elif profile.vendor == "amd":
        gfx94_95 = (profile.gfx_target or "").startswith(("gfx94", "gfx95"))
        per_thread = [HIPBLAS_WORKSPACE_BYTES[gfx94_95], HIPBLASLT_WORKSPACE_BYTES]
    else:
        return ()
    return tuple(per_thread * (2 if mode == "train" else 1))


@dataclass
class MemoryProjection:
    """Projected memory of one cell on one profile (bytes)."""

    peak_allocated: int
    reserved: dict[str, int]  # allocator setting -> peak reserved
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    workspaces: int  # BLAS workspaces, inside the allocator (included in peak_allocated and reserved)
    overhead: int  # outside the allocator: the CUDA context
    capacity: int | None
    extrapolated_from: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    # Whether the step runs in `capacity` under the native allocator, judged by `_judge_fit` (None on
    # the host CPU), and whether only the allocator's retry after freeing its cache makes it fit.
    fits: bool | None = None
    fits_by_freeing_cache: bool = False


@dataclass
class Projection:
    memory: MemoryProjection
    time: TimeEstimate | None
    trace: StepTrace


def device_overhead(profile) -> int:
    """Bytes a process holds on the device outside PyTorch's allocator: the CUDA (or HIP) context."""
    return 0 if profile.vendor == "cpu" else CUDA_CONTEXT_BYTES


def _trace_key(profile) -> tuple:
    """Profiles that trace identically share one trace: the rounding and attention path differ only
    between the host CPU and GPUs."""
    return ("cpu",) if profile.vendor == "cpu" else ("gpu",)


_TRACES: dict[tuple, StepTrace] = {}


def traced(workload: Workload, spec: SizeSpec, stack: Stack, mode: str, batch_size: int, profile) -> StepTrace:
    """The step trace of a cell, computed once per process for all profiles that trace alike."""
    key = (workload.name, spec.name, tuple(sorted(spec.config.items())), stack.name, mode, batch_size,
           _trace_key(profile))
    if key not in _TRACES:
        def run_factory() -> Run:
            return Run(workload=workload, size=spec, mode=mode, profile=profile, model=workload.build(spec),
                       batch_size=batch_size)

        def batch_factory():
            return workload.batch(spec, batch_size, torch.Generator().manual_seed(0))

        _TRACES[key] = trace_step(run_factory, stack, profile, batch_factory)
    return _TRACES[key]


def _reserved(trace: StepTrace, workspaces: tuple[int, ...] = ()) -> dict[str, int]:
    """Peak reserved bytes under each allocator setting, with the workspaces where a real process
    allocates them; computed once per trace and set of workspaces."""
    if workspaces not in trace.reserved:
        trace.reserved[workspaces] = _replayed(_with_workspaces(trace, workspaces))
    return trace.reserved[workspaces]


def _replayed(events) -> dict[str, int]:
    return {setting: replay(events, setting).peak_reserved for setting in SETTINGS}


def _allocs_of(workspaces: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """Allocation events for the workspaces (negative ids: they never clash with the trace's)."""
    return [("alloc", -1 - i, size) for i, size in enumerate(workspaces)]


def _with_workspaces(trace: StepTrace, workspaces: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """The trace's log with each thread's share of `workspaces` (library_workspaces: the forward
    thread's set, then autograd's) allocated right after that thread's first matmul, as a cuBLAS
    handle takes them; at the start of the log where the trace saw no matmul."""
    events = list(trace.events)
    positions = trace.first_matmul_at
    if not positions or len(workspaces) % len(positions):
        positions = (0,)
    allocs = _allocs_of(workspaces)
    share = len(allocs) // len(positions)
    for thread in reversed(range(len(positions))):  # from the back: earlier positions stay valid
        at = positions[thread]
        events[at:at] = allocs[thread * share:(thread + 1) * share]
    return events


def _workspaces_for(trace: StepTrace, profile, mode: str) -> tuple[int, ...]:
    uses_blas = any(kind == "matmul" for _, kind, _ in trace.costs)
    return library_workspaces(profile, mode) if uses_blas else ()


def _extrapolate(a: float, b: float, depth_a: int, depth_b: int, depth: int) -> float:
    return a + (b - a) * (depth - depth_a) / (depth_b - depth_a)


def project(workload: Workload, spec: SizeSpec, stack: Stack, mode: str, batch_size: int, profile) -> Projection:
    """Memory and time of one cell on `profile` (raises Unsupported like a measured run would)."""
    profile = profile.per_device()  # a process runs on one device of a multi-device package
    depth = spec.config.get("n_layer")
    if depth is None or depth <= EXTRAPOLATE_ABOVE:
        trace = traced(workload, spec, stack, mode, batch_size, profile)
        workspaces = _workspaces_for(trace, profile, mode)
        reserved = _reserved(trace, workspaces)
        extrapolated: tuple[int, ...] = ()
    else:
        low, high = extrapolated = TRACE_DEPTHS
        trace_a = traced(workload, with_depth(spec, low), stack, mode, batch_size, profile)
        trace_b = traced(workload, with_depth(spec, high), stack, mode, batch_size, profile)
        trace = _extrapolated_trace(trace_a, trace_b, low, high, depth)
        # Fragmentation (reserved - allocated) is neither affine in the depth (a small change in the
        # order of a shallow trace's frees would be multiplied by it) nor proportional to the peak:
        # traced at 2 to 24 layers (gpt2-124m/350m, bert-base/large) it stays within about 0.5 GiB of
        # the 3-layer figure, much of it from the fixed-size LM head's blocks. So the deeper trace's
        # fragmentation (with the BLAS workspaces in place in its log) is carried over in bytes. Against
        # full-depth replays of the same model on h100-sxm, training (2026-11-30): native reserved -5.9%
        # to +3.9% at working batches (gpt2-124m b4-b10 s1024, bert-base b32-b64, amp-bf16 and fp32;
        # carrying the ratio over instead: up to +14.9%), -8.3% to -6.9% at batch 1, s256; expandable
        # segments within 0.8% (the ratio: up to +17.8%).
        workspaces = _workspaces_for(trace_b, profile, mode)
        reserved_b = _reserved(trace_b, workspaces)  # the workspaces in place: their segments, their holes
        reserved = {s: trace.peak_bytes + reserved_b[s] - trace_b.peak_bytes for s in reserved_b}
    if profile.vendor == "cpu":
        reserved = {"native": None}  # no caching allocator on the host: nothing to model
    notes = list(trace.notes)
    if profile.vendor == "cpu" and mode == "infer":
        # Seen in the profiler's allocation events of measured twins: aten::mkldnn_convolution weight
        # reorders, aten::addmm/mm conversion buffers for fp16 (no native fp16 matmul on most CPUs).
        notes.append("the host CPU's kernel scratch (oneDNN reorders and conversion buffers) is not traced: "
                     "inference peaks read low, most for fp16")
    if profile.vendor != "cpu" and profile.visible_memory_bytes is None:
        notes.append("fit judged against the datasheet memory size: no driver-reported figure in the profile, "
                     "and ECC/driver reservations take 0.5-6% of it")
    if workspaces:
        notes.append(f"includes {sum(workspaces) / MiB:.1f} MiB of BLAS workspaces in the allocator")
    memory = MemoryProjection(
        peak_allocated=trace.peak_bytes + sum(workspaces), reserved=reserved, params=trace.params_bytes,
        grads=trace.grads_bytes,
        optimizer=trace.optimizer_bytes, activations=trace.activations_bytes,
        temporaries=_temporaries_at_peak(trace), workspaces=sum(workspaces),
        overhead=device_overhead(profile), capacity=profile.capacity_bytes if profile.vendor != "cpu" else None,
        extrapolated_from=extrapolated, notes=notes)
    logged = trace_b if extrapolated else trace  # the trace whose allocation log stands for this one
    memory.fits, memory.fits_by_freeing_cache = _judge_fit(memory, logged, workspaces,
                                                           trace.peak_bytes - logged.peak_bytes)
    if memory.fits_by_freeing_cache:
        notes.append(f"fits only because the allocator frees its cached blocks and retries when cudaMalloc "
                     f"fails: unconstrained, it would reserve {memory.reserved['native'] / MiB:,.0f} MiB")
    if trace.untraced:
        notes.append(f"no step time: the trace cannot see {', '.join(trace.untraced)}")
    return Projection(memory, None if trace.untraced else estimate(trace, profile), trace)


def _judge_fit(memory: MemoryProjection, logged: StepTrace, workspaces: tuple[int, ...],
               extra_live: int) -> tuple[bool | None, bool]:
    """(fits, only by freeing the cache). A step whose unconstrained reserved peak fits the device's
    room (capacity less the CUDA context) fits; one whose live bytes alone exceed it does not. In
    between, the caching allocator, when cudaMalloc fails, frees its cached unused segments and retries
    (c10 CUDACachingAllocator, release_cached_blocks), so the log is replayed against the room itself.
    An extrapolated trace replays its deepest traced log against the room less the live bytes the
    extra layers add (`extra_live`): its fragmentation is carried over in bytes, as for reserved."""
    if memory.capacity is None:
        return None, False
    room = memory.capacity - memory.overhead
    if memory.reserved["native"] <= room:
        return True, False
    if memory.peak_allocated > room:
        return False, False
    replayed = replay(_with_workspaces(logged, workspaces), "native", capacity=room - extra_live)
    return not replayed.oom, not replayed.oom


def _temporaries_at_peak(trace: StepTrace) -> int:
    """Bytes live at the peak that outlive no step: MemTracker's temporaries, plus what the optimizer
    holds there beyond its state (the foreach AdamW step's temporary the size of all parameters, which
    MemTracker files under the optimizer)."""
    at_peak = trace.at_peak
    return at_peak.get("temporaries", 0) + max(0, at_peak.get("optimizer", 0) - trace.optimizer_bytes)


def _extrapolated_trace(a: StepTrace, b: StepTrace, low: int, high: int, depth: int) -> StepTrace:
    """A trace at `depth` layers from traces at `low` and `high`: every total is affine in the depth."""

    def lin(x: float, y: float) -> float:
        return _extrapolate(x, y, low, high, depth)

    def cost(key) -> OpCost:
        x, y = a.costs.get(key, OpCost()), b.costs[key]
        return OpCost(count=round(lin(x.count, y.count)), flops=lin(x.flops, y.flops), bytes=lin(x.bytes, y.bytes))

    # Each phase's peak is affine in the depth, the step's peak (their maximum) is not: the phase that
    # peaks can change between the traced depths and the real one (the optimizer step's share grows).
    phases = [p for p in b.phase_peaks if p in a.phase_peaks] or [None]
    peaks = {p: lin(a.phase_peaks[p], b.phase_peaks[p]) if p else lin(a.peak_bytes, b.peak_bytes) for p in phases}
    top = max(phases, key=lambda p: peaks[p])
    at_a, at_b = (a.phase_at_peak[top], b.phase_at_peak[top]) if top else (a.at_peak, b.at_peak)
    return StepTrace(
        peak_bytes=round(peaks[top]),
        at_peak={k: round(lin(at_a.get(k, 0), at_b.get(k, 0))) for k in set(at_a) | set(at_b)},
        params_bytes=round(lin(a.params_bytes, b.params_bytes)), grads_bytes=round(lin(a.grads_bytes, b.grads_bytes)),
        optimizer_bytes=round(lin(a.optimizer_bytes, b.optimizer_bytes)),
        activations_bytes=round(lin(a.activations_bytes, b.activations_bytes)), events=[],
        costs={key: cost(key) for key in b.costs}, precision=b.precision,
        notes=b.notes + [f"extrapolated from traces at {low} and {high} layers to {depth}"],
        untraced=b.untraced,
        param_count=round(lin(a.param_count, b.param_count)),
        phase_peaks={p: round(v) for p, v in peaks.items() if p})


def fits_at(workload, spec, stack, mode, batch_size, profile) -> bool:
    return bool(project(workload, spec, stack, mode, batch_size, profile).memory.fits)


# --max-batch searches up to this batch (an inference cell of a small model can fit far more).
MAX_BATCH_LIMIT = 1 << 16


def max_batch(workload: Workload, spec: SizeSpec, stack: Stack, mode: str, profile, step: int = 1,
              limit: int = MAX_BATCH_LIMIT, smallest: int | None = None) -> int:
    """The largest batch (a multiple of `step`, at least `smallest`) whose projected memory fits
    `profile`, 0 if none.

    Memory is affine in the batch for fixed shapes: two projections give the slope, the solution is
    checked by a projection at the answer and walked down (binary search) if the allocator's
    rounding makes it miss.
    """
    profile = profile.per_device()
    if profile.vendor == "cpu" or profile.capacity_bytes is None:
        raise ValueError(f"profile {profile.id} has no memory size to fit in: cannot solve for the largest batch")
    start = max(step, smallest or step)
    first = project(workload, spec, stack, mode, start, profile).memory
    if not first.fits:
        return 0
    second = project(workload, spec, stack, mode, start + step, profile).memory
    slope = (second.reserved["native"] - first.reserved["native"]) / step
    budget = profile.capacity_bytes - first.overhead - first.reserved["native"]
    guess = limit if slope <= 0 else min(limit, start + int(budget / slope) // step * step)
    guess = max(start, guess - guess % step)

    def fits(batch: int) -> bool:
        return fits_at(workload, spec, stack, mode, batch, profile)

    # Bracket the answer around the affine guess (low fits, high does not), then bisect.
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


def batch_step(stack: Stack) -> int:
    """The batch must be a multiple of this: accumulation splits it into equal micro-batches."""
    return DEFAULT_MICRO_BATCHES if any(t.id == "grad-accumulation" for t in stack.techniques) else 1


def smallest_batch(stack: Stack, workload: Workload, mode: str) -> int:
    """The smallest batch the cell can take: one sample per micro-batch, two where BatchNorm trains
    (it needs more than one value per channel, and a conv net's last feature map may be 1 x 1)."""
    return batch_step(stack) * (2 if workload.kind == "vision" and mode == "train" else 1)


@dataclass(frozen=True)
class LargestModel:
    """The answer of `largest_model`: a size id or None, the batch it was judged at, and why none."""

    size: str | None
    batch_size: int
    reason: str = ""


def largest_model(profile, stack: Stack, mode: str = "train", workload_name: str = "gpt") -> LargestModel:
    """The largest size of `workload_name` that fits `profile` at its smallest batch under `stack`."""
    workload = get_workload(workload_name)
    batch = smallest_batch(stack, workload, mode)
    unsupported = stack.check(profile, workload, mode)
    if unsupported:
        return LargestModel(None, batch, f"unsupported: {unsupported}")
    best = None
    for spec in sorted(workload.sizes.values(), key=lambda s: _param_estimate(workload, s)):
        try:
            fits = fits_at(workload, dataclasses.replace(spec, batch_size=batch), stack, mode, batch, profile)
        except Unsupported as exc:
            return LargestModel(best, batch, f"{spec.name} unsupported: {exc}")
        if not fits:
            return LargestModel(best, batch, "" if best else f"even {spec.name} does not fit")
        best = spec.name
    return LargestModel(best, batch)


def _param_estimate(workload: Workload, spec: SizeSpec) -> int:
    from suites.workloads.base import count_parameters

    with torch.device("meta"):
        return count_parameters(workload.build(spec))


def projected_fields(projection: Projection, workload: Workload, spec: SizeSpec, stack: Stack, mode: str,
                     batch_size: int, profile, precision: str) -> dict:
    """The Record fields a projection fills (status is decided by the caller)."""
    memory, time = projection.memory, projection.time
    flops_per_sample = model_flops_per_sample(workload, spec, stack, mode, profile)
    throughput = batch_size / time.step_s if time else None
    return dict(
        precision=precision, peak_allocated_bytes=memory.peak_allocated,
        peak_reserved_bytes=memory.reserved.get("native"),
        peak_reserved_expandable_bytes=memory.reserved.get("expandable_segments"),
        peak_reserved_async_bytes=memory.reserved.get("cudaMallocAsync"),
        device_overhead_bytes=memory.overhead, library_workspace_bytes=memory.workspaces, fits=memory.fits,
        params_bytes=memory.params, param_count=projection.trace.param_count,
        grads_bytes=memory.grads if mode == "train" else None,
        optimizer_bytes=memory.optimizer if mode == "train" else None,
        activations_bytes=memory.activations, temporaries_bytes=memory.temporaries,
        step_time_ms_p50=time.step_s * 1e3 if time else None, throughput_samples_s=throughput,
        flops_per_step=flops_per_sample * batch_size,
        **speed_and_cost(profile, precision, flops_per_sample, throughput, spec.seq_len,
                         convolutional=workload.kind == "vision"),
        device_name=profile.name, notes="; ".join(memory.notes))


SPEED_FIELDS = ("step_time_ms_p50", "throughput_samples_s", "tokens_per_s", "mfu", "usd_per_million_samples",
                "usd_per_million_tokens")


def project_cell(cell, profile, run_id: str, spec: SizeSpec | None = None) -> Record:
    """The projected row of `cell` on `profile`: ok, oom (does not fit, with the numbers), unsupported
    or error; never raises for a problem of the cell itself."""
    from harness.cell import base_record

    workload = get_workload(cell.workload)
    spec = spec or workload.sizes[cell.size]
    stack = cell.stack
    reason = stack.check(profile, workload, cell.mode)
    if reason:
        return base_record(cell, run_id, "projected", "unsupported", reason, device_name=profile.name)
    try:
        projection = project(workload, spec, stack, cell.mode, cell.batch_size, profile)
        fields = projected_fields(projection, workload, spec, stack, cell.mode, cell.batch_size, profile,
                                  projection.trace.precision)
    except Unsupported as exc:
        return base_record(cell, run_id, "projected", "unsupported", str(exc), device_name=profile.name)
    except Exception as exc:  # a projection bug must become a row, not end the run
        return base_record(cell, run_id, "projected", "error", f"projection failed: {type(exc).__name__}: {exc}",
                           device_name=profile.name)
    memory = projection.memory
    status, reason = "ok", ""
    if memory.fits is False:
        status = "oom"
        context = f"{memory.overhead / MiB:,.0f} MiB CUDA context > {memory.capacity / MiB:,.0f} MiB on {profile.id}"
        if memory.peak_allocated + memory.overhead > memory.capacity:
            reason = f"needs {memory.peak_allocated / MiB:,.0f} MiB allocated at its peak + {context}"
        else:  # the live bytes would fit, but not in the segments the allocator can keep
            reason = (f"needs {memory.reserved['native'] / MiB:,.0f} MiB reserved + {context}, and freeing the "
                      f"cached blocks on a failed cudaMalloc does not make room for its "
                      f"{memory.peak_allocated / MiB:,.0f} MiB allocated")
        # A cell that cannot run has no speed or cost, as a measured oom row has none.
        fields.update(dict.fromkeys(SPEED_FIELDS))
    return base_record(cell, run_id, "projected", status, reason, seq_len=spec.seq_len, **fields)
