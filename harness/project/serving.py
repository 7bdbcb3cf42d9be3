"""A served decoder's generation time from its trace's phases: time to first token is the prefill's
projected time; the decode steps' times are interpolated between the first and the last, since a step
differs from the next only by one more cached token to read (generation_trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.project.roofline import TimeEstimate, estimate
from harness.project.trace import StepTrace


@dataclass(frozen=True)
class GenerationTime:
    """Projected seconds: the prefill (time to first token), the first and last decode steps, and the
    whole generation (prefill + gen_len - 1 decode steps); `fitted` as TimeEstimate.fitted."""

    prefill_s: float
    decode_first_s: float
    decode_last_s: float
    gen_len: int
    notes: tuple[str, ...]
    fitted: bool

    def decode_s(self, quantile: float) -> float:
        """The decode step time at this quantile of the steps (times grow linearly with the position)."""
        return self.decode_first_s + quantile * (self.decode_last_s - self.decode_first_s)

    @property
    def decode_mean_s(self) -> float:
        return self.decode_s(0.5)

    @property
    def step_s(self) -> float:
        return self.prefill_s + (self.gen_len - 1) * self.decode_mean_s

    def as_step(self) -> TimeEstimate:
        """The whole generation as a step estimate (the parts kept are the prefill's)."""
        return TimeEstimate(step_s=self.step_s, compute_s=0.0, memory_s=0.0, launch_s=0.0, issue_s=0.0,
                            notes=self.notes, fitted=self.fitted)


def generation_time(trace: StepTrace, profile) -> GenerationTime | None:
    """The generation's projected times on `profile`; None where a peak or the bandwidth is unknown."""
    parts = [estimate(trace, profile, tf32_matmul=trace.tf32, phases=(phase,))
             for phase in ("prefill", "decode_first", "decode_last")]
    if any(part is None for part in parts):
        return None
    prefill, first, last = parts
    return GenerationTime(prefill.step_s, first.step_s, last.step_s, trace.gen_len,
                          notes=prefill.notes + _host_bound(last), fitted=prefill.fitted)


def _host_bound(decode: TimeEstimate) -> tuple[str, ...]:
    """A note where eager PyTorch's per-op host cost, not the weights' and cache's read, sets a decode step's time
    (the GPU waits on the host for most of it): what a faster GPU cannot buy, and what a CUDA graph removes."""
    busy = decode.step_s - decode.overhead_s
    if decode.overhead_s <= 0.5 * decode.step_s:
        return ()
    return (f"a decode step is host-bound: the host issues its ops in {decode.issue_s * 1e3:.1f} ms against "
            f"{busy * 1e3:.1f} ms of GPU work (eager PyTorch), so a faster GPU barely shortens it; +compile "
            "replays the step as a CUDA graph, one launch",)
