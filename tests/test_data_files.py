"""Every results file kept in the repository loads in `headroom report` and the benchmark scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import twin_errors
from harness.cli import main
from harness.records import SCHEMA_VERSION, read_results

REPO = Path(__file__).resolve().parents[1]
KEPT = sorted(path for pattern in ("*.csv", "*.parquet") for path in REPO.rglob(pattern)
              if not {".nox", ".git", "results"} & set(path.relative_to(REPO).parts))
# Results files (a schema_version column); the ledger and the published throughputs have tests of their own.
DATA_FILES = [path for path in KEPT if path.suffix == ".parquet" or "schema_version" in path.read_text().split("\n")[0]]


def test_the_kept_data_files_are_found():
    names = {path.relative_to(REPO).as_posix() for path in DATA_FILES}
    assert "benchmarks/data/h200-2026-11-30.csv" in names and "tests/fixtures/schema_v1/results.csv" in names
    assert {"harness/data/ledger.csv", "benchmarks/data/published_speed.csv"} <= {
        path.relative_to(REPO).as_posix() for path in KEPT} - names


def test_every_published_throughput_names_a_cell_headroom_can_project():
    import pandas as pd

    from harness.cell import Cell
    from harness.profiles import load_profiles

    profiles = load_profiles()
    published = pd.read_csv(REPO / "benchmarks/data/published_speed.csv")
    assert len(published) >= 6 and published["source"].str.len().gt(10).all()
    for row in published.to_dict("records"):
        cell = Cell(row["workload"], row["size"], "train", row["technique"], row["gpu"], row["batch_size"], "projected")
        assert not cell.resolve(profiles).unsupported


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_each_data_file_loads_reports_and_tabulates(path, tmp_path, capsys):
    frame = read_results(path)
    assert len(frame) and (frame["schema_version"] == SCHEMA_VERSION).all()
    assert main(["report", str(path), "--out", str(tmp_path / "report.html")]) == 0
    assert (tmp_path / "report.html").stat().st_size > 0
    code = twin_errors.main([str(path)])
    out = capsys.readouterr().out
    # The kept GPU rows have projected twins; the schema fixture has none, and the script says so.
    assert code == 0 or "no projected row has a measured twin" in out


def test_the_kept_h200_rows_keep_their_figures():
    frame = read_results(REPO / "benchmarks/data/h200-2026-11-30.csv")
    twins = frame[(frame["source"] == "projected") & frame["peak_error_vs_measured"].notna()]
    assert len(twins) == 17
    ok = frame[frame["status"] == "ok"]
    # The mean step time the schema-6 migration derives is the one the throughput encoded.
    assert ((ok["throughput_samples_s"] * ok["step_time_ms_mean"] / 1e3 - ok["batch_size"]).abs() < 1e-9).all()
