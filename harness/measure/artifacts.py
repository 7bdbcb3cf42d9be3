"""What a run can keep beside its rows, per measured cell (guide T17: see where memory goes over a step):

- a memory timeline of one step by category (parameters, optimizer state, inputs, temporaries,
  activations, gradients), from PyTorch's profiler (`profile_memory` + `export_memory_timeline`), on the
  CPU and on GPUs; on CUDA also the caching allocator's memory snapshot
  (`torch.cuda.memory._record_memory_history`), which PyTorch's memory_viz page opens;
- a profiler trace of a few steps in Chrome's trace format (chrome://tracing, Perfetto, TensorBoard);
- TensorBoard scalars: each timed step's time and the cell's memory, one run per cell.
Files are named by cell id under `timelines/`, `traces/` and the TensorBoard folder.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

TIMELINES, TRACES = "timelines", "traces"
# The profiler's memory timeline lists sizes per category in this order after a leading unused column
# (torch/profiler/_memory_profiler.py, _CATEGORY_TO_COLORS; None is memory it could not categorise).
TIMELINE_CATEGORIES = ("parameters", "optimizer state", "inputs", "temporaries", "activations", "gradients",
                       "autograd detail", "unknown")
SNAPSHOT_ENTRIES = 100_000  # allocation events the CUDA snapshot keeps


def _activities(device: torch.device) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def memory_timeline(step: Callable[[], object], device: torch.device, folder: Path, cell_id: str) -> list[str]:
    """Run `step` once under the profiler's memory tracking and keep its timeline (and on CUDA the
    allocator's snapshot); the notes say where they went."""
    folder = Path(folder) / TIMELINES
    folder.mkdir(parents=True, exist_ok=True)
    timeline = folder / f"{cell_id}.json"
    snapshot = folder / f"{cell_id}.memory_snapshot.pkl"
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
    try:
        with torch.profiler.profile(activities=_activities(device), profile_memory=True, record_shapes=True,
                                    with_stack=True) as profiler:
            step()
            if cuda:
                torch.cuda.synchronize()
        with warnings.catch_warnings():
            # Deprecated in favour of the CUDA snapshot, which has no CPU counterpart: on the CPU it is the
            # only timeline by category there is.
            warnings.simplefilter("ignore", FutureWarning)
            profiler.export_memory_timeline(str(timeline), device=f"cuda:{torch.cuda.current_device()}"
                                            if cuda else "cpu")
        if cuda:
            torch.cuda.memory._dump_snapshot(str(snapshot))
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    notes = [f"memory timeline of one step: {TIMELINES}/{timeline.name}"]
    if cuda:
        notes.append(f"CUDA memory snapshot for PyTorch's memory_viz: {TIMELINES}/{snapshot.name}")
    return notes


def profiler_trace(step: Callable[[], object], device: torch.device, folder: Path, cell_id: str,
                   steps: int = 3) -> list[str]:
    """Run `steps` steps under the profiler and keep the trace (Chrome trace format)."""
    folder = Path(folder) / TRACES
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cell_id}.json"
    with torch.profiler.profile(activities=_activities(device), record_shapes=True) as profiler:
        for _ in range(steps):
            step()
            profiler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    profiler.export_chrome_trace(str(path))
    return [f"profiler trace of {steps} steps: {TRACES}/{path.name}"]


def tensorboard_scalars(log_dir: Path, cell_id: str, step_s: tuple[float, ...], memory: dict[str, int | None]) -> str:
    """Each timed step's time as a curve and the memory figures as scalars, in `log_dir`/`cell_id`."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError(f"--tensorboard needs the tensorboard package (pip install tensorboard): {exc}") from None
    with contextlib.closing(SummaryWriter(log_dir=str(Path(log_dir) / cell_id))) as writer:
        for index, seconds in enumerate(step_s):
            writer.add_scalar("speed/step_time_ms", seconds * 1e3, index)
        for name, value in memory.items():
            if value is not None:
                writer.add_scalar(f"memory/{name}_mib", value / 2**20, 0)
    return f"TensorBoard scalars: {Path(log_dir) / cell_id}"


def read_timeline(path: Path) -> tuple[list[float], dict[str, list[int]]] | None:
    """A kept timeline as (seconds from its start, bytes per category over time); None if unreadable.
    Reads the JSON timeline only; the snapshot beside it is a pickled file for memory_viz, never read here."""
    import json

    try:
        times, sizes = json.loads(Path(path).read_text(encoding="utf-8"))
        start = times[0]
        by_category = {name: [int(row[i + 1]) for row in sizes] for i, name in enumerate(TIMELINE_CATEGORIES)}
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return None
    return [(t - start) / 1e6 for t in times], by_category
