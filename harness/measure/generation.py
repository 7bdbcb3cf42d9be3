"""Timing a served decoder: time to first token (the prefill) and every decode step, per generation.

Each generation prefills the prompt into the step's KV cache (allocated once, as a server keeps it) and
decodes the other tokens from it; the
tokens stay on the device (greedy argmax feeds the next step), so on a GPU the loop runs as a server's
does, without a host synchronisation per token, and CUDA events time each phase. Decode steps are
timed one by one, so their p50 and p90 show how a step slows as the cache it reads grows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from harness.measure.timing import Timing
from suites.step import Step


@dataclass(frozen=True)
class GenerationTiming:
    """Seconds of every timed generation's prefill, of every decode step, and of each whole generation."""

    prefill_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    generation_s: tuple[float, ...]
    repeat_s: tuple[float, ...]  # each repeat's generations, summed
    per_repeat: int

    @property
    def generations(self) -> Timing:
        """The whole generations as step timings (a step is one generation)."""
        return Timing(self.generation_s, self.repeat_s, self.per_repeat)

    def decode_percentile_ms(self, q: float) -> float | None:
        return Timing(self.decode_s, self.decode_s, 1).percentile_ms(q) if self.decode_s else None

    @property
    def ttft_ms(self) -> float:
        """Time to first token: the median prefill (the first token comes from the prompt's logits)."""
        return 1e3 * statistics.median(self.prefill_s)

    @property
    def decode_mean_s(self) -> float | None:
        return statistics.fmean(self.decode_s) if self.decode_s else None


def time_generation(step: Step, prompt: torch.Tensor, generations: int, repeats: int,
                    device: torch.device) -> GenerationTiming:
    """Run `repeats` x `generations` timed generations of the prompt batch `prompt` [B, prompt_len]."""
    prefill_s: list[float] = []
    decode_s: list[float] = []
    generation_s: list[float] = []
    for _ in range(repeats):
        _generations(step, prompt, generations, device, prefill_s, decode_s, generation_s)
    repeat_s = tuple(sum(generation_s[i * generations:(i + 1) * generations]) for i in range(repeats))
    return GenerationTiming(tuple(prefill_s), tuple(decode_s), tuple(generation_s), repeat_s, generations)


def _generations(step: Step, prompt: torch.Tensor, generations: int, device: torch.device, prefill_s: list,
                 decode_s: list, generation_s: list) -> None:
    gen_len = step.run.size.gen_len
    cache = step.cache(prompt.shape[0])
    for _ in range(generations):
        clock = _Clock(device)
        tokens = step.prefill(cache, prompt)
        clock.tick()
        for i in range(gen_len - 1):
            tokens = step.decode(cache, tokens, prompt.shape[1] + i)
            clock.tick()
        laps = clock.laps()
        prefill_s.append(laps[0])
        decode_s.extend(laps[1:])
        generation_s.append(sum(laps))


class _Clock:
    """Lap times: CUDA events recorded on the stream (read after one synchronisation), or perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            self.marks = [torch.cuda.Event(enable_timing=True)]
            self.marks[0].record()
        else:
            self.marks = [time.perf_counter()]

    def tick(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def laps(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
