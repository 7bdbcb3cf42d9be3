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
from harness.records import ResultsStore

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
