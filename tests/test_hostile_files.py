"""What a hostile or damaged file does to headroom: profiles with absurd values or that are not files,
results folders, ledgers and CSVs with bad values, and outputs that would overwrite a results folder's own
files: each is refused in one line naming the file (and field), and nothing already saved is lost."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main
from harness.profiles import ProfileError, load_profiles
from harness.records import Record, ResultsStore, read_results

ROOT = Path(__file__).resolve().parents[1]


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


def test_parquet_and_csv_agree_after_a_resume(tmp_path):

    argv = ["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
            "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert main([*argv, "--resume", "--technique", "baseline,checkpointing", "--mode", "train,infer"]) == 0
    parquet, csv = read_results(tmp_path / "results.parquet"), read_results(tmp_path / "results.csv")
    assert len(parquet) == len(csv) >= 4
    pd.testing.assert_frame_equal(parquet.astype(str), csv.astype(str))


@pytest.mark.parametrize("line, phrase", [
    ('peak_tflops = { fp32 = 1e308 }', "peak_tflops.fp32': expected a positive number of TFLOP/s"),
    ('memory_bandwidth_gb_s = 1e300', "to 1e+06"),
    ('memory_gib = 1.6e-261', "from 1e-06"),
    ('name = "GPU\\u001b[2J"', "field 'name': expected text without control characters"),
    ('deep = ' + '[' * 3000 + ']' * 3000, "nested too deeply"),
])
def test_hostile_profile_values_are_refused_naming_file_and_field(tmp_path, line, phrase):
    top = {"id": '"odd"', "family": '"odd"', "name": '"Odd"', "vendor": '"nvidia"', "match": '["Odd"]'}
    top[line.split(" ")[0]] = line.split(" = ", 1)[1]
    body = "".join(f"{key} = {value}\n" for key, value in top.items())
    body += "[features]\nbf16 = true\ntf32 = true\nfp8 = false\nsparse_2to4 = false\nflash_attention = true\n"
    (tmp_path / "odd.toml").write_text(body)
    with pytest.raises(ProfileError, match=re.escape(phrase)) as caught:
        load_profiles(tmp_path)
    assert "odd.toml" in str(caught.value) and "\n" not in str(caught.value)


def test_a_fifo_a_device_and_invalid_utf8_are_refused_as_profiles(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    with pytest.raises(ProfileError, match="fifo.toml: not a regular file"):
        load_profiles(tmp_path)  # would block forever on open() if it were read
    (tmp_path / "fifo.toml").unlink()
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    with pytest.raises(ProfileError, match="zero.toml: not a regular file"):
        load_profiles(tmp_path)  # would read without end
    (tmp_path / "zero.toml").unlink()
    (tmp_path / "bytes.toml").write_bytes(b'id = "bytes"\nname = "\xff"\n')
    with pytest.raises(ProfileError, match="bytes.toml: not UTF-8 text"):
        load_profiles(tmp_path)


def test_report_names_file_and_column_of_a_bad_value_and_counts_a_run_once(tmp_path, capsys):
    source = Path(__file__).resolve().parent.parent / "benchmarks/data/h200-2026-11-30.csv"
    frame = pd.read_csv(source, dtype=str, keep_default_na=False)
    frame.loc[0, "peak_allocated_bytes"] = "abc"
    bad = tmp_path / "bad.csv"
    frame.to_csv(bad, index=False)
    assert main(["report", str(bad), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"headroom: error: {bad}: column 'peak_allocated_bytes': expected whole numbers, got 'abc' (row 1)"
    assert main(["report", str(source), str(source), "--out", str(tmp_path / "twice.html")]) == 0
    rows = len(frame)
    assert f"from {rows} rows ({rows} repeated rows of the same runs counted once)" in capsys.readouterr().out


def _results_folder(path: Path) -> Path:
    store = ResultsStore(path)
    store.prepare()
    store.add(Record(run_id="r", workload="gpt", size="smoke", mode="train", technique="baseline", gpu="cpu",
                     source="measured", status="ok", cell_id="c"))
    store.write_frame()
    (path / "ledger.csv").write_text("kept\n")
    return path


def test_outputs_never_overwrite_a_results_folders_own_files(tmp_path, capsys):
    run, other = _results_folder(tmp_path / "run"), _results_folder(tmp_path / "other")
    kept = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    refused = [
        ["report", str(run), "--out", str(other / "results.parquet")],
        ["report", str(run), "--out", str(other / "ledger.csv"), "--format", "md"],
        ["report", str(run), "--out", str(other / "cells" / "x.json")],
        ["report", str(run), "--out", str(other)],  # a folder
        ["serve-matrix", "--size", "gpt-7b", "--gpu", "t4", "--out", str(other / "results.csv")],
        ["fragmentation", "--out", str(other / "accuracy.csv")],
        ["ledger", "add", str(run), "--ledger", str(other / "results.csv")],
        ["ledger", "add", str(run), "--ledger", str(tmp_path)],
    ]
    for argv in refused:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("choose another" in err or "give a file name" in err), (argv, err)
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == kept  # nothing lost
    # A folder of one's own that happens to be called cells is not a run's.
    assert main(["report", str(run), "--out", str(tmp_path / "lab" / "cells" / "report.html")]) == 0
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv in (["serve-matrix", "--size", "gpt-7b", "--gpu", "t4", "--out", str(afile / "m.csv")],
                 ["calibrate", "--quick", "--out", str(afile)]):
        assert main(argv) == 2, argv  # refused before the work, not after it
        assert "choose another --out" in capsys.readouterr().err


def test_a_run_does_not_overwrite_results_it_did_not_write(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.csv").write_text("mine\n")
    (foreign / "report.html").write_text("mine")
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--out", str(foreign), "--no-accuracy"]) == 2
    assert "already holds results.csv, report.html but no run" in capsys.readouterr().err
    assert (foreign / "results.csv").read_text() == "mine\n" and not (foreign / "cells").exists()


def test_inputs_that_would_block_or_are_not_what_they_claim_are_named_in_one_line(tmp_path, capsys):
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    run = _results_folder(tmp_path / "run")
    for argv in (["report", str(fifo), "--out", str(tmp_path / "r.html")],
                 ["report", str(run), "--prices", str(fifo), "--out", str(tmp_path / "r.html")],
                 ["ledger", "add", str(fifo), "--ledger", str(tmp_path / "l.csv")]):
        assert main(argv) == 2, argv  # refused, not blocked
        assert "not a regular file" in capsys.readouterr().err
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["ledger", "add", str(binary), "--ledger", str(tmp_path / "l.csv")]) == 2
    assert f"{binary}: not a readable CSV file" in capsys.readouterr().err
    from harness.ledger import COLUMNS, read_ledger

    broken = tmp_path / "ledger.csv"
    pd.DataFrame([{c: 1 for c in COLUMNS} | {"measured_step_ms": "abc"}]).to_csv(broken, index=False)
    with pytest.raises(ValueError, match="column measured_step_ms, row 2: 'abc' is not a number"):
        read_ledger(broken)


def test_a_results_folder_is_read_from_its_csv_and_an_empty_one_says_what_to_do(tmp_path, capsys):

    run = _results_folder(tmp_path / "run")
    (run / "results.parquet").unlink()
    assert len(read_results(run)) == 1  # the CSV the run wrote beside it
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no results.parquet or results.csv"):
        read_results(tmp_path / "empty")
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--resume"]) == 2
    assert "give it with --out results/<run-id>" in capsys.readouterr().err


def test_a_results_file_without_rows_is_refused_alone_and_noted_beside_others(tmp_path, capsys):
    header = tmp_path / "header-only.csv"
    header.write_text((ROOT / "benchmarks/data/h200-2026-11-30.csv").read_text().splitlines()[0] + "\n")
    assert main(["report", str(header), "--out", str(tmp_path / "r.html")]) == 2
    assert "no rows (a header only), nothing to report" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    run = _results_folder(tmp_path / "run")
    assert main(["report", str(header), str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert "header-only.csv held no rows; the report is built from the others" in capsys.readouterr().err
    assert (tmp_path / "r.html").exists()
