"""The paired comparison behind every accuracy verdict (harness/accuracy/stats.py)."""

from __future__ import annotations

import pytest

from harness.accuracy.stats import compare, spread


def test_a_consistent_loss_degrades_and_says_by_how_much():
    result = compare([0.90, 0.91, 0.89], [0.95, 0.96, 0.94], higher_is_better=True, unit="pts")
    assert result.delta == pytest.approx(-0.05)
    assert result.ci95 == pytest.approx(0.0, abs=1e-9)
    assert result.verdict == "degrades by 5.00 pts"


def test_a_change_smaller_than_the_seeds_disagree_is_within_noise():
    result = compare([0.95, 0.90, 0.97], [0.93, 0.94, 0.94], higher_is_better=True, unit="pts")
    assert result.verdict == "within noise"
    assert result.ci95 > abs(result.delta)


def test_lower_is_better_metrics_turn_the_direction_around():
    worse = compare([3.2, 3.3, 3.25], [3.0, 3.1, 3.04], higher_is_better=False, unit="bits/byte")
    assert worse.verdict.startswith("degrades by 0.203 bits/byte")
    better = compare([2.8, 2.9, 2.85], [3.0, 3.1, 3.04], higher_is_better=False, unit="bits/byte")
    assert better.verdict.startswith("improves by")


def test_one_seed_gives_no_verdict_and_unpaired_input_is_refused():
    assert compare([0.9], [0.95], True, "pts").verdict.startswith("no verdict")
    assert spread([0.9]) is None and spread([1.0, 3.0]) == pytest.approx(2 ** 0.5)
    with pytest.raises(ValueError, match="one baseline figure per seed"):
        compare([0.9, 0.8], [0.9], True, "pts")


def test_the_interval_is_students_t_for_the_seeds_given():
    # deltas 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t(0.975, 2) = 4.303
    result = compare([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], True, "pts")
    assert result.ci95 == pytest.approx(4.3027 / 3 ** 0.5, rel=1e-3)
