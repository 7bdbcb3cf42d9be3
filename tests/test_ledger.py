"""The ledger of projected-vs-measured pairs: seeded, merged without duplicates, and turned into the
interval every projected row carries; `headroom calibrate` writing an overlay that projections use."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from harness.calibrate import calibrate, write_overlay
from harness.cell import Cell
from harness.cli import main
from harness.ledger import (
    COLUMNS,
    LEDGER_FILE,
    NO_PAIRS_FACTOR,
    interval,
    merge,
    pairs_from,
    read_ledger,
)
from harness.outcome import to_record
from harness.profiles import ProfileError, load_profiles
from harness.project import project_outcome

REPO = Path(__file__).resolve().parent.parent
H200 = REPO / "benchmarks/data/h200-2026-11-30.csv"
PROFILES = load_profiles()


def _ledger(rows: list[dict]) -> pd.DataFrame:
    base = {c: None for c in COLUMNS} | {"step_time_noisy": False, "generation": "hopper", "precision": "bf16-mixed",
                                         "workload": "gpt"}
    return pd.DataFrame([base | row for row in rows], columns=COLUMNS)


def test_the_shipped_ledger_holds_the_kept_h200_twins_with_provenance():
    ledger = read_ledger()
    assert len(ledger) == 17 and ledger["pair_id"].is_unique
    assert set(ledger["device_name"]) == {"NVIDIA H200"} and set(ledger["generation"]) == {"hopper"}
    assert ledger[["driver_version", "torch_version", "headroom_version", "origin"]].notna().all().all()


def test_merging_the_same_pairs_twice_adds_them_once():
    pairs = pairs_from(H200, PROFILES)
    assert len(pairs) == 17
    once, added = merge(read_ledger(Path("/nonexistent/ledger.csv")), pairs)
    twice, again = merge(once, pairs)
    assert added == 17 and again == 0 and len(twice) == 17
    # The shipped ledger already holds them (same pair ids), though its projections were refreshed.
    assert merge(read_ledger(), pairs)[1] == 0


def test_an_interval_spans_the_errors_of_the_closest_kind_with_enough_pairs():
    ledger = _ledger([{"measured_step_ms": m, "projected_step_ms": 10.0} for m in (11.0, 12.0, 13.0)]
                     + [{"measured_step_ms": 30.0, "projected_step_ms": 10.0, "precision": "fp32"}])
    bar = interval(100.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "hopper")
    assert bar.pairs == 3 and "gpt bf16-mixed on hopper" in bar.basis
    assert 100.0 <= bar.low <= 110.0 and bar.high >= 130.0  # the projection stays inside
    # A kind with too few pairs widens to a broader one; none at all gives the stated wide default.
    other = interval(100.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "ampere")
    assert other.pairs == 3 and "gpt bf16-mixed" in other.basis and "ampere" not in other.basis
    empty = interval(100.0, ledger.iloc[:0], "measured_step_ms", "projected_step_ms", "gpt", "fp32", "hopper")
    assert (empty.low, empty.high, empty.pairs) == (100.0 / NO_PAIRS_FACTOR, 100.0 * NO_PAIRS_FACTOR, 0)
    assert "no measured pairs" in empty.basis


def test_noisy_twins_give_no_step_time_error():
    ledger = _ledger([{"measured_step_ms": 50.0, "projected_step_ms": 10.0, "step_time_noisy": True}] * 3)
    assert interval(10.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "hopper").pairs == 0


def test_every_projected_row_carries_its_interval_and_what_it_rests_on():
    cell = Cell("gpt", "gpt2-124m", "train", "amp-bf16", "h200", 8, "projected").resolve(PROFILES)
    row = to_record(cell, project_outcome(cell), "t")
    assert row.step_time_ms_low <= row.step_time_ms_p50 <= row.step_time_ms_high
    assert row.peak_reserved_low_bytes <= row.peak_reserved_bytes <= row.peak_reserved_high_bytes
    assert row.step_time_pairs >= 3 and "gpt bf16-mixed on hopper" in row.interval_basis
    # AMD's speed constants were never fitted: its interval is the wide default, and the row says so.
    amd = Cell("bert", "smoke", "train", "baseline", "mi300x", 4, "projected").resolve(PROFILES)
    amd_row = to_record(amd, project_outcome(amd), "t")
    assert amd_row.step_time_pairs == 0 and "not fitted for this vendor" in amd_row.interval_basis
    assert amd_row.step_time_ms_high == pytest.approx(9 * amd_row.step_time_ms_low)


def test_ledger_add_merges_results_into_a_ledger_file_once(tmp_path, capsys):
    target = tmp_path / "ledger.csv"
    assert main(["ledger", "add", str(H200), "--ledger", str(target)]) == 0
    assert "added 17 pairs" in capsys.readouterr().out
    assert main(["ledger", "add", str(H200), str(target), "--ledger", str(target)]) == 0
    assert "added 0 pairs" in capsys.readouterr().out
    assert len(read_ledger(target)) == 17
    assert main(["ledger", "show"]) == 0
    assert "hopper" in capsys.readouterr().out


def test_ledger_add_refuses_what_is_not_results_in_one_line(tmp_path, capsys):
    stray = tmp_path / "stray.csv"
    stray.write_text("a,b\n1,2\n")
    assert main(["ledger", "add", str(stray), "--ledger", str(tmp_path / "l.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a headroom results file" in err
    assert not (tmp_path / "l.csv").exists()


def test_calibrate_on_the_cpu_writes_an_overlay_that_projections_use(tmp_path, capsys):
    profile = PROFILES["cpu"]
    result = calibrate(profile, __import__("torch").device("cpu"), quick=True, progress=lambda _: None)
    assert result.achievable_flops["fp32"] > 1e9 and result.bandwidth_bytes_s > 1e9
    assert 1e-7 < result.issue_s < 1e-3 and result.kernel_s is None
    assert "host CPU" in result.notes[0]
    path = write_overlay(result, tmp_path)
    calibrated = load_profiles(tmp_path)["cpu"]
    assert calibrated.achievable_flops["fp32"] == pytest.approx(result.achievable_flops["fp32"], rel=1e-3)
    assert calibrated.calibration["device"] and "calibrated on" in calibrated.sources["achievable_tflops"]
    # The plain cpu profile has no bandwidth or peak: no step time; the calibrated one has one.
    cell = Cell("gpt", "smoke", "train", "baseline", "cpu", 4, "projected")
    assert to_record(cell.resolve(PROFILES), project_outcome(cell.resolve(PROFILES)), "t").step_time_ms_p50 is None
    calibrated_row = to_record(cell.resolve(load_profiles(tmp_path)),
                               project_outcome(cell.resolve(load_profiles(tmp_path))), "t")
    assert calibrated_row.step_time_ms_p50 > 0
    assert path.name == "cpu.overlay.toml"


def test_an_overlay_for_no_loaded_profile_is_refused_naming_the_file(tmp_path):
    (tmp_path / "x.overlay.toml").write_text('profile = "nope"\n[calibration]\ndevice = "d"\ndate = "now"\n'
                                             '[figures]\nissue_us = 3.0\n')
    with pytest.raises(ProfileError, match=r"x.overlay.toml: field 'profile'"):
        load_profiles(tmp_path)
    (tmp_path / "x.overlay.toml").write_text('profile = "cpu"\n[calibration]\ndevice = "d"\ndate = "now"\n'
                                             '[figures]\nissue_us = -3.0\n')
    with pytest.raises(ProfileError, match=r"figures.issue_us"):
        load_profiles(tmp_path)


def test_the_package_ledger_is_the_default_target():
    assert LEDGER_FILE.name == "ledger.csv" and LEDGER_FILE.parent.name == "data"
