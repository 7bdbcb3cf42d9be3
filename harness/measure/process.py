"""The cell's own process: `python -m harness.measure.process SPEC.json RESULT.json`.

The runner (harness/runner.py) starts one per measured cell, so allocator settings apply before the
device starts and an OOM or a crash stays contained. It resolves the cell, measures it, and writes
its row; every failure becomes a row too.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from harness.cell import Cell
from harness.measure import distributed
from harness.measure.local import MeasureSettings, RestartWithEnvironment, measure
from harness.outcome import failure, to_record
from harness.profiles import load_profiles
from harness.records import Record, atomic_write_text

# Set in a cell process that restarted with its stack's environment: a second restart would loop.
RESTARTED = "HEADROOM_CELL_RESTARTED"


def failure_status(exc: BaseException) -> str:
    """`oom` for out-of-memory errors on any device, `error` for everything else."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom"
    text = str(exc)
    # cuBLAS and cuDNN report their own allocation failures near the memory limit (CUBLAS_STATUS_ALLOC_FAILED,
    # CUDNN_STATUS_ALLOC_FAILED) as RuntimeErrors, not OutOfMemoryError.
    if "out of memory" in text.lower() or "can't allocate memory" in text or "_STATUS_ALLOC_FAILED" in text:
        return "oom"
    return "error"


def measure_spec(spec: dict) -> Record:
    """The row of the cell `spec` describes, measured here; never raises for a problem of the cell."""
    cell = Cell(**spec["cell"])
    resolved = None
    try:
        resolved = cell.resolve(load_profiles(spec.get("profiles_dir")))
        with distributed.process_group(resolved.profile):  # under torchrun: this rank's part of the group
            outcome = measure(resolved, MeasureSettings(**spec["settings"]))
            if outcome.status == "ok":
                distributed.leave_together()
    except RestartWithEnvironment as restart:
        if os.environ.get(RESTARTED):
            outcome = failure("error", f"the stack's environment {restart.env} did not hold after a restart")
        else:
            # The same command line (`sys.orig_argv`: tests run other entry modules) in a fresh image.
            try:
                os.execve(sys.executable, sys.orig_argv, {**os.environ, **restart.env, RESTARTED: "1"})
            except OSError as exc:
                outcome = failure("error", f"could not restart with the stack's environment: {exc}")
    except BaseException as exc:  # the row must say what happened, whatever it was
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0][:500]
        outcome = failure(failure_status(exc), detail)
    return to_record(resolved or cell, outcome, spec["run_id"])


def main(argv: list[str]) -> int:
    """Child-process entry: read the cell spec, measure, write the row."""
    spec_path, result_path = argv
    record = measure_spec(json.loads(Path(spec_path).read_text(encoding="utf-8")))
    if distributed.launched_by_torchrun():  # each rank writes its own row; the runner folds them
        result_path = distributed.rank_result_path(Path(result_path), distributed.rank())
    atomic_write_text(Path(result_path), json.dumps(record.to_dict()))
    if distributed.launched_by_torchrun():
        distributed.exit_now(0)  # the row is saved: skip a teardown that can abort (see exit_now)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
