"""Is a technique's accuracy change real or seed noise? A paired t-test over seeds.

Each seed trains the baseline and the technique from the same initialisation and data order (or
applies the technique to that seed's trained baseline), so the per-seed differences are paired: their
mean, and a 95% confidence interval from Student's t with n - 1 degrees of freedom (scipy), decide the
verdict. An interval that holds zero is `within noise`; otherwise the change is stated with its size.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95
TEST_NAME = f"paired t-test over seeds, {CONFIDENCE:.0%} two-sided"


@dataclass(frozen=True)
class Comparison:
    """A technique's metric against the baseline's, seed by seed.

    Attributes:
        delta: mean of (technique - baseline) over seeds, in the metric's units.
        ci95: half-width of the delta's 95% confidence interval (None with a single seed).
        verdict: `within noise`, `degrades by X`, `improves by X`, or why no verdict is possible.
    """

    delta: float
    ci95: float | None
    verdict: str


def spread(values: list[float]) -> float | None:
    """The sample standard deviation of per-seed figures (None for fewer than two)."""
    return statistics.stdev(values) if len(values) > 1 else None


def compare(values: list[float], baseline: list[float], higher_is_better: bool, unit: str) -> Comparison:
    """The paired comparison of `values` with `baseline` (same seeds, same order). `unit` formats the
    size of a change (`pts` for accuracies, given as fractions; `bits/byte`)."""
    if len(values) != len(baseline):
        raise ValueError(f"paired comparison needs one baseline figure per seed: {len(values)} != {len(baseline)}")
    deltas = [v - b for v, b in zip(values, baseline, strict=True)]
    delta = statistics.fmean(deltas)
    if len(deltas) < 2:
        return Comparison(delta, None, "no verdict: one seed gives no noise estimate (use at least 3)")
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, len(deltas) - 1) * statistics.stdev(deltas) / math.sqrt(len(deltas))
    if abs(delta) <= half:
        return Comparison(delta, half, "within noise")
    worse = delta < 0 if higher_is_better else delta > 0
    size = f"{abs(delta) * 100:.2f} pts" if unit == "pts" else f"{abs(delta):.3g} {unit}"
    return Comparison(delta, half, f"{'degrades' if worse else 'improves'} by {size}")
