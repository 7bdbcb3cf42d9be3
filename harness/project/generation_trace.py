"""Trace a served decoder's generation on fake tensors: the KV cache, the prompt's prefill, and the first
and last decode steps.

Memory is the whole generation's: weights, the KV cache preallocated for prompt + generated tokens,
then the prefill's and the decode steps' transients, logged in order for the allocator model (as
trace.py does for a training step). Time needs three phases, not all gen_len - 1 decode steps: a
decode step's work is the same at every position except the cache it reads, which grows by one
token per step, so the steps in between are interpolated between the first and the last
(harness/project/serving.py).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.cell import ResolvedCell
from harness.project.op_costs import _OpCostMode
from harness.project.trace import (
    CUDA_ROUNDING,
    StepTrace,
    _FirstMatmuls,
    _RecordingMemTracker,
    as_target_runs,
)
from suites.step import Step
from suites.techniques import Run
from suites.workloads.base import count_parameters
from suites.workloads.moe import unread_expert_bytes


def trace_generation(cell: ResolvedCell, profile) -> StepTrace:
    """The trace of one generation of `cell` (an inference cell of a served decoder) as `profile` runs it."""
    workload, spec = cell.workload, cell.spec
    rounding = 1 if profile.vendor == "cpu" else CUDA_ROUNDING
    with FakeTensorMode(allow_non_fake_inputs=False):
        run = Run(workload=workload, size=spec, mode=cell.mode, profile=profile, model=workload.build(spec),
                  batch_size=cell.batch_size)
        cell.stack.apply(run)
        step = Step(run, torch.device("cpu"))
        prompt = workload.batch(spec, cell.batch_size, torch.Generator().manual_seed(0))["input_ids"]
        with as_target_runs(profile, run):
            tracker = _RecordingMemTracker(rounding)
            tracker.track_external(run.model, prompt)
            first_matmuls = _FirstMatmuls(tracker.events)
            costs = _OpCostMode()
            measured_from = len(tracker.events)
            with tracker:
                cache = step.new_cache(cell.batch_size)
            baseline = tracker.total  # weights, prompt and the empty cache
            tracker.peak, tracker.at_peak = tracker.total, tracker.by_category()
            tracker.phase_peaks, tracker.phase_at_peak = {}, {}
            last = spec.seq_len + spec.gen_len - 2  # the position the last decode step feeds
            with tracker, first_matmuls, costs:
                costs.phase = tracker.phase = "prefill"
                tokens = step.prefill(cache, prompt)
                tracker.reset_mod_stats()  # MemTracker keeps per-module stats for one call of each module
                costs.phase = tracker.phase = "decode_first"
                tokens = step.decode(cache, tokens, spec.seq_len)
            if last > spec.seq_len:
                # Costed only: its transients are the first decode step's (the cache is preallocated), so
                # its memory adds nothing to the log, and not tracking it saves a third of the trace's time.
                with costs:
                    costs.phase = "decode_last"
                    step.decode(cache, tokens, last)
            ops = dict(costs.ops)
            if last == spec.seq_len:  # one decode step: it is both the first and the last
                ops.update({shape.__class__(**{**shape.__dict__, "phase": "decode_last"}): count
                            for shape, count in costs.ops.items() if shape.phase == "decode_first"})
            kv_bytes = cache.nbytes
    return StepTrace(
        peak_bytes=tracker.peak, at_peak=tracker.at_peak, params_bytes=tracker.by_category().get("params", 0),
        grads_bytes=0, optimizer_bytes=0, activations_bytes=tracker.peak - baseline, events=tracker.events,
        ops=ops, baseline_bytes=baseline, precision=run.precision, tf32=run.tf32,
        compiled=run.compiled, allocator=run.allocator,
        notes=list(run.notes),
        phase_peaks=tracker.phase_peaks, phase_at_peak=tracker.phase_at_peak,
        first_matmul_at=tuple(first_matmuls.at.values())[:1], measured_from=measured_from,
        param_count=count_parameters(run.model),
        untraced=tuple(sorted({m.untraced_compute for m in run.model.modules() if hasattr(m, "untraced_compute")})),
        gen_len=spec.gen_len, kv_cache_bytes=kv_bytes, gathered_bytes=workload.serving.gathered_bytes(run.model)
        + unread_expert_bytes(run.model, run.batch_size))
