"""The held-out cross-GPU check: ratios against the reference GPU, the ranking verdict, and that the fit
never reads its data."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from benchmarks import cross_gpu_ratios as ratios

REPO = Path(__file__).resolve().parents[1]


def _frame():
    return pd.DataFrame({"label": ["cfg"] * 3, "gpu": ["ref", "fast", "slow"], "value": [100.0, 200.0, 50.0],
                         "projected_samples_s": [10.0, 30.0, 5.0]})


def test_ratios_are_taken_against_the_reference_gpu_of_the_same_configuration():
    table = ratios.ratio_table(_frame(), "ref").set_index("gpu")
    assert table.loc["fast", "measured_ratio"] == 2.0 and table.loc["fast", "projected_ratio"] == 3.0
    assert abs(table.loc["fast", "error"] - 0.5) < 1e-12 and abs(table.loc["slow", "error"]) < 1e-12
    assert "ref" not in table.index


def test_a_configuration_without_the_reference_gpu_is_left_out():
    assert ratios.ratio_table(_frame(), "elsewhere").empty


def test_the_ranking_verdict_names_a_changed_order():
    frame = _frame()
    assert "same order" in ratios.ranking_agreement(frame)[0]
    frame.loc[frame["gpu"] == "slow", "projected_samples_s"] = 40.0
    assert "ORDER DIFFERS" in ratios.ranking_agreement(frame)[0]


def test_an_unknown_reference_gpu_is_a_one_line_error(capsys):
    assert ratios.main(["--reference", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nope" in err and "a100-sxm4-80gb" in err


def test_the_held_out_rows_are_never_fitted_and_each_names_its_source_gpu():
    calibration = (REPO / "benchmarks/projection_calibration.py").read_text()
    assert ratios.HELD_OUT.name not in calibration
    frame = pd.read_csv(ratios.HELD_OUT)
    assert frame["lambda_name"].str.len().gt(3).all()
    assert (frame.groupby("label")["gpu"].apply(lambda gpus: "a100-sxm4-80gb" in set(gpus))).all()


def test_each_held_out_row_is_projected_at_the_batch_lambda_ran_on_that_gpu():
    # Lambda shrinks the batch to the card's memory (pytorch-train-bs-*.csv): a uniform batch would compare
    # a 24 GB A10 at a batch it never ran, which is how the A10 BERT rows once showed +52%.
    frame = pd.read_csv(ratios.HELD_OUT).set_index(["label", "gpu"])["batch_size"]
    for label in ("ResNet-50 AMP", "BERT-large TF32 s384"):
        assert frame[(label, "a10")] < frame[(label, "a100-pcie-40gb")] < frame[(label, "a100-sxm4-80gb")]
    assert frame[("BERT-large AMP s384", "h100-sxm")] == frame[("BERT-large AMP s384", "a100-sxm4-80gb")] == 112
