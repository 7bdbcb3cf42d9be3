"""Projected memory of a traced step: the BLAS workspaces a real process adds, peak reserved under each
allocator setting (the traced log replayed through the allocator model, allocator.py), the CUDA
context outside the allocator, and whether the step fits the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.project.allocator import SETTINGS, replay
from harness.project.trace import StepTrace

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
    allocator: str = "native"  # the setting the cell runs under (alloc-expandable, alloc-async)

    @property
    def chosen_reserved(self) -> int | None:
        """Peak reserved under the cell's own allocator setting."""
        return self.reserved.get(self.allocator)



def device_overhead(profile) -> int:
    """Bytes a process holds on the device outside PyTorch's allocator: the CUDA (or HIP) context."""
    return 0 if profile.vendor == "cpu" else CUDA_CONTEXT_BYTES



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


def project_memory(trace: StepTrace, logged: StepTrace, profile, mode: str,
                   extrapolated_from: tuple[int, ...] = ()) -> MemoryProjection:
    """Memory of the step `trace` on `profile` (one device). `logged` is the trace whose allocation log
    stands for it: itself, or for a depth-extrapolated trace the deepest one traced (depth.py)."""
    workspaces = _workspaces_for(logged, profile, mode)
    if logged is trace:
        reserved = _reserved(trace, workspaces)
    else:
        # Fragmentation (reserved - allocated) is neither affine in the depth (a small change in the
        # order of a shallow trace's frees would be multiplied by it) nor proportional to the peak:
        # traced at 2 to 24 layers (gpt2-124m/350m, bert-base/large) it stays within about 0.5 GiB of
        # the 3-layer figure, much of it from the fixed-size LM head's blocks. So the deeper trace's
        # fragmentation (with the BLAS workspaces in place in its log) is carried over in bytes. Against
        # full-depth replays of the same model on h100-sxm, training (2026-11-30): native reserved -5.9%
        # to +3.9% at working batches (gpt2-124m b4-b10 s1024, bert-base b32-b64, amp-bf16 and fp32;
        # carrying the ratio over instead: up to +14.9%), -8.3% to -6.9% at batch 1, s256; expandable
        # segments within 0.8% (the ratio: up to +17.8%).
        logged_reserved = _reserved(logged, workspaces)  # the workspaces in place: their segments, their holes
        reserved = {s: trace.peak_bytes + logged_reserved[s] - logged.peak_bytes for s in logged_reserved}
    if profile.vendor == "cpu":
        reserved = {"native": None}  # no caching allocator on the host: nothing to model
    notes = []
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
    if trace.weight_cast_bytes:
        notes.append(f"activations include {trace.weight_cast_bytes / MiB:,.1f} MiB of autocast's low-precision "
                     f"copies of the weights, kept for the backward (they do not grow with the batch)")
    memory = MemoryProjection(
        peak_allocated=trace.peak_bytes + sum(workspaces), reserved=reserved, params=trace.params_bytes,
        grads=trace.grads_bytes, optimizer=trace.optimizer_bytes, activations=trace.activations_bytes,
        temporaries=_temporaries_at_peak(trace), workspaces=sum(workspaces), overhead=device_overhead(profile),
        capacity=profile.capacity_bytes if profile.vendor != "cpu" else None,
        extrapolated_from=extrapolated_from, notes=notes, allocator=trace.allocator)
    memory.fits, memory.fits_by_freeing_cache = _judge_fit(memory, logged, workspaces,
                                                           trace.peak_bytes - logged.peak_bytes)
    if memory.fits_by_freeing_cache:
        notes.append(f"fits only because the allocator frees its cached blocks and retries when cudaMalloc "
                     f"fails: unconstrained, it would reserve {memory.reserved['native'] / MiB:,.0f} MiB")
    return memory


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
    if memory.chosen_reserved <= room:
        return True, False
    if memory.peak_allocated > room or memory.allocator != "native":
        # Expandable segments and cudaMallocAsync hold little beyond the live bytes: their modelled peak
        # over the room is an out-of-memory without a cache-freeing retry to model.
        return False, False
    replayed = replay(_with_workspaces(logged, workspaces), "native", capacity=room - extra_live)
    return not replayed.oom, not replayed.oom


def _temporaries_at_peak(trace: StepTrace) -> int:
    """Bytes live at the peak that outlive no step: MemTracker's temporaries, plus what the optimizer
    holds there beyond its state (the foreach AdamW step's temporary the size of all parameters, which
    MemTracker files under the optimizer)."""
    at_peak = trace.at_peak
    return at_peak.get("temporaries", 0) + max(0, at_peak.get("optimizer", 0) - trace.optimizer_bytes)

