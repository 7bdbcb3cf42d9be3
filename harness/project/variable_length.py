"""Projection of a workload trained on variable lengths (the `fragmentation` workload): the peak is the
longest step's, the reserved peak is the loop's, and the step time is the loop's median step (as the
measured p50 over whole loops is).

The longest step is projected as any cell is (traced, depth-extrapolated, allocator model). The reserved
memory is not: what fragmentation costs comes from steps of other lengths freeing blocks that the next
step cannot reuse, so the loop's allocation log (full-depth traces at each drawn length, the state once,
each step's own allocations and frees in order) is replayed through the allocator model under each
setting (harness/fragmentation.py, which also runs the guide's own scenario).
"""

from __future__ import annotations

import statistics

from harness.cell import ResolvedCell
from harness.project.roofline import TimeEstimate, estimate
from suites.workloads.base import SizeSpec

MiB = 2**20


def project_loop(cell: ResolvedCell, loop: list[SizeSpec], project):
    """The Projection of `cell` over its loop of sizes (`project` projects one fixed-length cell)."""
    from harness.fragmentation import loop_events, loop_traces, replay_fragmentation
    from harness.project.allocator import SETTINGS

    longest = max(loop, key=lambda size: size.seq_len)
    projection = project(cell.with_spec(longest))
    memory = projection.memory
    traces, _ = loop_traces(cell)  # full depth, at the same seeded lengths as `loop`
    profile = cell.profile.per_device()
    room = memory.capacity - memory.overhead if memory.capacity is not None else None
    events = loop_events(traces)
    lengths = ", ".join(str(size.seq_len) for size in loop)
    notes = [f"variable-length loop: sequence lengths {lengths}, one per step; peak allocated from the longest "
             f"({longest.seq_len} tokens), step time the loop's median step"]
    if profile.vendor != "cpu":
        # The BLAS workspaces sit in segments of their own, beside the loop's blocks.
        results = {s: replay_fragmentation(events, s, room, "loop") for s in SETTINGS}
        memory.reserved = {s: r.peak_reserved_bytes + memory.workspaces for s, r in results.items()}
        chosen = results[memory.allocator]
        memory.fits = None if room is None else not chosen.oom and memory.chosen_reserved <= room
        notes.append(f"reserved peak from the loop's allocation log replayed through the {memory.allocator} "
                     f"allocator model: {chosen.waste:.0%} of it not allocated at that moment, "
                     f"{(chosen.most_held_free_bytes or 0) / MiB:,.0f} MiB held free at most"
                     + (f", {chosen.retries} cache-freeing retries" if chosen.retries else ""))
    estimates = [estimate(trace, profile, tf32_matmul=trace.tf32) for trace in traces]
    time = None
    if all(estimates):
        # The loop's median step, as the measured p50 over whole loops is; the parts are means.
        time = TimeEstimate(step_s=statistics.median(e.step_s for e in estimates),
                            **{name: statistics.fmean(getattr(e, name) for e in estimates)
                               for name in ("compute_s", "memory_s", "launch_s", "issue_s")},
                            notes=estimates[0].notes, fitted=estimates[0].fitted)
        notes[0] += f" (its mean {statistics.fmean(e.step_s for e in estimates) * 1e3:,.2f} ms)"
    memory.notes[:0] = notes
    projection.time = time
    return projection
