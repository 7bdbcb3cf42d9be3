"""The decode fit: a served decoder's weights stream at a fitted share of the bandwidth, weight-only int8/int4
matmuls at a fitted share of that; the fit recovers constants it generated data with, and its held-out error
is taken on models the fit did not see."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from benchmarks import decode_calibration
from harness.profiles import load_profiles
from harness.project.decode_fit import (
    STREAM,
    DecodePoint,
    constants_with,
    fit,
    held_out_errors,
    parameter_names,
    projected_tokens_s,
)
from harness.project.roofline import ISSUERS, PHASES, OpArrays, step_time
from harness.project.speed_constants import constants_for, decode_fit_provenance, training_fit_digest
from suites.techniques import parse_stack

PROFILES = load_profiles()
A100 = PROFILES["a100-sxm4-80gb"]


def _decode_ops(phase: str, weight_bytes: float, bits: int) -> OpArrays:
    """One served step's weight read on an A100: a one-row matmul over `weight_bytes` of packed weight."""
    return OpArrays(count=np.array([1.0]), flops=np.array([weight_bytes]), bytes=np.array([weight_bytes]),
                    kernels=np.array([1.0]), phase=np.array([PHASES.index(phase)]),
                    issuer=np.array([ISSUERS.index("inference")]), aligned=np.array([True]), op_class=np.array([0]),
                    fused=np.array([False]), simt=np.array([False]),
                    achievable=np.array([A100.achievable_flops["bf16"]]), datasheet=np.array([A100.peak("bf16")]),
                    sm_count=A100.sm_count, bandwidth=A100.memory_bandwidth_bytes_s, achievable_bandwidth=None,
                    host_is_device=False, streaming=np.array([True]), compiled=True, cuda_graphs=True,
                    weight_bits=np.array([bits]))


def _point(model: str, bits: int, tokens_s: float = 1.0) -> DecodePoint:
    weight = {"small": 13e9, "large": 15e9, "huge": 70e9}[model] * {0: 1.0, 8: 0.5, 4: 0.27}[bits]
    phases = tuple(_decode_ops(phase, weight, bits) for phase in ("prefill", "decode_first", "decode_last"))
    return DecodePoint(f"{model} int{bits}", model, tokens_s, 200, phases, constants_for(A100, decode=None))


TRUTH = {STREAM: 0.7, "int8_weight_stream_share": 0.85, "int4_weight_stream_share": 0.6}


def _measured(points: list[DecodePoint], values: dict[str, float]) -> list[DecodePoint]:
    return [dataclasses.replace(p, tokens_s=projected_tokens_s(p, values)) for p in points]


def test_a_weight_only_decode_streams_its_packed_weight_at_its_share_of_the_stream_rate_and_says_so():
    constants = constants_for(A100, decode=None)
    shared = dataclasses.replace(constants, gpu=dataclasses.replace(constants.gpu, int4_weight_stream_share=0.5))
    int4, bf16 = _decode_ops("decode_first", 4e9, 4), _decode_ops("decode_first", 4e9, 0)
    # The same bytes: an int4 weight-only matmul at half the stream rate takes twice as long; a bf16 one does not.
    assert step_time(int4, shared).memory_s == pytest.approx(2 * step_time(int4, constants).memory_s)
    assert step_time(bf16, shared).memory_s == pytest.approx(step_time(bf16, constants).memory_s)
    notes = step_time(int4, shared).notes
    assert any("int4 weight-only matmuls stream their packed weights at 0.50" in n for n in notes)


def test_the_fit_recovers_the_constants_that_generated_its_points_and_held_out_errors_stay_small():
    points = _measured([_point(m, b) for m in ("small", "large") for b in (0, 8, 4)], TRUTH)
    start = {STREAM: 0.85, "int8_weight_stream_share": 1.0, "int4_weight_stream_share": 1.0}
    assert parameter_names(points) == list(start)
    fitted = fit(points, start)
    for name, value in TRUTH.items():
        assert fitted[name] == pytest.approx(value, rel=1e-3)
    assert max(abs(e) for e in held_out_errors(points, start).values()) < 1e-3


def test_held_out_errors_come_from_a_fit_that_never_saw_the_model():
    points = _measured([_point(m, b) for m in ("small", "large", "huge") for b in (0, 8)], TRUTH)
    # The huge model's published figures are 20% faster than the constants give: in sample the fit spreads
    # that over every row; held out, the huge model's rows keep nearly all of it.
    points = [dataclasses.replace(p, tokens_s=p.tokens_s * (1.2 if p.model == "huge" else 1.0)) for p in points]
    start = {STREAM: 0.85, "int8_weight_stream_share": 1.0}
    in_sample = fit(points, start)
    held = held_out_errors(points, start)
    huge = [p for p in points if p.model == "huge"]
    assert all(held[p.label] < -0.15 for p in huge)
    assert all(-0.15 < projected_tokens_s(p, in_sample) / p.tokens_s - 1 < 0 for p in huge)


def test_a_share_no_point_uses_is_not_fitted_and_keeps_its_prior():
    points = _measured([_point("small", 0), _point("small", 8), _point("large", 0)], TRUTH)
    assert parameter_names(points) == [STREAM, "int8_weight_stream_share"]
    fitted = fit(points, {STREAM: 0.85, "int8_weight_stream_share": 1.0})
    assert set(fitted) == {STREAM, "int8_weight_stream_share"}
    constants = constants_with(points[0], fitted).gpu
    assert constants.int4_weight_stream_share == points[0].constants.gpu.int4_weight_stream_share
    assert constants.stream_bandwidth_efficiency == pytest.approx(TRUTH[STREAM], rel=1e-3)


def test_the_shipped_decode_fit_replaces_the_priors_for_nvidia_only():
    fitted, prior = constants_for(A100).gpu, constants_for(A100, decode=None).gpu
    assert fitted.decode_fitted and not prior.decode_fitted
    assert not constants_for(A100, fitted=None).gpu.decode_fitted  # the training fit's priors carry no decode fit
    assert prior.stream_bandwidth_efficiency == 0.85 and prior.int4_weight_stream_share == 1.0
    # Weight-only kernels stream slower than bf16 matmuls, int4 (tinygemm unpacks nibbles) slowest.
    assert fitted.int4_weight_stream_share < fitted.int8_weight_stream_share < 1.0
    assert decode_fit_provenance()["rows"] >= 6
    mi300x = PROFILES["mi300x"]  # AMD keeps its priors, whatever NVIDIA's decode fit says
    assert constants_for(mi300x) == constants_for(mi300x, decode=None)


def test_the_decode_fit_was_fitted_with_the_training_fit_in_use():
    # The decode fit stands on the training fit's kernel and bandwidth constants: refit it after refitting those.
    assert decode_fit_provenance()["training_fit_digest"] == training_fit_digest(), (
        "speed_fit.toml changed since the decode fit: run python benchmarks/decode_calibration.py --write")


def test_the_published_decodes_name_valid_cells_and_the_fit_rows_one_stated_gpu():
    frame = pd.read_csv(decode_calibration.DATA)
    assert set(frame["set"]) == {"fit", "held-out"}
    assert set(frame.loc[frame["set"] == "fit", "gpu"]) == {"a100-sxm4-80gb"}
    for row in frame.to_dict("records"):
        assert row["gpu"] in PROFILES and "compile" in parse_stack(row["technique"]).name
        assert row["value"] > 0 and row["source"]


def test_a_calibrated_copy_rate_replaces_the_stream_prior_but_not_a_fitted_stream_rate():
    # The fitted rate was fitted against the datasheet bandwidth, with the fitted shares on top of it: a copy
    # rate `headroom calibrate` measured would pair those shares with a rate they were never fitted with.
    copied = dataclasses.replace(_decode_ops("decode_first", 8e9, 0), achievable_bandwidth=1e12)
    fitted, prior = constants_for(A100), constants_for(A100, decode=None)
    assert step_time(copied, prior).memory_s == pytest.approx(8e9 / 1e12)
    stream = A100.memory_bandwidth_bytes_s * fitted.gpu.stream_bandwidth_efficiency
    assert step_time(copied, fitted).memory_s == pytest.approx(8e9 / stream)
