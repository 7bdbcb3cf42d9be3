"""A cell on several ranks: torchrun starts one cell process per rank, each measures its own slice, and the
runner folds their rows into one row per rank plus the cell's row.

The cell's row takes the maximum over ranks of every memory figure and of the step time (the rank that
runs out first decides OOM, the slowest decides the step; peaks are never summed), and the lowest
throughput; it fits only where every rank fits. Energy is the one figure that adds up: each rank's row
holds its GPU's joules per sample of the cell's global batch, and the cell's row sums them. A rank that
wrote no row (it died, or was killed with the others at a timeout) becomes a row naming it, and the
cell's row says which rank failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import NoReturn

from harness.records import Record

RANK_ROW_SUFFIX = "__rank"
# Columns the cell's row takes the maximum of over ranks; throughput takes the minimum.
MAX_COLUMNS = ("peak_allocated_bytes", "peak_reserved_bytes", "process_peak_rss_bytes", "params_bytes", "grads_bytes",
               "optimizer_bytes", "activations_bytes", "temporaries_bytes", "step_time_ms_p50", "step_time_ms_p90",
               "step_time_ms_mean", "comm_bytes_per_step", "nvml_process_bytes")
MAX_COLUMNS += ("usd_per_million_samples", "usd_per_million_tokens", "alloc_retries",
                "step_time_cv")  # the slowest rank's cost goes with the lowest throughput
MIN_COLUMNS = ("throughput_samples_s", "tokens_per_s", "mfu")
# Every GPU of the cell draws power for the same samples: their energies (and its cost) add up.
SUM_COLUMNS = ("energy_j_per_sample", "energy_usd_per_million_samples")
# The worst rank's status is the cell's. A rank out of memory decides first: its peers then fail in a
# collective (a closed connection, or a hang until the timeout), which is its consequence, not the cause.
STATUS_ORDER = ("oom", "error", "timeout", "unsupported", "ok")
# What torchrun (or a scheduler's launcher) sets in a rank's environment.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                    "MASTER_PORT")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def process_group(profile):
    """The default process group from torchrun's environment (gloo on a CPU, NCCL on GPUs) while inside;
    nothing outside torchrun."""
    if not launched_by_torchrun():
        yield
        return
    import torch
    import torch.distributed as dist

    if profile.vendor != "cpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if profile.vendor == "cpu" else "nccl")
    try:
        yield
    finally:
        dist.destroy_process_group()


def leave_together() -> None:
    """Wait for every rank before tearing the group down. A rank that closes its connections while a peer
    still finishes a collective can make gloo's TCP transport abort that peer (SIGABRT) instead of raising,
    losing its row. Only for ranks that finished well: one that failed may have left its peers mid-step."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def exit_now(code: int) -> NoReturn:
    """End a rank's process at once, once its result is written. At interpreter exit the C++ objects of gloo
    and c10d that a DeviceMesh, DTensor or pipeline stage still holds are destroyed in no set order, and one
    still owning a joinable thread calls std::terminate ("terminate called without an active exception",
    SIGABRT): a rank whose work is done and saved would fail its cell. `os._exit` skips that teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun_command(world_size: int, entry: str, arguments: list[str]) -> list[str]:
    """torchrun, on this machine's loopback (c10d standalone rendezvous), one process per rank, no restarts:
    a rank that fails ends the cell, whose rows then say which."""
    return [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--max-restarts=0", "-m", entry, *arguments]


def rank_result_path(result_path: Path, index: int) -> Path:
    return result_path.with_name(f"{result_path.stem}.rank{index}{result_path.suffix}")


def fold(rank_rows: list[Record | None], missing_row) -> list[Record]:
    """The cell's row, then one row per rank. `missing_row(rank)` gives the row of a rank that wrote none."""
    rows = [row if row is not None else missing_row(index) for index, row in enumerate(rank_rows)]
    rows = [dataclasses.replace(row, rank=index, cell_id=f"{row.cell_id}{RANK_ROW_SUFFIX}{index}")
            for index, row in enumerate(rows)]
    worst = min(rows, key=lambda r: STATUS_ORDER.index(r.status))
    cell = dataclasses.replace(rows[0], rank=None, cell_id=rows[0].cell_id.rsplit(RANK_ROW_SUFFIX, 1)[0],
                               status=worst.status,
                               reason=(f"rank {worst.rank} of {len(rows)}: {worst.reason}" if worst.status != "ok"
                                       else rows[0].reason))
    values = {}
    for column in MAX_COLUMNS:
        figures = [getattr(r, column) for r in rows if getattr(r, column) is not None]
        values[column] = max(figures) if figures else None
    for column in MIN_COLUMNS:
        figures = [getattr(r, column) for r in rows if getattr(r, column) is not None]
        values[column] = min(figures) if figures else None
    for column in SUM_COLUMNS:
        figures = [getattr(r, column) for r in rows if getattr(r, column) is not None]
        # A rank without the figure (no NVML there, or it failed) would make a sum look complete: none then.
        values[column] = sum(figures) if figures and len(figures) == len(rows) else None
    values["noisy"] = any(r.noisy for r in rows) if any(r.noisy is not None for r in rows) else None
    values["fits"] = _all_fit([r.fits for r in rows])
    return [dataclasses.replace(cell, **values), *rows]


def _all_fit(fits: list[bool | None]) -> bool | None:
    """The cell fits only where every rank does: False if any rank does not, None if any is unjudged."""
    if any(fit is False for fit in fits):
        return False
    return None if any(fit is None for fit in fits) else True


def rank_slice(batch: dict, parts: int, index: int | None = None) -> dict:
    """Slice `index` (default: this rank's) of `parts` equal slices of a global batch every rank drew alike
    (the whole batch when `parts` is 1)."""
    from suites.step import split_batch

    return batch if parts <= 1 else split_batch(batch, parts)[rank() if index is None else index]
