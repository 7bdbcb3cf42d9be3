"""Measured speed figures agree with each other: throughput is the batch over the mean step time of
the same timed steps as the percentiles, and a cell whose mean and median disagree is flagged noisy
and kept out of the projection's step-time error."""

from __future__ import annotations

import pytest

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.measure.timing import Timing
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.records import DEFAULT_NOISE_THRESHOLD
from harness.twins import twin_errors


def _timing(steps_ms: list[float], repeats: int = 2) -> Timing:
    step_s = tuple(ms / 1e3 for ms in steps_ms)
    per = len(step_s) // repeats
    return Timing(step_s, tuple(sum(step_s[i * per:(i + 1) * per]) for i in range(repeats)), per)


def test_throughput_is_the_batch_over_the_mean_step_of_the_timed_loops():
    timing = _timing([10.0] * 9 + [20.0] + [10.0] * 10)
    assert timing.mean_ms == pytest.approx(10.5)
    assert timing.throughput(4) == pytest.approx(4 / 0.0105)
    assert timing.percentile_ms(0.5) == pytest.approx(10.0)


def test_a_few_slow_steps_that_pull_the_mean_off_the_median_make_the_cell_noisy():
    # The newcomer's row: p50 ~1 ms but 215 samples/s at batch 4 (mean ~18.6 ms): a handful of huge steps.
    tail = _timing([1.0] * 18 + [170.0, 170.0])
    assert tail.skew > 10 and tail.noisy(DEFAULT_NOISE_THRESHOLD)
    quiet = _timing([10.0, 10.2, 9.9, 10.1, 10.0, 10.3, 9.8, 10.0, 10.1, 10.0] * 2)
    assert abs(quiet.skew) < 0.01 and not quiet.noisy(DEFAULT_NOISE_THRESHOLD)


def test_a_measured_row_states_one_consistent_story():
    cell = Cell("gpt", "smoke", "train", "baseline", "cpu", 4).resolve(load_profiles())
    row = to_record(cell, measure(cell, MeasureSettings(warmup=2, steps=10, repeats=3)), "t")
    assert row.status == "ok", row.reason
    assert row.throughput_samples_s * row.step_time_ms_mean / 1e3 == pytest.approx(row.batch_size, rel=1e-12)
    assert row.step_time_ms_p50 <= row.step_time_ms_p90
    skew = row.step_time_ms_mean / row.step_time_ms_p50 - 1
    assert row.noisy == (row.step_time_cv > DEFAULT_NOISE_THRESHOLD or abs(skew) > 2 * DEFAULT_NOISE_THRESHOLD)


def test_a_noisy_twin_has_no_step_time_to_check_the_projection_against():
    projected = {"peak_allocated_bytes": 110, "peak_reserved_bytes": None, "step_time_ms_p50": 8.0}
    measured = {"peak_allocated_bytes": 100, "peak_reserved_bytes": None, "step_time_ms_p50": 10.0,
                "allocator": None}
    assert twin_errors(projected, {**measured, "noisy": False})["step_time_error_vs_measured"] == pytest.approx(-0.2)
    errors = twin_errors(projected, {**measured, "noisy": True})
    assert errors["step_time_error_vs_measured"] is None
    assert errors["peak_error_vs_measured"] == pytest.approx(0.1)  # memory is not timing: still compared
