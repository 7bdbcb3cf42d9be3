"""Step timing: warm-up, then repeated timed loops; statistics that do not overstate throughput.

Throughput is samples processed divided by the time spent processing them (the summed wall time of
the timed loops), never samples divided by a mean or median step time. The coefficient of variation
across repeats says how noisy the machine was.
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

    def throughput(self, samples_per_step: int) -> float:
        return samples_per_step * len(self.step_s) / sum(self.loop_s)

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
