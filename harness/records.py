"""Records: one flat row of scalars per cell, and the results store they are written to.

Raw numbers with units in the column names; formatting is the reports' job. Unknown values are
None (empty in CSV, null in Parquet), never a made-up 0. Each finished cell is written to its own
JSON file atomically (temp file + rename), so a crash never leaves a half-written result and a
resumed run knows what is done; the frame (`results.parquet`, `results.csv`) is rebuilt from them.
"""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import json
import os
import secrets
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from harness.migrations import migrate

SCHEMA_VERSION = 12
# A measured cell whose repeats' mean step times vary by more than this (coefficient of variation),
# or whose mean step time is more than twice this off its median, is flagged `noisy`: its timings are
# not to be trusted to a few percent (harness/measure/timing.py).
DEFAULT_NOISE_THRESHOLD = 0.05
STATUSES = ("ok", "oom", "unsupported", "error", "timeout")
LOCK_NAME = ".headroom.lock"  # in a results folder: held by the run writing it
# What a run writes into its folder: found without cells/, they belong to something this run must not clobber.
FOREIGN_GUARDED = ("results.parquet", "results.csv", "report.html")
# In a results folder: what its run was asked (ResultsStore.keep_run_info); a resume must ask the same.
RUN_INFO = "run.json"
RESUMED_SETTINGS = {"warmup": "--warmup", "steps": "--steps", "repeats": "--repeats",
                    "noise_threshold": "--noise-threshold", "shard": "--shard"}
SOURCES = ("measured", "projected")


@dataclass
class Record:
    """One cell's row. Identity, status, memory (bytes), speed, accuracy, cost, provenance."""

    # identity
    run_id: str
    workload: str
    size: str
    mode: str
    technique: str
    gpu: str
    source: str
    status: str
    reason: str = ""
    cell_id: str = ""
    world_size: int = 1
    rank: int | None = None  # a rank's own row of a multi-process cell; None: the cell's row (max over ranks)
    batch_size: int | None = None
    seq_len: int | None = None
    image_size: int | None = None
    precision: str | None = None
    # memory, bytes
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_reserved_expandable_bytes: int | None = None  # projected under expandable_segments:True
    peak_reserved_async_bytes: int | None = None  # projected under cudaMallocAsync: a floor (live bytes)
    device_overhead_bytes: int | None = None  # outside the allocator (CUDA context)
    library_workspace_bytes: int | None = None  # BLAS workspaces, inside the allocator's figures
    fits: bool | None = None
    alloc_retries: int | None = None  # CUDA allocator: cudaMalloc failures retried after freeing its cache
    # measured CUDA rows: the allocator setting the process ran under (native, expandable_segments,
    # cudaMallocAsync), which picks the projected reserved figure its twin is compared with
    allocator: str | None = None
    process_peak_rss_bytes: int | None = None
    # Where memory goes; each part in its own sense, so they need not add up to the peak:
    # parameters, gradients and optimizer state as held at the end of the step (what persists);
    # activations: what one forward keeps for backward (train) or its transient peak (infer);
    # temporaries (projected): what is live at the peak and persists in none of those (intermediates,
    # the optimizer step's scratch).
    params_bytes: int | None = None
    grads_bytes: int | None = None
    optimizer_bytes: int | None = None
    activations_bytes: int | None = None
    temporaries_bytes: int | None = None
    host_bytes: int | None = None  # state offloaded to host memory (optimizer offload, FSDP's CPU offload)
    param_count: int | None = None
    # speed
    step_time_ms_p50: float | None = None
    step_time_ms_p90: float | None = None
    step_time_ms_mean: float | None = None  # over the timed loops: batch_size / throughput, to the bit
    step_time_cv: float | None = None
    noisy: bool | None = None
    timed_steps: int | None = None
    warmup_s: float | None = None  # measured: the warm-up steps before timing (compilation, autotuning), apart
    throughput_samples_s: float | None = None
    tokens_per_s: float | None = None  # generation rows: generated tokens (all sequences) per second
    flops_per_step: float | None = None
    mfu: float | None = None
    # projected rows: the range the true value is expected in, from the ledger's errors for cells of
    # this kind (harness/ledger.py), how many measured cells it rests on, and which kind it used
    step_time_ms_low: float | None = None
    step_time_ms_high: float | None = None
    step_time_cells: int | None = None
    peak_reserved_low_bytes: int | None = None
    peak_reserved_high_bytes: int | None = None
    peak_reserved_cells: int | None = None
    interval_basis: str | None = None
    # serving (a decoder's inference): `seq_len` is the prompt, prefilled into a KV cache preallocated for
    # prompt + gen_len tokens; the step is one whole generation; time to first token is the prefill.
    gen_len: int | None = None
    ttft_ms: float | None = None
    decode_ms_per_token_p50: float | None = None  # one decode step (one token for every sequence)
    # ... over a generation's decode steps, which slow as the cache they read grows: not a tail latency under load
    decode_ms_per_token_p90: float | None = None
    decode_tokens_s: float | None = None  # batch / mean decode step time
    prefill_tokens_s: float | None = None  # batch x prompt / time to first token
    kv_cache_bytes: int | None = None  # apart from params_bytes (the weights)
    decode_bytes_per_step: int | None = None  # weights streamed once + each sequence's cache at its mean length
    decode_bandwidth_util: float | None = None  # decode_bytes_per_step / mean decode step / datasheet bandwidth
    # measured CUDA rows: what NVML saw over the timed steps (harness/measure/nvml.py)
    nvml_process_bytes: int | None = None  # this process's GPU memory, as nvidia-smi lists it (context included)
    nvml_device_used_bytes: int | None = None  # the whole device's used memory (other processes too)
    power_w_mean: float | None = None
    # The energy counter's difference (else integrated power) / the cell's samples; a rank's row holds its
    # GPU's share, which the cell's row sums.
    energy_j_per_sample: float | None = None
    sm_clock_mhz_mean: float | None = None
    temperature_c_max: float | None = None
    energy_usd_per_million_samples: float | None = None  # energy_j_per_sample at `headroom run --usd-per-kwh`
    # projection checked against its measured twin (same cell on the local device): projected / measured - 1
    peak_error_vs_measured: float | None = None
    step_time_error_vs_measured: float | None = None
    reserved_error_vs_measured: float | None = None  # the allocator model's error: GPU twins only
    comm_error_vs_measured: float | None = None  # bytes sent per rank per step: parallel twins only
    # accuracy
    # bytes each rank sends per step (parallel stacks), in ring terms: counted over one step where measured
    # (harness/measure/comm_volume.py), modelled where projected
    comm_bytes_per_step: int | None = None
    # accuracy of the stack on its workload's task (harness/accuracy): mean over seeds, spread (sample
    # std), paired delta against the baseline with its 95% half-width, the verdict, and fidelity (top-1
    # agreement with the baseline's predictions, KL(baseline || stack) in nats); `accuracy_basis` says what
    # it was measured on: the task's small model, not the row's size.
    accuracy_metric: str | None = None
    accuracy: float | None = None
    accuracy_delta: float | None = None
    accuracy_noise: float | None = None
    accuracy_seeds: int | None = None
    accuracy_delta_ci95: float | None = None
    accuracy_verdict: str | None = None
    accuracy_agreement: float | None = None
    accuracy_kl: float | None = None
    accuracy_basis: str | None = None
    # cost
    usd_per_million_samples: float | None = None
    usd_per_million_tokens: float | None = None
    # provenance
    device_name: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    git_sha: str | None = None
    hostname: str | None = None
    created_at: str | None = None
    wall_time_s: float | None = None
    notes: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


COLUMNS = [f.name for f in fields(Record)]
_INT_COLUMNS = [f.name for f in fields(Record) if f.type in ("int | None", "int")]
_FLOAT_COLUMNS = [f.name for f in fields(Record) if f.type == "float | None"]
_BOOL_COLUMNS = [f.name for f in fields(Record) if f.type == "bool | None"]
_STR_COLUMNS = [f.name for f in fields(Record) if f.type == "str"]
_OPTIONAL_STR_COLUMNS = [f.name for f in fields(Record) if f.type == "str | None"]


def records_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A frame with every column in schema order and nullable dtypes (so None stays empty, not 0/NaN)."""
    # Object dtype first: letting pandas infer would turn ints beside None into floats (losing > 2**53).
    frame = pd.DataFrame(rows, columns=COLUMNS, dtype=object)
    for columns, convert, dtype, expected in ((_INT_COLUMNS, int, "Int64", "whole numbers"),
                                              (_FLOAT_COLUMNS, float, "Float64", "numbers"),
                                              (_BOOL_COLUMNS, _to_bool, "boolean", "true or false")):
        for column in columns:
            frame[column] = pd.array(_converted(frame[column], convert, column, expected), dtype=dtype)
    for column in _STR_COLUMNS:
        # Required text is never missing (empty is ""); optional text is missing, never "".
        frame[column] = frame[column].map(lambda v: "" if _is_missing(v) else str(v)).astype("string")
    for column in _OPTIONAL_STR_COLUMNS:
        frame[column] = frame[column].map(lambda v: None if _is_missing(v) or v == "" else str(v)).astype("string")
    return frame


def _converted(values, convert, column: str, expected: str) -> list:
    """`values` converted, None where missing; ValueError naming the column, the row and the value."""
    out = []
    for row, value in enumerate(values, start=1):
        try:
            out.append(None if _is_missing(value) else convert(value))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"column {column!r}: expected {expected}, got {str(value)[:40]!r} (row {row})") from None
    return out


def _is_missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and value != value)


def _to_bool(value: Any) -> bool:
    """Booleans as they come back from CSV (`True`/`False` text) or Parquet (bool)."""
    if isinstance(value, str):
        if value not in ("True", "False"):
            raise ValueError(f"expected True or False, got {value!r}")
        return value == "True"
    return bool(value)


def _umask_mode() -> int:
    """The mode a new file gets under the process's umask (0644 under the usual 022): mkstemp makes its
    files 0600, which would leave a published results folder unreadable to a web server."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temporary path)` into a uniquely named temp file in the same folder, then rename it over
    `path`, so readers never see half a file and two writers never share a temp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _umask_mode())
        os.close(fd)
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` atomically (see `atomic_write`), flushed to disk before the rename."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write)


def new_run_id() -> str:
    """A run's id: when it started, and a random suffix so two runs started together differ."""
    return datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _cell_file_problem(path: Path) -> tuple[str, dict | None]:
    """("", row) for a readable cell file, else (what is wrong with it, None)."""
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"not a readable cell file ({type(exc).__name__})", None
    if not isinstance(row, dict) or not {"cell_id", "status", "source", "schema_version"} <= set(row):
        return "not a headroom cell file (no cell_id, status, source or schema_version)", None
    if row["status"] not in STATUSES or row["source"] not in SOURCES:
        return f"unknown status {row['status']!r} or source {row['source']!r}", None
    if not isinstance(row["schema_version"], int) or row["schema_version"] > SCHEMA_VERSION:
        return f"schema version {row['schema_version']!r}, newer than this headroom's {SCHEMA_VERSION}", None
    if path.stem != row["cell_id"]:
        return f"holds cell {row['cell_id']!r} under another name (a copy?)", None
    return "", row


class ResultsStore:
    """A results folder: `cells/<cell_id>.json` per finished cell, plus the frame built from them."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.cells_dir = self.root / "cells"
        self._warned: set[Path] = set()

    def prepare(self) -> None:
        """Create the folder or fail with one line if it cannot be written."""
        try:
            self.cells_dir.mkdir(parents=True, exist_ok=True)
            probe = self.cells_dir / ".write-probe"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"output directory {self.root} is not writable ({exc.strerror}); "
                             f"choose another with --out") from None

    def done(self, skip_statuses: tuple[str, ...] = ()) -> set[str]:
        """Cell ids already recorded (by readable cell files: a damaged one's cell runs again), leaving out
        rows whose status is in `skip_statuses` (so that they run again)."""
        return {row["cell_id"] for row in self.rows() if row["status"] not in skip_statuses}

    def open(self, run_id: str, resume: bool = False) -> str:
        """Make the folder ready for the run `run_id` and return the id its rows go under: with `resume`,
        the id of the run it holds (so the resumed run's measured and projected twins pair up). A
        folder holding a run is refused without `resume` (its rows would be folded into this run's
        frame under another id), and `resume` is refused where there is nothing to resume."""
        if resume and not self.cells_dir.is_dir():
            raise ValueError(f"--resume: {self.root} holds no earlier run (no cells/ folder)")
        # Results or a report without cells (copied in, or another tool's): this run would overwrite them.
        foreign = [name for name in FOREIGN_GUARDED if (self.root / name).exists()]
        if foreign and not self.cells_dir.is_dir():
            raise ValueError(f"{self.root} already holds {', '.join(foreign)} but no run of its cells: "
                             "choose another --out (nothing there was changed)")
        self.prepare()
        self._lock()  # before reading what is there: a run that started meanwhile holds it
        earlier = len(list(self.cells_dir.glob("*.json")))
        if earlier and not resume:
            raise ValueError(f"{self.root} already holds a run ({earlier} cells): pass --resume to continue it, "
                             "or choose another --out")
        return (self.recorded_run_id() if resume else None) or run_id

    def _lock(self) -> None:
        """Hold the folder for this process: a second run on it is refused in one line. The lock is the
        kernel's (flock), so it goes with its holder, however that ends, and never needs cleaning up."""
        path = self.root / LOCK_NAME
        try:
            # O_NOFOLLOW: a link planted under the lock's name must not make the run truncate its target.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, _umask_mode())
        except OSError as exc:
            raise ValueError(f"cannot lock {path} ({exc.strerror}); if it is a symbolic link, remove it") from None
        handle = os.fdopen(fd, "r+", encoding="utf-8")  # held open for the run
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ValueError(f"{self.root} is in use by another headroom run ({holder}): wait for it to end, "
                             "or choose another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        self._lock_handle = handle
        # Temp files of runs that were killed mid-write: nobody else writes here while the lock is held.
        for stale in [*self.root.glob(".*.tmp"), *self.cells_dir.glob(".*.tmp")]:
            stale.unlink(missing_ok=True)

    def run_info(self) -> dict | None:
        """What the run in this folder was asked (RUN_INFO: its measurement settings, its shard of which plan),
        None where it wrote none (a run older than the file) or it cannot be read."""
        try:
            info = json.loads((self.root / RUN_INFO).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def keep_run_info(self, info: dict, resume: bool) -> None:
        """Write what this run is asked; resuming, refuse settings its recorded cells were not measured with (a
        resumed folder would mix rows of two kinds, and its skipped cells keep the old ones)."""
        earlier = self.run_info() if resume else None
        if earlier:
            changed = [f"{RESUMED_SETTINGS[key]} {earlier.get(key)} (now {info.get(key)})"
                       for key in RESUMED_SETTINGS if earlier.get(key) != info.get(key)]
            if changed:
                raise ValueError(f"--resume: {self.root}'s cells were run with {', '.join(changed)}: resume with "
                                 "those, or choose another --out (nothing there was changed)")
        atomic_write_text(self.root / RUN_INFO, json.dumps(info, indent=1, sort_keys=True) + "\n")

    def recorded_run_id(self) -> str | None:
        """The run id of the rows already here (a resumed run keeps it, so its twins pair up), or None."""
        rows = self.rows()
        return rows[0]["run_id"] if rows else None

    def add(self, record: Record) -> None:
        atomic_write_text(self.cells_dir / f"{record.cell_id}.json", json.dumps(record.to_dict()))

    def rows(self) -> list[dict[str, Any]]:
        """The rows of the readable cell files. A truncated, empty or foreign file, one from a newer
        headroom, or a copy under another name is skipped with a one-line warning naming it, so it
        can neither stop the run nor count a cell twice."""
        rows = []
        for path in sorted(self.cells_dir.glob("*.json")):
            problem, row = _cell_file_problem(path)
            if problem:
                if path not in self._warned:  # the frame is rebuilt after every measured cell: say it once
                    print(f"headroom: warning: skipped {path}: {problem}", file=sys.stderr)
                    self._warned.add(path)
            else:
                rows.append(row)
        return rows

    def write_frame(self) -> pd.DataFrame:
        """Rebuild results.parquet and results.csv from the cell files, each atomically."""
        frame = records_frame(self.rows())
        atomic_write(self.root / "results.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
        # Quote every text field: a bare carriage return in a reason would otherwise end a CSV row.
        atomic_write_text(self.root / "results.csv", frame.to_csv(index=False, quoting=csv.QUOTE_NONNUMERIC))
        return frame


def read_results(path: Path) -> pd.DataFrame:
    """Load a results file (.parquet or .csv, or a folder holding results.parquet) and check its schema."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in ("results.parquet", "results.csv") if (path / name).exists()]
        newer = _cells_newer_than(path, found[0] if found else None)
        if newer and found and _frame_holds_cells(found[0], path):
            newer = 0  # copied (cp -r gives every file the copy's time), not cut short: the frame is its cells'
        if newer:
            # A run cut short (killed, or stopped in its accuracy stage) rebuilt its frame only after its last
            # measured cell: its cell files are the results. Read them, leaving the folder as it is.
            print(f"headroom: warning: {path}: {newer} cell files are newer than "
                  f"{found[0].name if found else 'any results file'} (a run still going, or cut short): read from "
                  "its cells/; rerunning that run's own headroom run command with --resume rebuilds the file",
                  file=sys.stderr)
            frame = _checked(records_frame(ResultsStore(path).rows()), path / "cells")
            # The report says so on its page too: a reader of the HTML never sees this warning.
            frame.attrs["cut_short"] = (f"{path}: read from its {newer} cell files, newer than "
                                        f"{found[0].name if found else 'any results file'}: a run still going or cut "
                                        "short; some cells (or its accuracy stage) may be missing")
            return frame
        if not found:
            raise ValueError(f"{path}: holds no results.parquet or results.csv (run headroom run --out {path}, "
                             "or give a results file)")
        path = found[0]  # the Parquet file where both are, as the run writes them together
    if not path.exists():
        raise ValueError(f"{path}: no such results file")
    if not path.is_file():  # a FIFO or a device would block, or never end
        raise ValueError(f"{path}: not a regular file (a FIFO, a device or a folder); give a results file")
    try:
        if path.suffix == ".parquet":
            frame = pd.read_parquet(path)
        elif path.suffix == ".csv":
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
        else:
            raise ValueError(f"{path}: not a results file (expected .parquet or .csv)")
    except (OSError, ValueError, ImportError) as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable results file ({type(exc).__name__})") from None
    return _checked(frame, path)


def _cells_newer_than(folder: Path, frame_file: Path | None) -> int:
    """How many of a results folder's cell files are newer than its frame (all of them where it has none)."""
    cells = folder / "cells"
    if not cells.is_dir():
        return 0
    since = frame_file.stat().st_mtime if frame_file is not None else float("-inf")
    return sum(1 for cell in cells.glob("*.json") if cell.stat().st_mtime > since)


def _frame_holds_cells(frame_file: Path, folder: Path) -> bool:
    """Whether a results folder's frame holds exactly the rows of its cell files, whatever their file times."""
    def normal(frame: pd.DataFrame) -> pd.DataFrame:
        frame = frame[sorted(frame.columns)].sort_values(["cell_id", "rank"], kind="stable").reset_index(drop=True)
        return frame.astype(object).where(frame.notna(), None).astype(str)

    try:
        saved = read_results(frame_file)
        cells = _checked(records_frame(ResultsStore(folder).rows()), folder / "cells")
    except (OSError, ValueError):
        return False
    return normal(saved).equals(normal(cells))


def _checked(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    """`frame` read from `path`, its schema checked and migrated to this headroom's columns."""
    missing = [c for c in ("schema_version", "workload", "technique", "source", "status") if c not in frame]
    if missing:
        raise ValueError(f"{path}: not a headroom results file (missing columns: {', '.join(missing)})")
    versions = pd.to_numeric(frame["schema_version"], errors="coerce")
    known = set(range(1, SCHEMA_VERSION + 1))
    unknown = sorted(set(versions.dropna().astype(int)) - known) or (["missing"] if versions.isna().any() else [])
    if unknown:
        raise ValueError(f"{path}: schema version {unknown[0]} is not known to this headroom "
                         f"(it reads versions 1 to {SCHEMA_VERSION}); upgrade headroom")
    if len(frame):
        parts = [migrate(part.copy(), int(version)) for version, part in frame.groupby(versions.astype(int))]
        frame = pd.concat(parts).sort_index()
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    rows = frame[COLUMNS].astype(object).where(frame[COLUMNS].notna(), None).to_dict("records")
    try:
        return records_frame(rows)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
