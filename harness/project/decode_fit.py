"""Fitting how fast a served decoder streams its weights, on published one-row decodes, and judging it on
decodes the fit did not see.

A one-row decode step reads every weight once and does little else, so its time is its bytes over the rate
it streams them at: `stream_bandwidth_efficiency` of the datasheet bandwidth for a bf16 weight, and a share
of that for a weight-only int8 or int4 matmul, whose kernel unpacks and scales each element on the way (one
set per vendor: the published decodes that say which GPU ran them are all A100s).
The attention streams its KV cache at the same rate (the published decodes' caches are short: about 200
tokens, so long-cache reads were never judged); the rest of the step (launches, the fused elementwise
kernels) keeps the training fit's constants. A point is one published decode throughput with its traced phases; the fit
minimises the squared log error of tokens/s with SciPy's bounded least squares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from harness.project.roofline import OpArrays, step_time
from harness.project.speed_constants import SpeedConstants

# (constant, lower bound, upper bound): what a kernel can physically reach. Streaming shares above 1 would
# read a weight faster than a bf16 matmul reads one of the same bytes.
SHARES = (("int8_weight_stream_share", 0.2, 1.0), ("int4_weight_stream_share", 0.2, 1.0))
STREAM_BOUNDS = (0.3, 0.95)
STREAM = "stream_bandwidth_efficiency"


@dataclass(frozen=True)
class DecodePoint:
    """One published decode throughput (tokens/s over a whole generation, prefill included, as gpt-fast
    and torchao's generate.py time it) and its cell's ops: the prefill, the first and the last decode step."""

    label: str
    model: str        # the model it decodes: points of one model leave the fit together
    tokens_s: float
    gen_len: int
    phases: tuple[OpArrays, OpArrays, OpArrays]
    constants: SpeedConstants  # the constants in use for its GPU, decode terms at their priors


def parameter_names(points: list[DecodePoint]) -> list[str]:
    """The constants `points` inform: the streaming efficiency, and each weight-only share a point's
    weights use."""
    bits = {int(b) for p in points for ops in p.phases[1:] if ops.weight_bits is not None for b in ops.weight_bits}
    return ([STREAM] if points else []) + [name for name, _, _ in SHARES if int(name[3]) in bits]


def constants_with(point: DecodePoint, values: dict[str, float]) -> SpeedConstants:
    """`point`'s constants with the fitted decode terms in `values` (the others keep theirs)."""
    changes = {name: values[name] for name in (STREAM, *(n for n, _, _ in SHARES)) if name in values}
    return replace(point.constants, gpu=replace(point.constants.gpu, **changes))


def projected_tokens_s(point: DecodePoint, values: dict[str, float]) -> float:
    """Tokens per second over the generation: the prefill, then gen_len - 1 steps whose times grow
    linearly from the first to the last (harness/project/serving.py)."""
    constants = constants_with(point, values)
    prefill, first, last = (step_time(ops, constants).step_s for ops in point.phases)
    return point.gen_len / (prefill + (point.gen_len - 1) * (first + last) / 2)


def fit(points: list[DecodePoint], start: dict[str, float]) -> dict[str, float]:
    """The decode constants (names from `start`) minimising the squared log error of tokens/s over `points`."""
    names = list(start)
    bounds = {STREAM: STREAM_BOUNDS, **{n: (lo, hi) for n, lo, hi in SHARES}}
    lower = np.array([bounds[n][0] for n in names])
    upper = np.array([bounds[n][1] for n in names])

    def residuals(x: np.ndarray) -> np.ndarray:
        values = dict(zip(names, x, strict=True))
        return np.array([np.log(projected_tokens_s(p, values) / p.tokens_s) for p in points])

    x0 = np.clip([start[n] for n in names], lower, upper)
    result = least_squares(residuals, x0, bounds=(lower, upper))
    return dict(zip(names, (float(v) for v in result.x), strict=True))


def held_out_errors(points: list[DecodePoint], start: dict[str, float]) -> dict[str, float]:
    """Per point, its error (projected / published - 1) under a fit on the other models' points only; a point
    whose weight format no other model informs keeps the prior for that share."""
    errors = {}
    for model in sorted({p.model for p in points}):
        others = [p for p in points if p.model != model]
        informed = set(parameter_names(others))
        fitted = fit(others, {n: v for n, v in start.items() if n in informed}) if others else {}
        for point in (p for p in points if p.model == model):
            errors[point.label] = projected_tokens_s(point, fitted) / point.tokens_s - 1
    return errors
