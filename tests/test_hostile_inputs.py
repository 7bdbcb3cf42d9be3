"""What a hostile or unlucky user does to the command line and the results folder: nothing from the
working folder runs in a cell, ids cannot collide, one run per folder, and every value is checked at
the door with one line and a non-zero exit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.cell import Cell
from harness.cli import main
from harness.profiles import ProfileError, load_profiles
from harness.records import SCHEMA_VERSION, ResultsStore

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


def test_report_never_overwrites_its_own_input(tmp_path, capsys):
    data = ROOT / "benchmarks" / "data" / "h200-2026-11-30.csv"
    copy = tmp_path / "rows.csv"
    copy.write_bytes(data.read_bytes())
    assert main(["report", str(copy), "--out", str(copy)]) == 2
    assert "would overwrite the results it reads" in capsys.readouterr().err
    assert copy.read_bytes() == data.read_bytes()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.csv").write_bytes(data.read_bytes())
    assert main(["report", str(folder), "--out", str(folder / "results.csv")]) == 2  # a folder's files too
    assert (folder / "results.csv").read_bytes() == data.read_bytes()
    assert main(["report", str(copy), "--out", str(tmp_path / "report.html")]) == 0
