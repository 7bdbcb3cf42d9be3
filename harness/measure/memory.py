"""Measured memory: live bytes at step phases and the step's peak, from the device's own accounting.

CPU: PyTorch's profiler records every allocation and free of the CPU allocator (`profile_memory`);
a running sum of those events gives the bytes live at any instant, from which the peak and the
live bytes at phase marks follow. CUDA: the caching allocator's own counters
(`max_memory_allocated`, `max_memory_reserved`, `memory_allocated` at marks). Neither path shares
code with the projection's fake-tensor trace, so projections can be checked against them.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from dataclasses import dataclass, field

import torch

_MARK_PREFIX = "headroom::mark::"


@dataclass
class MemoryReading:
    """What a probe saw over the measured step (bytes; None where the device cannot say)."""

    peak_allocated: int | None = None
    peak_reserved: int | None = None
    live_at: dict[str, list[int]] = field(default_factory=dict)  # mark name -> live bytes, in order
    peak_in: dict[str, int] = field(default_factory=dict)        # window name -> peak live bytes
    alloc_retries: int | None = None
    allocator: str | None = None  # the CUDA allocator setting the process ran under


def allocator_setting() -> str:
    """The CUDA allocator setting in force, read from the allocator itself, not the environment:
    its backend, and whether its segments are expandable (`memory_snapshot`'s `is_expandable`)."""
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        return "cudaMallocAsync"
    if any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot()):
        return "expandable_segments"
    return "native"


def with_missed_frees(events: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(time, bytes) deltas of the profiler's allocation events (time, signed bytes, address), with the frees
    it never recorded put back. The profiler records a free only on a thread it follows: a tensor whose last
    reference dies on gloo's worker thread (a collective's buffers) is freed unseen, and the running sum
    would keep it forever. Two live blocks cannot share an address, so an allocation at an address still
    live in the replay proves the earlier block was freed: it is taken off there."""
    live: dict[int, int] = {}
    deltas: list[tuple[int, int]] = []
    for time, size, address in events:
        if size > 0:
            missed = live.pop(address, 0)
            if missed:
                deltas.append((time, -missed))
            live[address] = size
        else:
            live.pop(address, None)
        deltas.append((time, size))
    return deltas


class CpuAllocationProbe:
    """Traces CPU allocations with the profiler while active; reads live/peak bytes afterwards.

    Enter it before the model is built, so the running sum counts everything the run allocates.
    """

    def __init__(self) -> None:
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._step_started = False

    def __enter__(self) -> CpuAllocationProbe:
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)

    def mark(self, name: str) -> None:
        """A zero-length profiler event whose timestamp locates a phase boundary."""
        with torch.profiler.record_function(_MARK_PREFIX + name):
            pass

    def begin_measured_step(self) -> None:
        self.mark("measured_step_start")

    def end_measured_step(self) -> None:
        self.mark("measured_step_end")

    def reading(self) -> MemoryReading:
        """Replay allocation events in time order; the peak is taken inside the measured step."""
        from torch._C._profiler import _EventType

        events: list[tuple[int, int, int]] = []
        marks: list[tuple[int, str]] = []
        stack = list(self._profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
            elif node.tag == _EventType.TorchOp and node.name.startswith(_MARK_PREFIX):
                marks.append((node.start_time_ns, node.name[len(_MARK_PREFIX):]))
            stack.extend(node.children)
        events.sort(key=lambda item: (item[0], item[1] > 0))  # at one timestamp, frees first
        marks.sort(key=lambda item: item[0])
        allocations = with_missed_frees(events)
        times = [t for t, _ in allocations]
        live = list(itertools.accumulate(delta for _, delta in allocations))

        def live_before(t: int) -> int:
            index = bisect.bisect_right(times, t)
            return live[index - 1] if index else 0

        def peak_between(t0: int, t1: int) -> int:
            lo, hi = bisect.bisect_right(times, t0), bisect.bisect_right(times, t1)
            return max([live_before(t0), *live[lo:hi]])

        reading = MemoryReading()
        for t, name in marks:
            reading.live_at.setdefault(name, []).append(live_before(t))
        bounds = dict((name, t) for t, name in marks if name.startswith("measured_step"))
        if "measured_step_start" in bounds and "measured_step_end" in bounds:
            reading.peak_allocated = peak_between(bounds["measured_step_start"], bounds["measured_step_end"])
        starts = [t for t, name in marks if name == "forward_start"]
        ends = [t for t, name in marks if name == "forward_end"]
        if starts and ends:
            # Windows of the measured step's first forward (its marks are the last ones recorded).
            step_start = bounds.get("measured_step_start", 0)
            pairs = [(s, e) for s, e in zip(starts, ends, strict=False) if s >= step_start]
            if pairs:
                reading.peak_in["forward"] = peak_between(*pairs[0])
        return reading


class CudaAllocatorProbe:
    """Reads the CUDA caching allocator's counters; peak statistics reset at the measured step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._live: dict[str, list[int]] = {}
        self._forward_peak: int | None = None

    def __enter__(self) -> CudaAllocatorProbe:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def mark(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        self._live.setdefault(name, []).append(torch.cuda.memory_allocated(self.device))
        if name == "forward_start" and self._forward_peak is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        if name == "forward_end" and self._forward_peak is None:
            self._forward_peak = torch.cuda.max_memory_allocated(self.device)

    def begin_measured_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self._live.clear()
        self._forward_peak = None
        self._reserved_before = torch.cuda.memory_reserved(self.device)

    def end_measured_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self._stats = torch.cuda.memory_stats(self.device)

    def reading(self) -> MemoryReading:
        # The forward window reset the peak counters, so the step's peak is the max of the forward
        # window's peak and the peak after it; reserved memory only grows between empty_cache calls.
        stats = self._stats
        peak = max(self._forward_peak or 0, stats.get("allocated_bytes.all.peak", 0))
        reading = MemoryReading(
            peak_allocated=peak,
            peak_reserved=max(stats.get("reserved_bytes.all.peak", 0), self._reserved_before),
            live_at=self._live, alloc_retries=stats.get("num_alloc_retries"), allocator=allocator_setting())
        if self._forward_peak is not None:
            reading.peak_in["forward"] = self._forward_peak
        return reading


def probe_for(device: torch.device):
    """The memory probe for a device type."""
    if device.type == "cuda":
        return CudaAllocatorProbe(device)
    if device.type == "cpu":
        return CpuAllocationProbe()
    return contextlib.nullcontext()
