"""Run a plan: each measured cell in its own process with a timeout; every outcome becomes a row.

An exception, an OOM, a timeout or a crash (segfault, `os._exit`) in a cell is recorded with its
status and reason and the run goes on. Rows are written as each cell finishes, so an interrupted
run loses at most the cell in flight, and `--resume` skips the cells already recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.cell import Cell, ResolvedCell
from harness.measure import distributed
from harness.measure.local import MeasureSettings
from harness.outcome import failure, to_record
from harness.profiles import GpuProfile
from harness.project import project_outcome
from harness.provenance import REPO_ROOT
from harness.records import Record, ResultsStore
from harness.twins import twin_errors, twin_pairs

DEFAULT_CELL_TIMEOUT_S = 600.0
# A cell's stderr is kept in a file and only its end is read: a cell (or a helper it started) that
# prints without end cannot fill the runner's memory.
STDERR_TAIL_BYTES = 64 * 1024
# The default --cell-memory: this share of the memory available when the run starts, so that a cell
# too big for the host becomes an `oom` row instead of waking the system's OOM killer.
DEFAULT_CELL_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class RunnerOptions:
    """How a plan is run: the run's id, each measured cell's time limit and measurement settings."""

    run_id: str
    cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S
    settings: MeasureSettings = MeasureSettings()
    profiles_dir: str | None = None
    # The module run as `python -m <cell_entry> SPEC RESULT`; tests swap in one that misbehaves.
    cell_entry: str = "harness.measure.process"
    # Most memory a cell measured on the host CPU may take (its data segment: heap and anonymous
    # mappings, RLIMIT_DATA); None: no limit.
    cell_memory_bytes: int | None = None
    # Called every HEARTBEAT_S while a measured cell runs, with the cell and the seconds it has run: a long cell
    # (a large size on the CPU) is not minutes of silence.
    heartbeat: Callable[[Cell, float], None] | None = None


HEARTBEAT_S = 30.0


# Whether the runner is tracing in-process, and whether an interrupt arrived meanwhile.
_deferring = False
_pending = False


def interrupt(signum, frame) -> None:
    """The run's handler for Ctrl-C, SIGTERM and SIGHUP: end the run as KeyboardInterrupt does, except in the
    middle of an in-process trace, where a Python exception raised inside autograd's C++ (a MemTracker
    hook) aborts the whole process; there it takes effect as soon as the trace ends."""
    global _pending
    if _deferring:
        _pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupts_deferred():
    global _deferring, _pending
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        if _pending:
            _pending = False
            raise KeyboardInterrupt


def available_memory() -> int:
    """Bytes the host can give without swapping (MemAvailable), its total RAM where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_cell_memory() -> int:
    return int(available_memory() * DEFAULT_CELL_MEMORY_SHARE)


def _wait(process: subprocess.Popen, options: RunnerOptions, cell: Cell, started: float) -> None:
    """Wait for the cell's process up to its timeout (TimeoutExpired past it), telling `options.heartbeat` how
    long it has run every HEARTBEAT_S."""
    deadline = started + options.cell_timeout_s
    while True:
        left = deadline - time.perf_counter()
        try:
            process.wait(timeout=max(0.0, min(left, HEARTBEAT_S)))
            return
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                raise
            if options.heartbeat:
                options.heartbeat(cell, time.perf_counter() - started)


def run_isolated(cell: Cell | ResolvedCell, options: RunnerOptions) -> Record | list[Record]:
    """Measure `cell` in a fresh Python process (one per rank under torchrun for a parallel stack: then the
    cell's row and one per rank); turn any way it can fail into a row."""
    named = cell.cell if isinstance(cell, ResolvedCell) else cell
    with tempfile.TemporaryDirectory(prefix="headroom-cell-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({
            "cell": named.to_dict(), "run_id": options.run_id, "settings": asdict(options.settings),
            "profiles_dir": options.profiles_dir}))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                         os.environ.get("PYTHONPATH")])))
        # -P: the working folder is not put first on the import path, so a `resource.py` (or any module
        # named like one the cell imports) lying there cannot run inside the cell. A user's model named
        # by --model is imported from there on purpose (suites/workloads/user.py).
        command = [sys.executable, "-P", "-m", options.cell_entry, str(spec_path), str(result_path)]
        ranks = named.world_size if isinstance(cell, ResolvedCell) and runs_on_ranks(cell) else 0
        # A headroom itself started by torchrun (or a job scheduler) must not make its cells think they are ranks.
        env = {k: v for k, v in env.items() if k not in distributed.LAUNCH_VARIABLES
               and not k.startswith("TORCHELASTIC_")}
        if ranks:
            command = distributed.torchrun_command(ranks, options.cell_entry, [str(spec_path), str(result_path)])
            env["PYTHONSAFEPATH"] = "1"  # torchrun starts its workers without -P: the same protection
        on_host = isinstance(cell, ResolvedCell) and cell.profile.vendor == "cpu"
        # Every rank inherits the limit: together they may use what one cell may.
        limit = options.cell_memory_bytes // max(1, ranks) if on_host and options.cell_memory_bytes else None
        started = time.perf_counter()
        oom_kills_before = oom_kills()
        with open(Path(tmp) / "stderr.txt", "w+b") as stderr_file:
            # Own process group, so a timeout kills the cell and anything it started. stderr goes to a
            # file, not a pipe: a helper process that outlives the cell and keeps the pipe open would
            # otherwise hold the runner until the timeout and cost a finished cell its row.
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr_file,
                                       start_new_session=True, preexec_fn=lambda: _prepare_child(limit))
            try:
                _wait(process, options, named, started)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait()
                timeout = failure("timeout", f"exceeded --cell-timeout {options.cell_timeout_s:g} s",
                                  wall_time_s=time.perf_counter() - started)
                if ranks:  # the ranks that finished have rows; the ones still running (hung) are named
                    return _rank_rows(cell, result_path, ranks, None, "", options.run_id, None, timeout)
                return to_record(cell, timeout, options.run_id)
            except BaseException:
                # Ctrl-C, SIGTERM or SIGHUP on the runner: the cell in flight (and what it started) ends
                # now, before its temporary folder is removed, not whenever the kernel notices its parent left.
                _kill_group(process)
                process.wait()
                raise
            _kill_group(process)  # the cell is done: helpers it left behind go with it
            stderr = _tail(stderr_file)
        if ranks:
            return _rank_rows(cell, result_path, ranks, process.returncode, stderr, options.run_id, oom_kills_before)
        if result_path.exists():
            return _result_row(cell, result_path, options.run_id)
        status, reason = _crash_reason(process.returncode, stderr, oom_kills_before)
        # Out of memory under the limit: Python's MemoryError, PyTorch's CPU allocator, or the dynamic loader
        # unable to map a library while the cell still imports.
        if status == "error" and limit and any(sign in stderr for sign in (
                "MemoryError", "can't allocate memory", "failed to map segment", "cannot allocate memory")):
            status, reason = "oom", f"exceeded --cell-memory {limit / 2**30:,.1f} GiB ({reason})"
        return to_record(cell, failure(status, reason, wall_time_s=time.perf_counter() - started), options.run_id)


def _result_row(cell, result_path: Path, run_id: str) -> Record:
    """The row the cell wrote; an error row where it cannot be read as one (a cell started from a checkout
    updated mid-run may write fields this runner does not know)."""
    try:
        return Record(**json.loads(result_path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        return to_record(cell, failure("error", f"the cell's result could not be read ({type(exc).__name__}: "
                                                f"{str(exc)[:200]}); was the checkout updated during the run?"),
                         run_id)


def runs_on_ranks(cell: ResolvedCell) -> bool:
    """Whether the cell runs under torchrun: on several ranks, or with a parallel technique (on one rank too)."""
    return cell.cell.world_size > 1 or cell.stack.parallel


def _rank_rows(cell, result_path: Path, ranks: int, returncode: int | None, stderr: str, run_id: str,
               oom_kills_before: int | None = None, timeout=None) -> list[Record]:
    """The cell's row and one per rank (harness/measure/distributed.py); a rank without a row died, or at a
    timeout (`timeout`: the failure) had not finished."""
    rows = []
    for index in range(ranks):
        path = distributed.rank_result_path(result_path, index)
        rows.append(_result_row(cell, path, run_id) if path.exists() else None)
    if timeout is not None:
        status, reason = timeout.status, f"still running when the cell {timeout.reason}"
    else:
        status, reason = (_crash_reason(returncode, stderr, oom_kills_before) if returncode
                          else ("error", "wrote no row"))

    def missing(index: int) -> Record:
        return to_record(cell, failure(status, f"rank {index} wrote no row: {reason}"), run_id)

    return distributed.fold(rows, missing)


def _tail(handle) -> str:
    handle.seek(0, os.SEEK_END)
    handle.seek(max(0, handle.tell() - STDERR_TAIL_BYTES))
    return handle.read().decode("utf-8", errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _prepare_child(memory_limit: int | None) -> None:
    """In the child, before exec: cap its data segment (a cell measured on the host), and ask Linux to
    SIGKILL it when the runner dies (even by SIGKILL), so a killed run leaves no orphan cell computing
    on. No portable API exists for the latter, hence prctl via ctypes."""
    if memory_limit:
        import resource

        # The soft limit only, and never above a hard limit already in force (setrlimit would fail, and
        # an exception here, before exec, would end the run).
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        soft = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _crash_reason(returncode: int, stderr: str, oom_kills_before: int | None = None) -> tuple[str, str]:
    """Status and reason for a cell process that died without writing its row. A SIGKILL is `oom` only
    where the kernel counted an OOM kill meanwhile (cgroup v2 `memory.events`): the same signal also
    comes from a user, a supervisor or a time limit."""
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:  # real-time signals have no name in the enum
            name = f"signal {number}"
        if name == "SIGKILL":
            after = oom_kills()
            if oom_kills_before is not None and after is not None and after > oom_kills_before:
                return "oom", ("cell process killed by the kernel's OOM killer (SIGKILL); "
                               f"last stderr line: {tail[0][:300]}")
            return "error", (f"cell process killed by SIGKILL, cause unknown (no OOM kill counted"
                             f"{'' if after is not None else ': this machine does not report them'}); "
                             f"last stderr line: {tail[0][:300]}")
        return "error", f"cell process killed by {name}; last stderr line: {tail[0][:300]}"
    return "error", f"cell process exited with code {returncode} without a result; last stderr line: {tail[0][:300]}"


def oom_kills(events: Path = Path("/sys/fs/cgroup/memory.events")) -> int | None:
    """The kernel's count of OOM kills in this process's cgroup (cgroup v2), None where unreadable."""
    try:
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def run_plan(cells: list[Cell], profiles: dict[str, GpuProfile], store: ResultsStore, options: RunnerOptions,
             on_done: Callable[[int, int, Cell, Record | None], None] | None = None,
             resume: bool = False, retry_failed: bool = False) -> list[Record]:
    """Run every cell not already in the store (when resuming; `retry_failed`: cells recorded as error or
    timeout count as not done) and write rows as they finish (a rerun cell's row replaces its old one)."""
    done = (store.done(skip_statuses=("error", "timeout") if retry_failed else ())) if resume else set()
    records: list[Record] = []
    for index, cell in enumerate(cells, start=1):
        if cell.cell_id in done:
            if on_done:
                on_done(index, len(cells), cell, None)
            continue
        rows = run_cell(cell, profiles, options)
        record = rows[0]
        for row in rows:  # the cell's row, and one per rank for a multi-process cell
            store.add(row)
        if cell.source == "measured":
            # Keep the frame current through slow measured cells; projected cells take milliseconds
            # and rebuilding the frame from every cell file after each would dominate their cost.
            store.write_frame()
        records.append(record)
        if on_done:
            on_done(index, len(cells), cell, record)
    attach_twin_errors(store)
    return records


def run_cell(cell: Cell, profiles: dict[str, GpuProfile], options: RunnerOptions) -> list[Record]:
    """The rows of one cell (its own first, then one per rank of a multi-process cell): resolved once here;
    unsupported without a process, projected in this process, measured in its own (under torchrun for
    parallel stacks)."""
    rows = _run_cell(cell, profiles, options)
    return rows if isinstance(rows, list) else [rows]


def _run_cell(cell: Cell, profiles: dict[str, GpuProfile], options: RunnerOptions) -> Record | list[Record]:
    try:
        resolved = cell.resolve(profiles)
    except ValueError as exc:
        return to_record(cell, failure("error", str(exc)), options.run_id)
    if resolved.unsupported:
        return to_record(resolved, failure("unsupported", resolved.unsupported), options.run_id)
    if cell.source == "projected":
        with _interrupts_deferred():
            outcome = project_outcome(resolved)
        return to_record(resolved, outcome, options.run_id)
    with _interrupts_deferred():
        too_big = _preflight(resolved, options)
    if too_big:  # a projection's verdict, not a measurement: the row must not read as a measured OOM
        return to_record(resolved, failure("unsupported", too_big), options.run_id)
    return run_isolated(resolved, options)


def _preflight(cell: ResolvedCell, options: RunnerOptions) -> str:
    """Why a cell measured on the host cannot fit its memory limit, judged by its projection before a
    process starts ("" where it may fit, or where the projection cannot tell)."""
    if cell.profile.vendor != "cpu" or not options.cell_memory_bytes:
        return ""
    outcome = project_outcome(cell)  # the trace is cached: the cell's projected twin reuses it
    peak = outcome.memory.peak_allocated if outcome.memory else None
    if peak and peak > options.cell_memory_bytes:
        return (f"not measured: projected peak {peak / 2**30:,.1f} GiB > --cell-memory "
                f"{options.cell_memory_bytes / 2**30:,.1f} GiB, so the cell was not started (raise --cell-memory "
                f"to measure it in a new run)")
    return ""


def attach_twin_errors(store: ResultsStore) -> None:
    """Give each projected row that has a measured twin (harness/twins.py) its relative errors."""
    for row, twin in twin_pairs(store.rows()):
        updated = dict(row, **twin_errors(row, twin))
        if updated != row:
            store.add(Record(**updated))
