"""The ledger of projected-vs-measured pairs: seeded, merged without duplicates, and turned into the
interval every projected row carries; `headroom calibrate` writing an overlay that projections use."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
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
from harness.twins import timing_noisy

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


def test_a_ledger_written_before_gen_len_reads_it_empty_and_keeps_its_pair_ids(tmp_path):
    from harness.ledger import pair_id

    old = tmp_path / "ledger.csv"
    read_ledger().drop(columns=["gen_len"]).to_csv(old, index=False)
    ledger = read_ledger(old)
    assert list(ledger.columns) == COLUMNS and ledger["gen_len"].isna().all()
    row = {key: value for key, value in ledger.iloc[0].to_dict().items() if key != "gen_len"}
    # An empty gen_len leaves a pair's id as it was before the column; a generation's pair is another pair.
    assert pair_id(row | {"gen_len": None}) == pair_id(row) == pair_id(row | {"gen_len": float("nan")})
    assert pair_id(row | {"gen_len": 128}) != pair_id(row)
    assert pair_id(row | {"gen_len": 128}) == pair_id(row | {"gen_len": 128.0})


def test_a_twin_written_without_the_noisy_flag_is_judged_from_its_recorded_spread():
    """The H200 check's CSV lost the `noisy` column; its step-time CV survives, and the runner's threshold
    (5%) flags the ResNet checkpointing cell (CV 18.9%) and both BERT amp-bf16 cells (6.5-6.6%)."""
    pairs = pairs_from(H200, PROFILES)
    noisy = pairs[pairs["step_time_noisy"]]
    assert sorted(zip(noisy["workload"], noisy["mode"], noisy["technique"], strict=True)) == [
        ("bert", "infer", "amp-bf16"), ("bert", "train", "amp-bf16"), ("resnet50", "train", "checkpointing")]
    shipped = read_ledger().set_index("pair_id")["step_time_noisy"]
    assert (shipped[pairs["pair_id"]].to_numpy() == pairs["step_time_noisy"].to_numpy()).all()
    for written in (False, np.False_, "False"):  # a written flag is kept as written, whatever wrote it
        assert timing_noisy({"noisy": written, "step_time_cv": 0.5}) is False
    assert timing_noisy({"noisy": np.True_, "step_time_cv": 0.0}) is True
    assert timing_noisy({"noisy": None, "step_time_cv": None}) is False


def test_merging_the_same_pairs_twice_adds_them_once():
    pairs = pairs_from(H200, PROFILES)
    assert len(pairs) == 17
    once, added = merge(read_ledger(Path("/nonexistent/ledger.csv")), pairs)
    twice, again = merge(once, pairs)
    assert added == 17 and again == 0 and len(twice) == 17
    # The shipped ledger already holds them (same pair ids), though its projections were refreshed.
    assert merge(read_ledger(), pairs)[1] == 0


def test_an_interval_is_a_prediction_interval_over_cells_of_the_closest_kind():
    cells = [{"size": f"s{i}", "measured_step_ms": m, "projected_step_ms": 10.0} for i, m in enumerate((11., 12., 13.))]
    repeated = [dict(cells[0], allocator=a) for a in ("expandable_segments", "cudaMallocAsync")]
    ledger = _ledger(cells + repeated + [{"size": "x", "measured_step_ms": 30.0, "projected_step_ms": 10.0,
                                           "precision": "fp32"}])
    bar = interval(100.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "hopper")
    assert bar.cells == 3 and "3 cells (gpt bf16-mixed on hopper)" in bar.basis  # repeats of a cell count once
    ratios = np.log([1.1, 1.2, 1.3])
    half = 4.303 * ratios.std(ddof=1) * np.sqrt(1 + 1 / 3)  # Student's t, 2 degrees of freedom
    assert bar.high == pytest.approx(100 * np.exp(ratios.mean() + half))
    assert bar.low == pytest.approx(min(100.0, 100 * np.exp(ratios.mean() - half)))  # the projection stays inside
    # A floor: never narrower than the model's held-out error (log 1.8 = 0.59 is wider than the t half-width
    # 0.41, so the floor, not the spread, sets both ends around the cells' mean).
    assert np.log(1.8) > half
    floored = interval(100.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "hopper",
                       floor=0.8)
    assert floored.high == pytest.approx(100 * np.exp(ratios.mean() + np.log(1.8)))
    assert floored.low == pytest.approx(100 * np.exp(ratios.mean() - np.log(1.8)))
    # Only other generations: the kind says so and, given one, the cross-generation floor (wider still) applies.
    other = interval(100.0, ledger, "measured_step_ms", "projected_step_ms", "gpt", "bf16-mixed", "blackwell",
                     floor=0.8, other_generations_floor=1.0)
    assert other.cells == 3 and "all on hopper: widened" in other.basis
    assert other.high == pytest.approx(100 * np.exp(ratios.mean() + np.log(2.0)))
    assert other.low == pytest.approx(100 * np.exp(ratios.mean() - np.log(2.0)))
    empty = interval(100.0, ledger.iloc[:0], "measured_step_ms", "projected_step_ms", "gpt", "fp32", "hopper")
    assert (empty.low, empty.high, empty.cells) == (100.0 / NO_PAIRS_FACTOR, 100.0 * NO_PAIRS_FACTOR, 0)
    assert "no measured pairs" in empty.basis


def test_the_t_table_matches_scipy():
    from scipy.stats import t

    from harness.ledger import T_975, t_975

    for degrees, value in T_975.items():
        assert value == pytest.approx(t.ppf(0.975, degrees), abs=1e-3)
    assert t_975(11) == T_975[10] >= t.ppf(0.975, 11)  # between rows: the wider one


def test_every_projected_row_carries_its_interval_and_what_it_rests_on():
    cell = Cell("gpt", "gpt2-124m", "train", "amp-bf16", "h200", 8, "projected").resolve(PROFILES)
    row = to_record(cell, project_outcome(cell), "t")
    assert row.step_time_ms_low <= row.step_time_ms_p50 <= row.step_time_ms_high
    assert row.peak_reserved_low_bytes <= row.peak_reserved_bytes <= row.peak_reserved_high_bytes
    # gpt bf16 on hopper has 2 measured cells (train and infer at b8): the next broader kind with 3 is used;
    # its step time leaves out the two BERT cells whose timing is noisy, its peak keeps them.
    assert row.step_time_cells >= 3 and "step time: 4 cells (bf16-mixed on any workload)" in row.interval_basis
    assert "peak reserved: 6 cells (bf16-mixed on any workload)" in row.interval_basis
    # AMD's speed constants were never fitted: its interval is the wide default, and the row says so.
    amd = Cell("bert", "smoke", "train", "baseline", "mi300x", 4, "projected").resolve(PROFILES)
    amd_row = to_record(amd, project_outcome(amd), "t")
    assert amd_row.step_time_cells == 0 and "not fitted for this vendor" in amd_row.interval_basis
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
    # The ledger just written, named; a kind too thin to set an interval alone is marked.
    assert main(["ledger", "show", "--ledger", str(target)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"ledger: {target}\n") and "* fewer than 3 usable cells" in shown


def test_ledger_add_of_results_without_twins_says_so_and_writes_nothing(tmp_path, capsys):
    from harness.records import read_results

    lone = tmp_path / "results.csv"
    frame = read_results(H200)
    frame[frame["source"] == "measured"].to_csv(lone, index=False)
    target = tmp_path / "l.csv"
    assert main(["ledger", "add", str(lone), "--ledger", str(target)]) == 0
    assert "no projected-vs-measured pairs in " in capsys.readouterr().out and not target.exists()
    assert main(["ledger", "add", str(H200), "--ledger", str(tmp_path / "l.txt")]) == 2
    assert "a ledger is a .csv file" in capsys.readouterr().err


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
    # `headroom profiles` shows the overlay was read: what it measured, where and from which file.
    from harness.cli import main

    capsys.readouterr()
    assert main(["profiles", "--profiles", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    under_cpu = listed[next(i for i, line in enumerate(listed) if line.startswith("cpu ")) + 1]
    assert under_cpu.strip().startswith("calibrated ") and str(path) in under_cpu and "TFLOP/s" in under_cpu
    assert not any(line.strip().startswith("calibrated") for line in listed if "cpu.overlay" not in line)


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


@pytest.mark.parametrize("figures, phrase", [
    ('profile = ["cpu"]\n[calibration]\ndevice = "d"\ndate = "now"\n[figures]\n', "field 'profile'"),
    ('profile = "cpu"\n[calibration]\ndevice = "d"\ndate = "now"\n[figures]\nachievable_tflops = 5\n',
     "figures.achievable_tflops"),
    ('profile = "cpu"\n[calibration]\ndevice = "d\\u001b[2J"\ndate = "now"\n[figures]\n', "control characters"),
    ('profile = "cpu"\n[calibration]\ndevice = "d"\ndate = "now"\n[figures]\nachievable_bandwidth_gb_s = 1e-3\n',
     "at least 0.1 GB/s"),
])
def test_a_malformed_overlay_is_one_line_naming_file_and_field(tmp_path, figures, phrase):
    (tmp_path / "cpu.overlay.toml").write_text(figures)
    with pytest.raises(ProfileError, match=re.escape(phrase)) as caught:
        load_profiles(tmp_path)
    assert "cpu.overlay.toml" in str(caught.value) and "\n" not in str(caught.value)


def test_two_overlays_for_one_profile_are_refused(tmp_path):
    text = 'profile = "cpu"\n[calibration]\ndevice = "d"\ndate = "now"\n[figures]\nissue_us = 3.0\n'
    (tmp_path / "a.overlay.toml").write_text(text)
    (tmp_path / "b.overlay.toml").write_text(text)
    with pytest.raises(ProfileError, match="one overlay per profile"):
        load_profiles(tmp_path)


def test_a_fitted_vendor_takes_calibrated_matmul_rates_but_keeps_its_fitted_per_op_constants(tmp_path):
    from harness.project.speed_constants import constants_for

    (tmp_path / "h200.overlay.toml").write_text(
        'profile = "h200"\n[calibration]\ndevice = "NVIDIA H200"\ndate = "now"\n[figures]\n'
        'achievable_tflops = { bf16 = 700.0 }\nachievable_bandwidth_gb_s = 4000.0\nissue_us = 10.0\nkernel_us = 2.0\n')
    calibrated = load_profiles(tmp_path)["h200"]
    assert calibrated.achievable_flops["bf16"] == 700e12
    fitted = constants_for(PROFILES["h200"])
    assert constants_for(calibrated) == fitted  # the fitted issue/kernel constants stay
    cell = Cell("gpt", "gpt2-124m", "train", "amp-bf16", "h200", 8, "projected")
    resolved = cell.resolve(load_profiles(tmp_path))
    slower = to_record(resolved, project_outcome(resolved), "t")
    plain = to_record(cell.resolve(PROFILES), project_outcome(cell.resolve(PROFILES)), "t")
    assert slower.step_time_ms_p50 > plain.step_time_ms_p50  # 700 < 794.5 TFLOP/s measured by MAMF
