"""Step timing: warm-up, then repeated timed loops; statistics that do not overstate throughput.

Throughput is samples processed divided by the time spent processing them (the summed wall time of
the timed loops): the batch over the *mean* step time, never over the median. Both come from the same
timed steps. A cell is noisy when its repeats disagree (coefficient of variation of their means) or
when a few slow steps pull the mean away from the median, since throughput and p50 then tell
different stories (seen on a busy 2-core CPU: p50 1.02 ms, yet 215 samples/s at batch 4).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Per-step times (seconds) of every timed step, and each repeat's loop wall time."""

    step_s: tuple[float, ...]
    loop_s: tuple[float, ...]
    steps_per_repeat: int

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.step_s)
        # Linear interpolation between closest ranks (numpy's default method).
        position = (len(ordered) - 1) * q
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return 1e3 * (ordered[low] + (ordered[high] - ordered[low]) * (position - low))

    @property
    def mean_ms(self) -> float:
        """Mean step time over the timed loops (their wall time, so nothing between steps is lost)."""
        return 1e3 * sum(self.loop_s) / len(self.step_s)

    def throughput(self, samples_per_step: int) -> float:
        """Samples per second: the batch over the mean step time."""
        return samples_per_step / (self.mean_ms / 1e3)

    @property
    def skew(self) -> float:
        """How far the mean step time (what throughput reports) sits above the median: mean / p50 - 1."""
        return self.mean_ms / self.percentile_ms(0.5) - 1

    def noisy(self, threshold: float) -> bool:
        """Whether the timing is too spread to compare at `threshold`: the repeats' CV above it, or the mean
        more than twice `threshold` off the median (a step-time distribution's normal tail on a quiet
        machine keeps the mean within a few percent of the median)."""
        return (self.cv is not None and self.cv > threshold) or abs(self.skew) > 2 * threshold

    @property
    def cv(self) -> float | None:
        """Coefficient of variation of the repeats' mean step time (None with a single repeat)."""
        means = [loop / self.steps_per_repeat for loop in self.loop_s]
        if len(means) < 2:
            return None
        return statistics.stdev(means) / statistics.fmean(means)


def time_steps(step: Callable[[], object], steps: int, repeats: int, device: torch.device) -> Timing:
    """Run `repeats` loops of `steps` calls; per-step times from CUDA events on GPUs, perf_counter on CPUs."""
    if device.type == "cuda":
        return _time_cuda(step, steps, repeats)
    step_s: list[float] = []
    loop_s: list[float] = []
    clock = time.perf_counter
    for _ in range(repeats):
        loop_start = clock()
        for _ in range(steps):
            start = clock()
            step()
            step_s.append(clock() - start)
        loop_s.append(clock() - loop_start)
    return Timing(tuple(step_s), tuple(loop_s), steps)


def _time_cuda(step: Callable[[], object], steps: int, repeats: int) -> Timing:
    """CUDA work is asynchronous: time with events on the stream and synchronise once per loop."""
    step_s: list[float] = []
    loop_s: list[float] = []
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for i in range(steps):
            step()
            events[i + 1].record()
        torch.cuda.synchronize()
        times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]
        step_s.extend(times)
        loop_s.append(events[0].elapsed_time(events[-1]) / 1e3)
    return Timing(tuple(step_s), tuple(loop_s), steps)
