"""The calibration script's own logic: published configs applied to the projected program, GPUs ranked per sample."""

from __future__ import annotations

import tomllib
from types import SimpleNamespace

from benchmarks import projection_calibration as calibration
from harness.profiles import load_profiles
from harness.project.speed_constants import CONSTANTS_FILE, constants_for
from harness.project.speed_fit import HeldOut


def test_a_published_config_column_becomes_model_overrides():
    assert calibration.config_overrides("vocab_size=30528;dense_mlm_output=1") == {
        "vocab_size": 30528, "dense_mlm_output": 1}
    assert calibration.config_overrides(float("nan")) == {} and calibration.config_overrides(" ") == {}


def test_the_published_program_is_the_one_projected():
    # NVIDIA's BERT runs its MLM head on the masked positions only: fewer matmul FLOPs than the default model.
    profiles = load_profiles()

    def matmul_flops(config):
        point = calibration._point("x", "g", "bert", "smoke", "baseline", "a100-sxm4-80gb", 4, None, "train",
                                   profiles, 1.0, "test", config=config)
        return float((point.ops.flops * point.ops.count).sum())

    assert matmul_flops({"dense_mlm_output": 1}) < matmul_flops(None)


def _result(gpu, samples, measured_s, projected_s):
    point = SimpleNamespace(label="cfg", gpu=gpu, samples=samples, measured_s=measured_s)
    return HeldOut(point, projected_s)


def test_gpus_measured_at_different_batches_are_ranked_per_sample():
    # a's step (batch 256) takes 3.2x b's (batch 64), yet a is 1.25x faster per sample.
    results = [_result("a", 256, 3.2, 3.0), _result("b", 64, 1.0, 1.1)]
    line, = calibration.ranking_check(results)
    assert line.startswith("cfg: measured a faster than b, projected a faster than b: same order")
    assert "a / b speed-up measured 1.25x, projected 1.47x" in line


def test_the_priors_are_the_hand_written_tables_not_the_last_fit():
    # The priors are speed_constants.toml's tables as written by hand, with speed_fit.toml's values ignored.
    with open(CONSTANTS_FILE, "rb") as handle:
        table = tomllib.load(handle)
    priors = calibration.prior_values(load_profiles(), "a100-sxm4-80gb")
    assert priors["bandwidth_efficiency"] == table["gpu"]["nvidia"]["bandwidth_efficiency"]
    assert priors["issue_python_s"] == table["host"]["issue_python_s"]
    fitted = calibration.values_of(constants_for(load_profiles()["a100-sxm4-80gb"].per_device()))
    assert fitted != priors


def test_constants_on_their_bounds_are_named():
    values = {"unaligned_efficiency": 0.3, "conv_efficiency": 0.93, "attention_efficiency": 0.84,
              "bandwidth_efficiency": 0.6}
    assert [(name, low, high) for name, _, low, high in calibration.at_bounds(values)] == [
        ("attention_efficiency", 0.1, 0.84), ("unaligned_efficiency", 0.3, 1.0)]


def test_a_served_decoders_pair_measured_as_one_forward_is_projected_as_that_forward():
    # The H200 check timed gpt inference as one forward over 1,024 tokens (every position's logits); an
    # inference cell is a generation now, whose prefill and decode steps are another program.
    profiles = load_profiles()
    forward = calibration._point("x", "g", "gpt", "gpt2-124m", "baseline", "h200", 8, 1024, "infer", profiles, 1.0,
                                 "test", one_forward=True)
    generation = calibration._point("x", "g", "gpt", "gpt2-124m", "baseline", "h200", 8, 1024, "infer", profiles,
                                    1.0, "test")
    assert set(forward.ops.phase) == {0}  # the forward phase only
    assert 1 not in set(generation.ops.phase) and len(set(generation.ops.phase)) == 3  # prefill and two decodes
    # The forward's head makes 1,024 positions' logits; the prefill's only the last one's.
    assert (forward.ops.flops * forward.ops.count).sum() > 1.2 * (generation.ops.flops * generation.ops.count).sum()


def test_generation_pairs_are_left_out_of_the_fit_and_counted(monkeypatch, capsys):
    import pandas as pd

    from harness.ledger import COLUMNS

    row = {c: None for c in COLUMNS} | {"workload": "gpt", "size": "gpt2-124m", "mode": "infer",
                                        "technique": "baseline", "gpu": "h200", "batch_size": 8, "seq_len": 896,
                                        "gen_len": 128, "measured_step_ms": 300.0, "step_time_noisy": False}
    monkeypatch.setattr(calibration, "read_ledger", lambda: pd.DataFrame([row], columns=COLUMNS))
    assert calibration.ledger_points(load_profiles()) == []
    assert "1 ledger pairs of whole generations left out of the fit" in capsys.readouterr().out


def test_write_refreshes_every_pair_by_the_group_the_fit_left_out():
    # The refresh looks a pair up by its cell's group: a served decoder's forward pair ("... fwd") included.
    row = {"gpu": "h200", "workload": "gpt", "mode": "infer", "technique": "baseline", "batch_size": 8,
           "seq_len": 1024.0}
    assert calibration.ledger_label(row) == ("gpt infer baseline b8 fwd", "h200 gpt infer baseline b8 fwd s1024.0")
    trained = row | {"mode": "train"}
    assert calibration.ledger_label(trained)[1] == "h200 gpt train baseline b8 s1024.0"
