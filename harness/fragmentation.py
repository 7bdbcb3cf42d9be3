"""The fragmentation probe (guide T18, claim C4: "fragmentation wastes 30-50% of GPU memory"): how much
the CUDA caching allocator reserves beyond what is allocated, under each allocator setting, in two
scenarios:

- the guide's own: several 1 GiB tensors, every other one freed, then a 2 GiB request that no freed
  1 GiB block can hold;
- variable-length training: a decoder trained on sequences whose length is drawn per step, as
  fine-tuning data is, so every step's activations have other sizes than the last one's.

Projected (any machine): allocation logs replayed through the allocator model
(harness/project/allocator.py) on a device of the profile's capacity; the variable-length log is built
from fake-tensor traces of the steps, one per length: the model's state (weights, gradients, optimizer
state) allocated once, then each step's own allocations and frees in order (the gradients' churn between
steps is left out; they are the same size every step). Measured (CUDA, `measure_guide_scenario`): the
guide's scenario on the device itself, in a process started with the setting in its environment.
Figures: peak reserved and allocated, the share of reserved memory not allocated at the reserved peak,
the largest free block the cache holds at the end, and the cache-freeing retries a request needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from harness.project.allocator import SETTINGS, ExpandableSegmentsAllocator, NativeAllocator
from suites.workloads.fragmentation import LOOP_SEED, LOOP_STEPS, step_lengths

GiB = 2**30
GUIDE_TENSORS = 6   # 1 GiB each
GUIDE_REQUEST = 2 * GiB


@dataclass(frozen=True)
class FragmentationResult:
    """One scenario under one allocator setting."""

    scenario: str
    allocator: str
    source: str  # "projected" (allocator model) or "measured"
    peak_reserved_bytes: int
    allocated_at_reserved_peak_bytes: int
    largest_free_block_bytes: int | None  # cached and free at the end (None: the model cannot say)
    retries: int | None  # requests that needed cached memory freed first
    oom: bool = False
    most_held_free_bytes: int | None = None  # the most reserved - allocated at any moment

    @property
    def waste(self) -> float:
        """Share of the reserved peak not allocated at that moment (reserved - allocated over reserved)."""
        return 1 - self.allocated_at_reserved_peak_bytes / self.peak_reserved_bytes if self.peak_reserved_bytes else 0.0


def guide_events(tensors: int = GUIDE_TENSORS, request: int = GUIDE_REQUEST) -> list[tuple[str, int, int]]:
    """`tensors` 1 GiB allocations, every other one freed, then `request` bytes."""
    events = [("alloc", key, GiB) for key in range(tensors)]
    events += [("free", key, 0) for key in range(0, tensors, 2)]
    return events + [("alloc", tensors, request)]


def _counting(allocator) -> list[int]:
    """Count the allocator's cache-freeing retries (its release before reporting an OOM)."""
    calls = [0]
    name = "_release_free_segments" if isinstance(allocator, NativeAllocator) else "_release_free_pages"
    release = getattr(allocator, name)

    def counted() -> None:
        calls[0] += 1
        release()

    setattr(allocator, name, counted)
    return calls


def _largest_free(allocator) -> int:
    if isinstance(allocator, NativeAllocator):
        return max((size for size, _, _ in allocator.free_blocks[False] + allocator.free_blocks[True]), default=0)
    return max((size for pool in allocator.pools.values() for size, _ in pool.free), default=0)


def replay_fragmentation(events, setting: str, capacity: int | None, scenario: str) -> FragmentationResult:
    """The log under the allocator model of `setting` on a device with `capacity` bytes for the allocator."""
    if setting == "cudaMallocAsync":
        # The driver's pool: the model knows only its floor (the live bytes), so no fragmentation to show. Like
        # the other settings it stops at the first request past the capacity: what it holds then is the peak.
        live, sizes, peak = 0, {}, 0
        for kind, key, size in events:
            if kind == "alloc" and capacity is not None and live + size > capacity:
                return FragmentationResult(scenario, setting, "projected", peak, peak, None, None, oom=True)
            live += size if kind == "alloc" else -sizes.pop(key, 0)
            sizes[key] = size if kind == "alloc" else sizes.get(key, 0)
            peak = max(peak, live)
        return FragmentationResult(scenario, setting, "projected", peak, peak, None, None)
    allocator = NativeAllocator(capacity) if setting == "native" else ExpandableSegmentsAllocator(capacity)
    retries = _counting(allocator)
    peak_reserved = at_peak = held = 0
    oom = False
    for kind, key, size in events:
        if kind == "alloc" and size:
            if not allocator.malloc(key, size):
                oom = True
                break
            if allocator.reserved > peak_reserved or (allocator.reserved == peak_reserved
                                                      and allocator.allocated > at_peak):
                peak_reserved, at_peak = allocator.reserved, allocator.allocated
        elif kind == "free":
            allocator.free(key)
        held = max(held, allocator.reserved - allocator.allocated)
    return FragmentationResult(scenario, setting, "projected", peak_reserved, at_peak,
                               _largest_free(allocator), retries[0], oom, held)


def loop_traces(cell, steps: int = LOOP_STEPS, seed: int = LOOP_SEED) -> tuple[list, list[int]]:
    """Full-depth traces of `cell` (a language model) at the lengths its loop draws, and the lengths."""
    from harness.project.trace import traced

    lengths = step_lengths(cell.spec, steps, seed)
    return [traced(cell.with_spec(dataclasses.replace(cell.spec, seq_len=length))) for length in lengths], lengths


def loop_events(traces) -> list[tuple[str, int, int]]:
    """The allocation log of the loop: the state as the first step's trace holds it, then each step's
    allocations and frees of the tensors it creates and frees itself."""
    events: list[tuple[str, int, int]] = []
    for index, trace in enumerate(traces):
        if index == 0:
            events += trace.events[:trace.measured_from]
        step = trace.events[trace.measured_from:]
        born = {key for kind, key, _ in step if kind == "alloc"}
        freed = {key for kind, key, _ in step if kind == "free"}
        transient = born & freed
        offset = (index + 1) << 48  # keys of different traces never meet
        events += [(kind, key + offset, size) for kind, key, size in step if key in transient]
    return events


def variable_length_events(cell, steps: int = LOOP_STEPS, seed: int = LOOP_SEED) -> tuple[list, list[int]]:
    """The allocation log of `steps` training steps of `cell` at lengths drawn per step, and the lengths."""
    traces, lengths = loop_traces(cell, steps, seed)
    return loop_events(traces), lengths


GUIDE_SCENARIO = f"guide: {GUIDE_TENSORS} x 1 GiB, free every other, ask {GUIDE_REQUEST // GiB} GiB"


def projected_probe(profile, loop_cell=None) -> list[FragmentationResult]:
    """Both scenarios under every setting: the guide's on a device with room for one more 1 GiB tensor
    than it holds (so the freed memory must serve the request), the loop on `profile`'s capacity (less
    the CUDA context)."""
    from harness.project.memory import device_overhead

    capacity = profile.capacity_bytes - device_overhead(profile) if profile.capacity_bytes else None
    tight = (GUIDE_TENSORS + 1) * GiB
    results = [replay_fragmentation(guide_events(), s, tight, GUIDE_SCENARIO) for s in SETTINGS]
    if loop_cell is not None:
        events, lengths = variable_length_events(loop_cell)
        name = (f"variable-length training: {loop_cell.workload.name} {loop_cell.spec.name} batch "
                f"{loop_cell.batch_size}, lengths {','.join(map(str, lengths))}")
        results += [replay_fragmentation(events, s, capacity, name) for s in SETTINGS]
    return results


# --- measured on a CUDA device -----------------------------------------------------------------------------------

_CHILD = r"""
import json, sys, torch
tensors, request = int(sys.argv[1]), int(sys.argv[2])
GiB = 2**30
# The device the projection assumes: room for one more 1 GiB tensor than it holds, so the freed memory
# must serve the request (on a whole GPU the request would simply get a fresh segment).
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, (tensors + 1) * GiB / total))
held = [torch.empty(GiB, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
for i in range(0, tensors, 2):
    held[i] = None
big = torch.empty(request, dtype=torch.uint8, device="cuda")
"""
# What both children print: the allocator's peaks, its retries and the largest cached free block.
_FIGURES = r"""
stats = torch.cuda.memory_stats()
try:  # cudaMallocAsync keeps no segments of its own to snapshot
    largest = max((b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                   if b["state"] == "inactive"), default=0)
except Exception:
    largest = None
print(json.dumps({"reserved": stats.get("reserved_bytes.all.peak", 0),
                  "allocated": stats.get(ALLOCATED, 0),
                  "retries": stats.get("num_alloc_retries"), "largest": largest}))
"""
# The guide's scenario reports what is allocated when its last request is served; the loop its peak.
_CHILD += 'ALLOCATED = "allocated_bytes.all.current"\n' + _FIGURES
CONF = {"native": None, "expandable_segments": "expandable_segments:True", "cudaMallocAsync": "backend:cudaMallocAsync"}


def measure_guide_scenario(setting: str, tensors: int = GUIDE_TENSORS, request: int = GUIDE_REQUEST,
                           timeout_s: float = 120) -> FragmentationResult:
    """The guide's scenario on this machine's CUDA device under `setting` (a process of its own: the
    setting must be in the environment before CUDA starts). RuntimeError where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring fragmentation needs a CUDA device; none here (the projected probe runs anywhere)")
    figures = _run_child(_CHILD, [str(tensors), str(request)], setting, timeout_s)
    scenario = GUIDE_SCENARIO if (tensors, request) == (GUIDE_TENSORS, GUIDE_REQUEST) else (
        f"guide: {tensors} x 1 GiB, free every other, ask {request / GiB:g} GiB")
    if figures is None:
        return FragmentationResult(scenario, setting, "measured", 0, 0, None, None, oom=True)
    return FragmentationResult(scenario, setting, "measured", figures["reserved"], figures["allocated"],
                               figures["largest"], figures["retries"])


_LOOP_CHILD = r"""
import json, sys, torch
from suites.workloads import get_workload
from suites.techniques.base import default_optimizer
workload = get_workload("gpt")
spec = workload.size(sys.argv[1])
batch, lengths = int(sys.argv[2]), [int(v) for v in sys.argv[3].split(",")]
model = workload.build(spec).cuda()
optimizer = default_optimizer(model.parameters())
generator = torch.Generator().manual_seed(0)
for length in lengths:
    step_spec = spec.__class__(**{**spec.__dict__, "seq_len": length})
    data = {k: v.cuda() for k, v in workload.batch(step_spec, batch, generator).items()}
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = workload.loss(model, data)
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
"""


_LOOP_CHILD += 'ALLOCATED = "allocated_bytes.all.peak"\n' + _FIGURES


def measure_loop(setting: str, size: str, batch: int, lengths: list[int],
                 timeout_s: float = 300) -> FragmentationResult:
    """The variable-length loop trained for real on this machine's CUDA device under `setting` (bf16
    autocast, AdamW, as the projected loop): peak reserved and allocated over the loop (their peaks may
    fall at different moments: the measured waste is the gap between the two peaks)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring fragmentation needs a CUDA device; none here (the projected probe runs anywhere)")
    figures = _run_child(_LOOP_CHILD, [size, str(batch), ",".join(map(str, lengths))], setting, timeout_s)
    scenario = f"variable-length training: gpt {size} batch {batch}, lengths {','.join(map(str, lengths))}"
    if figures is None:
        return FragmentationResult(scenario, setting, "measured", 0, 0, None, None, oom=True)
    return FragmentationResult(scenario, setting, "measured", figures["reserved"], figures["allocated"],
                               figures["largest"], figures["retries"])


def _run_child(code: str, argv: list[str], setting: str, timeout_s: float) -> dict | None:
    """Run `code` in a Python of its own with `setting` in its environment: its JSON figures, None on OOM."""
    from harness.provenance import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if CONF[setting]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CONF[setting]
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode:
        if "out of memory" in done.stderr.lower():
            return None
        raise RuntimeError(f"the fragmentation probe failed under {setting}: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def judge_c4(results: list[FragmentationResult]) -> str:
    """C4 (30-50% of memory lost to fragmentation) against the probe's native-allocator rows."""
    # A scenario that ran out of memory stopped before its peak: what it held then says nothing of C4, and the
    # guide's scenario alone (no waste at its peak by construction) would judge the claim on nothing real.
    failed = [r.scenario for r in results if r.allocator == "native" and r.oom]
    if failed:
        return (f"not measurable here: {failed[0]} ran out of memory before its peak; a smaller --batch-size or "
                "--size lets it finish")
    native = [r for r in results if r.allocator == "native" and r.peak_reserved_bytes]
    if not native:
        return "not measurable here: no native-allocator row ran"
    worst = max(native, key=lambda r: r.waste)
    parts = [f"{r.scenario} ({r.source}): {r.waste:.0%} of reserved not allocated at the peak" for r in native]
    expandable = [r for r in results if r.allocator == "expandable_segments" and r.scenario == worst.scenario]
    after = f"; expandable segments: {expandable[0].waste:.0%}" if expandable else ""
    verdict = ("supported" if 0.30 <= worst.waste <= 0.50 else
               f"contradicted: at most {worst.waste:.0%}" if worst.waste < 0.30 else f"exceeded: {worst.waste:.0%}")
    return f"{verdict} ({'; '.join(parts)}{after})"
