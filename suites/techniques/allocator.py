"""Allocator settings (guide T18): where PyTorch's CUDA caching allocator gets its memory, chosen through
`PYTORCH_CUDA_ALLOC_CONF` before CUDA starts (the cell's process restarts with it: measure/process.py).

`alloc-expandable` (`expandable_segments:True`) lets a segment grow by mapping more pages at its end, so a
step whose tensors change size reuses one growing segment instead of stranding freed blocks in many
fixed ones: less reserved beyond allocated. `alloc-async` (`backend:cudaMallocAsync`) hands allocation
to CUDA's stream-ordered allocator (CUDA 11.2+), whose pool the driver manages (PyTorch's CUDA semantics
notes, "Memory management"). On the CPU neither applies; projection replays the step's allocation log
through the allocator model under the chosen setting (harness/project/allocator.py).
"""

from __future__ import annotations

from suites.techniques.base import Phase, Run, Technique

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def _check(setting: str):
    def check(profile, workload, mode):
        if profile.vendor == "cpu":
            return "it configures PyTorch's CUDA caching allocator; the host CPU's allocator has no such setting"
        if profile.vendor == "amd" and setting == "cudaMallocAsync":
            return "PyTorch's cudaMallocAsync backend is CUDA's; its ROCm counterpart is not modelled here"
        return None

    return check


def _apply(setting: str, conf: str):
    def apply(run: Run) -> None:
        run.env[ALLOC_CONF] = conf
        run.allocator = setting
        run.notes.append(f"allocator: {ALLOC_CONF}={conf}")

    return apply


ALLOC_EXPANDABLE = Technique(
    id="alloc-expandable", phase=Phase.RUNTIME, changes_numerics=False, guide="T18",
    summary="expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): less fragmentation",
    check=_check("expandable_segments"),
    apply=_apply("expandable_segments", "expandable_segments:True"), exclusive="allocator")

ALLOC_ASYNC = Technique(
    id="alloc-async", phase=Phase.RUNTIME, changes_numerics=False, guide="T18",
    summary="CUDA's stream-ordered allocator (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)",
    check=_check("cudaMallocAsync"), apply=_apply("cudaMallocAsync", "backend:cudaMallocAsync"),
    exclusive="allocator")

TECHNIQUES = (ALLOC_EXPANDABLE, ALLOC_ASYNC)
