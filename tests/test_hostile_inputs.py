"""What a hostile or unlucky user does to the command line and the cells it runs: nothing from the
working folder runs in a cell, ids cannot collide, one run per folder, every value is checked at the
door with one line and a non-zero exit, and signals, memory limits, full disks and stray processes
cost a cell its row, never the run (damaged files: tests/test_hostile_files.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from harness.cell import Cell
from harness.cli import main
from harness.profiles import ProfileError, load_profiles
from harness.records import SCHEMA_VERSION, Record, ResultsStore

ROOT = Path(__file__).resolve().parents[1]


def test_a_module_in_the_working_folder_does_not_run_inside_a_cell(tmp_path, monkeypatch):
    # `python -m` puts the working folder first on the import path: a `resource.py` there ran in every
    # measured cell (harness/measure/local.py imports resource), and the rows still said ok.
    marker = tmp_path / "planted-module-ran"
    (tmp_path / "resource.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--out", str(tmp_path / "out"), "--no-report"]) == 0
    assert not marker.exists()


def test_profile_ids_that_a_file_name_cannot_hold_apart_are_refused(tmp_path):
    text = (ROOT / "gpu_profiles" / "l4.toml").read_text()
    (tmp_path / "a b.toml").write_text(text.replace('id = "l4"', 'id = "a b"').replace('"NVIDIA L4"', '"X"'))
    with pytest.raises(ProfileError, match="lower-case letters, digits"):
        load_profiles(tmp_path)


def test_cells_whose_names_differ_only_in_replaced_characters_keep_apart():
    one = Cell("hf:/models/a/b/config.json", "b", "train", "baseline", "h100-sxm", 1)
    two = Cell("hf:/models/a_b/config.json", "b", "train", "baseline", "h100-sxm", 1)
    assert one.cell_id != two.cell_id
    plain = Cell("gpt", "gpt2-124m", "train", "checkpointing+amp-bf16", "h100-sxm", 8)
    assert plain.cell_id == "gpt__gpt2-124m__train__checkpointing+amp-bf16__h100-sxm__b8"  # unchanged


def test_a_second_run_on_a_folder_in_use_is_refused(tmp_path, capsys):
    held = ResultsStore(tmp_path / "out")
    held.open("first")  # this process holds it, as a running `headroom run` would
    code = main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--out", str(tmp_path / "out"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "is in use by another headroom run (pid" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["run", "--cell-timeout", "0"], "expected seconds above 0"),
    (["run", "--cell-timeout", "-5"], "expected seconds above 0"),
    (["run", "--cell-timeout", "nan"], "expected seconds above 0"),
    (["run", "--cell-timeout", "inf"], "expected seconds above 0"),
    (["run", "--cell-timeout", "1e30"], "at most 604800"),
    (["run", "--noise-threshold", "0"], "strictly between 0 and 1"),
    (["run", "--mode", ""], "expected one or more names"),
    (["run", "--workload", " , "], "expected one or more names"),
    (["run", "--technique", ""], "expected one or more names"),
    (["run", "--out", ""], "expected a path"),
    (["run", "--batch-size", str(10**19)], "up to 2147483647"),
    (["project", "--gpu", "t4", "--batch-size", str(10**12)], "up to 2147483647"),
    (["project", "--gpu", "t4", "--seq-len", "-1"], "expected a positive integer"),
    (["report", "x.parquet", "--out", ""], "expected a path"),
    (["run", "--steps", "99999999999"], "expected 10 to 100000 timed steps"),
    (["run", "--repeats", "0"], "expected 1 to 100 repeats"),
    (["run", "--warmup", "two"], "expected a whole number of warm-up steps"),
    (["project", "--gpu", "t4", "--size", ""], "expected a name, got nothing"),
    (["advise", "--gpu", " "], "expected a name, got nothing"),
    (["fragmentation", "--gpu", "a100"], "a100 names 4 profiles"),
    (["fragmentation", "--gpu", "cpu"], "needs a GPU profile"),
    (["profiles", "--profiles", str(ROOT / "pyproject.toml")], "is a file; give the folder that holds it"),
    (["project", "--gpu", "a10", "--mode", "infer", "--tp", "2"], "--tp 2 needs tensor-parallel in the stack"),
    (["project", "--gpu", "a10", "--mode", "infer", "--technique", "tensor-parallel", "--tp", "2", "--pp", "2"],
     "--pp: a served model is projected over a tensor-parallel group alone"),
])
def test_bad_values_are_refused_at_the_door_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_project_exits_non_zero_when_its_row_is_an_error(monkeypatch, capsys):
    import harness.project.query as query
    from harness.outcome import failure

    monkeypatch.setattr(query, "project_outcome", lambda cell: failure("error", "projection failed: boom"))
    assert main(["project", "--gpu", "t4", "--size", "smoke", "--format", "json"]) == 1
    assert '"status": "error"' in capsys.readouterr().out


def test_output_piped_into_head_ends_quietly(monkeypatch, capsys):
    # `headroom profiles | head -1`: the reader leaves, the next write fails with EPIPE.
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", buffering=1) as stdout:  # line-buffered: each line is written at once
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["profiles"]) == 141
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("returncode, before, after, status, phrase", [
    (-36, None, None, "error", "killed by signal 36"),  # a real-time signal: no name in the enum
    (-15, None, None, "error", "killed by SIGTERM"),
    (-9, None, None, "error", "SIGKILL, cause unknown"),
    (-9, 3, 3, "error", "SIGKILL, cause unknown (no OOM kill counted)"),
    (-9, 3, 4, "oom", "the kernel's OOM killer"),
])
def test_a_signal_is_not_taken_for_the_cells_own_result(monkeypatch, returncode, before, after, status, phrase):
    from harness import runner

    monkeypatch.setattr(runner, "oom_kills", lambda: after)
    assert runner._crash_reason(returncode, "last words\n", before)[0] == status
    assert phrase in runner._crash_reason(returncode, "last words\n", before)[1]


def test_oom_kills_are_read_from_the_cgroups_memory_events(tmp_path):
    from harness.runner import oom_kills

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\n")
    assert oom_kills(events) == 1
    assert oom_kills(tmp_path / "missing") is None


def test_damaged_cell_files_are_skipped_with_one_line_naming_each(tmp_path, capsys):
    import json

    from harness.records import Record

    store = ResultsStore(tmp_path)
    store.prepare()
    store.add(Record(run_id="r", workload="gpt", size="smoke", mode="train", technique="baseline", gpu="cpu",
                     source="measured", status="ok", cell_id="good"))
    good = (store.cells_dir / "good.json").read_text()
    damaged = {"truncated": good[: len(good) // 2], "empty": "", "stray": json.dumps({"hello": 1}),
               "future": good.replace('"cell_id": "good"', '"cell_id": "future"').replace(
                   f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99'),
               "copy": good, "bytes": "\udcff"}
    for name, text in damaged.items():
        (store.cells_dir / f"{name}.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert [row["cell_id"] for row in store.rows()] == ["good"]
    assert store.done() == {"good"}
    assert len(store.write_frame()) == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert len(warnings) == len(damaged)  # three reads, each file named once
    assert {line.split("skipped ")[1].split(":")[0].rsplit("/", 1)[1] for line in warnings} == {
        f"{name}.json" for name in damaged}


def test_sigterm_ends_a_run_like_ctrl_c_and_resume_finishes_it(tmp_path):
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "harness.cli", "run", "--gpu", "cpu", "--workload", "gpt,bert", "--technique",
            "baseline,checkpointing", "--mode", "train", "--repeats", "1", "--no-report", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # a margin, not a speed: the run is stopped after its first cell
    while not list((out / "cells").glob("*.json")) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=600)
    assert first.returncode in (0, 130), err  # 0 only if it had already finished
    if first.returncode == 130:
        assert err.strip().splitlines()[-1] == ("headroom: interrupted; finished cells are saved "
                                                "(rerun with --resume)")
    assert subprocess.run([*argv, "--resume"], env=env, capture_output=True, timeout=900).returncode == 0
    assert len(ResultsStore(out).rows()) == 2 * 2 * 2  # 2 workloads x 2 stacks, measured + projected


def test_a_link_planted_as_the_lock_is_not_followed_and_stale_temp_files_go(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    (out / "cells").mkdir(parents=True)
    (out / ".headroom.lock").symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        ResultsStore(out).open("r")
    assert victim.read_text() == "keep me"
    (out / ".headroom.lock").unlink()
    # What a run killed mid-write leaves: temp files of the frame and of a cell file.
    (out / ".results.parquet.abc123.tmp").write_text("half")
    (out / "cells" / ".gpt__smoke.json.def456.tmp").write_text("half")
    ResultsStore(out).open("r")
    assert not list(out.glob(".*.tmp")) and not list((out / "cells").glob(".*.tmp"))


# --- resources, damaged inputs and updates mid-run ---------------------------------------------------


def _unruly(monkeypatch, behaviour: str, **options):
    from harness.cell import Cell
    from harness.profiles import load_profiles
    from harness.runner import RunnerOptions, run_isolated

    monkeypatch.setenv("UNRULY", behaviour)
    cell = Cell("gpt", "smoke", "train", "baseline", "cpu", 4, "measured").resolve(load_profiles())
    return run_isolated(cell, RunnerOptions(run_id="t", cell_entry="tests.unruly_cell", **options))


def test_a_helper_process_that_outlives_its_cell_costs_it_neither_its_row_nor_the_timeout(monkeypatch, tmp_path):
    # The helper sleeps 120 s holding the cell's stderr: a runner waiting for that pipe to close would
    # reach the 100 s limit and record a timeout. No wall-clock assertion: the status says it.
    monkeypatch.setenv("UNRULY_PID", str(tmp_path / "helper.pid"))
    record = _unruly(monkeypatch, "helper", cell_timeout_s=100)
    assert record.status == "ok"
    # And the helper was killed with its cell: SIGKILL was sent; the kernel ends it when it next runs
    # (dead, or a zombie its new parent has not reaped yet). The wait bounds the kernel, not our speed.
    state = Path(f"/proc/{(tmp_path / 'helper.pid').read_text()}/stat")
    for _ in range(100):
        if not state.exists() or state.read_text().split(")")[-1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the helper process is still running: {state.read_text()}")


def test_a_long_cell_reports_how_long_it_has_run_until_its_timeout(monkeypatch, tmp_path):
    import harness.runner as runner

    monkeypatch.setattr(runner, "HEARTBEAT_S", 0.5)
    monkeypatch.setenv("UNRULY_PID", str(tmp_path / "sleeper.pid"))
    beats = []
    record = _unruly(monkeypatch, "sleeper", cell_timeout_s=2.2, heartbeat=lambda cell, s: beats.append(s))
    assert record.status == "timeout"
    # Every half second until the limit: the seconds grow and stay under it.
    assert len(beats) >= 3 and beats == sorted(beats) and 0.4 < beats[0] and beats[-1] < 2.2


def test_a_cells_stderr_is_read_with_a_bound_and_its_last_line_kept(monkeypatch):
    record = _unruly(monkeypatch, "chatty", cell_timeout_s=100)
    assert record.status == "error" and "exited with code 3" in record.reason
    assert "the last line" in record.reason and len(record.reason) < 600


def test_a_cell_over_its_memory_limit_is_an_oom_row_not_the_systems_oom_killer(monkeypatch):
    record = _unruly(monkeypatch, "greedy", cell_timeout_s=100, cell_memory_bytes=1 << 30)
    assert record.status == "oom" and "exceeded --cell-memory 1.0 GiB" in record.reason


def test_a_cell_projected_above_its_memory_limit_is_not_started_and_not_called_a_measured_oom():
    from harness.cell import Cell
    from harness.profiles import load_profiles
    from harness.runner import RunnerOptions, run_cell

    cell = Cell("gpt", "gpt2-124m", "train", "baseline", "cpu", 8, "measured")
    record = run_cell(cell, load_profiles(), RunnerOptions(run_id="t", cell_memory_bytes=1 << 28,
                                                          cell_entry="tests.no_such_module"))[0]
    assert record.status == "unsupported" and record.reason.startswith("not measured: projected peak")
    assert "was not started" in record.reason and record.fits is None


def test_a_row_from_a_checkout_updated_mid_run_becomes_an_error_row(monkeypatch):
    record = _unruly(monkeypatch, "newer", cell_timeout_s=100)
    assert record.status == "error" and "checkout updated during the run" in record.reason


def test_disk_full_is_one_line_and_the_cell_runs_again_on_resume(tmp_path, monkeypatch, capsys):
    import errno

    from harness.records import ResultsStore

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.cells_dir / "x.json"))

    monkeypatch.setattr(ResultsStore, "add", full)
    code = main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--repeats", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("headroom: error: No space left on device")
    assert "rerun with --resume" in err[-1] and "Traceback" not in "\n".join(err)
    monkeypatch.undo()
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--repeats", "1", "--out", str(tmp_path / "out"), "--resume"]) == 0
    assert "gpt smoke infer baseline on cpu (batch 4): ok" in capsys.readouterr().err


def test_retry_failed_reruns_error_and_timeout_rows_and_needs_resume(tmp_path, capsys):
    from harness.records import ResultsStore

    store = ResultsStore(tmp_path)
    store.prepare()
    for cell_id, status in (("a", "ok"), ("b", "error"), ("c", "timeout"), ("d", "oom")):
        store.add(Record(run_id="r", workload="gpt", size="smoke", mode="train", technique="baseline", gpu="cpu",
                         source="measured", status=status, cell_id=cell_id, reason="" if status == "ok" else "x"))
    assert store.done() == {"a", "b", "c", "d"}
    assert store.done(skip_statuses=("error", "timeout")) == {"a", "d"}
    assert main(["run", "--retry-failed", "--out", str(tmp_path)]) == 2
    assert "give it with --resume" in capsys.readouterr().err


def test_a_report_that_cannot_be_built_does_not_hide_the_saved_results(tmp_path, monkeypatch, capsys):
    import reports.build

    def broken(*args, **kwargs):
        raise ImportError("cannot import name 'format' (the checkout changed mid-run)")

    monkeypatch.setattr(reports.build, "write_report", broken)
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert "report.html not written (ImportError" in capsys.readouterr().err
    assert (tmp_path / "results.parquet").exists() and not (tmp_path / "report.html").exists()


def test_escape_codes_in_user_input_are_printed_escaped(tmp_path, capsys):
    odd = tmp_path / "out\x1b[2J.html"
    assert main(["report", str(tmp_path / "missing\x1b[31m.csv"), "--out", str(odd)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31m" in err
    assert main(["report", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "out\x1b[2J")]) == 2  # no suffix
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[2J" in err


def test_an_interrupted_runner_ends_the_cell_in_flight(tmp_path, monkeypatch):
    import signal

    pid_file = tmp_path / "pid"
    monkeypatch.setenv("UNRULY_PID", str(pid_file))

    def interrupt(signum, frame):
        if pid_file.exists():  # the cell is running: interrupt the runner as Ctrl-C would
            raise KeyboardInterrupt
        signal.setitimer(signal.ITIMER_REAL, 0.2)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            _unruly(monkeypatch, "sleeper", cell_timeout_s=100)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped: not left sleeping with its temporary folder removed


def test_a_memory_limit_above_a_hard_limit_in_force_is_capped_not_a_crash():
    # In a process of its own: a hard limit, once lowered (as `ulimit -d` does), cannot be raised again.
    import subprocess

    script = (
        "import os, resource; resource.setrlimit(resource.RLIMIT_DATA, (16 << 30, 16 << 30));"
        "os.environ['UNRULY'] = 'greedy';"
        "from harness.cell import Cell; from harness.profiles import load_profiles;"
        "from harness.runner import RunnerOptions, run_isolated;"
        "cell = Cell('gpt', 'smoke', 'train', 'baseline', 'cpu', 4, 'measured').resolve(load_profiles());"
        "print(run_isolated(cell, RunnerOptions(run_id='t', cell_entry='tests.unruly_cell', cell_timeout_s=100,"
        " cell_memory_bytes=1 << 40)).status)")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    # 3 GiB under the 16 GiB hard limit: setrlimit did not fail before exec, and the cell ran.
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]


def test_a_cell_memory_too_small_to_import_torch_is_refused_at_the_door(capsys):
    assert main(["run", "--cell-memory", "512M"]) == 2
    assert "expected a size from 2G to 1024T" in capsys.readouterr().err


def test_an_interrupt_during_an_in_process_trace_waits_for_the_trace_to_end():
    # Raised inside autograd's C++ (a MemTracker hook), KeyboardInterrupt aborts the process
    # ("terminate called after throwing an instance of 'python_error'"): the runner defers it.
    from harness import runner

    finished = []
    with pytest.raises(KeyboardInterrupt):
        with runner._interrupts_deferred():
            runner.interrupt(15, None)  # SIGTERM arrives mid-trace: nothing is raised here
            finished.append("trace")
    assert finished == ["trace"]
    with pytest.raises(KeyboardInterrupt):
        runner.interrupt(15, None)  # outside a trace it takes effect at once


def test_a_world_size_is_refused_before_any_rank_starts_where_it_cannot_run(tmp_path, capsys):
    common = ["run", "--gpu", "cpu", "--workload", "gpt", "--mode", "train", "--no-accuracy"]
    assert main([*common, "--technique", "baseline", "--world-size", "2", "--out", str(tmp_path / "a")]) == 2
    assert "no --technique asked for is one" in capsys.readouterr().err
    assert main([*common, "--technique", "data-parallel", "--world-size", "100000", "--out", str(tmp_path / "b")]) == 2
    assert "this machine runs at most" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before the folder was made
