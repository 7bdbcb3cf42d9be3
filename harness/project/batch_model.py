"""Memory at any batch from traces at two: for fixed shapes every allocation's size is affine in the
batch, so the allocation log of a batch between (or a little beyond) two traced ones is their logs'
interpolation, event by event, and the allocator model replays it as it would a trace. A search over
the batch then pays two traces instead of one per probe; its answer is still confirmed by real traces
(search.py). Where the two logs differ in structure (an op whose algorithm changes with the batch),
there is no model and the search traces every probe.
"""

from __future__ import annotations

import dataclasses
import math

from harness.cell import ResolvedCell
from harness.project.depth import traced_to_depth
from harness.project.memory import MemoryProjection, project_memory
from harness.project.trace import CUDA_ROUNDING, StepTrace


def interpolated(a: StepTrace, b: StepTrace, batch_a: int, batch_b: int, batch: int) -> StepTrace | None:
    """The trace at `batch` from traces at `batch_a` and `batch_b`, None where their logs differ in shape."""
    if len(a.events) != len(b.events) or a.first_matmul_at != b.first_matmul_at:
        return None
    if any(x[0] != y[0] for x, y in zip(a.events, b.events, strict=True)):
        return None
    share = (batch - batch_a) / (batch_b - batch_a)

    def lin(x: float, y: float) -> int:
        return max(0, round(x + (y - x) * share))

    def rounded(x: int, y: int) -> int:
        # Both ends are already rounded as the allocator rounds; so is the point between them.
        return math.ceil(lin(x, y) / CUDA_ROUNDING) * CUDA_ROUNDING

    events = [(kind, ident, rounded(x[2], size) if kind == "alloc" else 0)
              for x, (kind, ident, size) in zip(a.events, b.events, strict=True)]

    def table(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        return {key: lin(x.get(key, 0), y.get(key, 0)) for key in set(x) | set(y)}

    # The peak is the maximum of live bytes over the step, each instant's affine in the batch: their
    # maximum is not (the instant that peaks can change), so it is read off the interpolated log.
    peak = _peak(events, b.measured_from) if events and a.measured_from == b.measured_from else None
    return dataclasses.replace(
        b, events=events, peak_bytes=peak if peak is not None else lin(a.peak_bytes, b.peak_bytes),
        at_peak=table(a.at_peak, b.at_peak),
        params_bytes=lin(a.params_bytes, b.params_bytes), grads_bytes=lin(a.grads_bytes, b.grads_bytes),
        optimizer_bytes=lin(a.optimizer_bytes, b.optimizer_bytes),
        activations_bytes=lin(a.activations_bytes, b.activations_bytes),
        baseline_bytes=lin(a.baseline_bytes, b.baseline_bytes), reserved={},
        kv_cache_bytes=lin(a.kv_cache_bytes, b.kv_cache_bytes),
        phase_peaks=table(a.phase_peaks, b.phase_peaks),
        phase_at_peak={p: table(a.phase_at_peak.get(p, {}), b.phase_at_peak.get(p, {})) for p in b.phase_at_peak})


def _peak(events: list[tuple[str, int, int]], start: int) -> int:
    """The most bytes live at once from event `start` on (the running sum the trace's tracker keeps)."""
    live: dict[int, int] = {}
    total = peak = 0
    for index, (kind, ident, size) in enumerate(events):
        total -= live.pop(ident, 0)
        if kind == "alloc":
            live[ident] = size
            total += size
        if index >= start - 1:
            peak = max(peak, total)
    return peak


class BatchModel:
    """Projected memory of a cell at any batch, from its traces at `low` and `high`."""

    def __init__(self, cell: ResolvedCell, low: int, high: int):
        self.cell, self.low, self.high = cell, low, high
        self.profile = cell.profile.per_device()
        self.at_low = traced_to_depth(cell.with_batch(low), self.profile)
        self.at_high = traced_to_depth(cell.with_batch(high), self.profile, depths=self.at_low[2])

    def memory(self, batch: int) -> MemoryProjection | None:
        (trace_a, logged_a, depths), (trace_b, logged_b, _) = self.at_low, self.at_high
        trace = interpolated(trace_a, trace_b, self.low, self.high, batch)
        logged = trace if logged_b is trace_b else interpolated(logged_a, logged_b, self.low, self.high, batch)
        if trace is None or logged is None:
            return None
        return project_memory(trace, logged, self.profile, self.cell.mode, depths)
