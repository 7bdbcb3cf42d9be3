"""The guide's claims judged on a report's rows (reports/claims.py): what each verdict rests on, and that a claim
the rows cannot test says so rather than guessing."""

from __future__ import annotations

from harness.records import records_frame
from reports.claims import judge_claims
from tests.test_report_decision import CAPACITIES, GIB, _row


def _claims(*rows) -> dict:
    return {c["id"]: c for c in judge_claims(records_frame(list(rows)), CAPACITIES)}


def test_c2_explains_the_bytes_it_found_and_judges_fp16_parameters_on_mixed_precision_rows():
    # Projected amp-bf16 rows: fp32 master weights (4 B/param) and AdamW at 8 B/param.
    c2 = _claims(_row())["C2"]
    assert c2["verdict"] == ("contradicted: Adam's state is 2.0x smaller than stated; FP16 parameters at 2 B/param: "
                             "not in mixed-precision training (4.0 B/param)")
    assert "(two fp32 moments)" in c2["found"] and "fp32 master weights" in c2["found"]
    assert c2["rows"] == "1 projected training rows (baseline, amp-*)"
    # Were the state 16 B/param, the claim would hold and the page would not explain it away.
    held = _claims(_row(optimizer_bytes=16_000_000))["C2"]
    assert held["verdict"].startswith("supported;") and "not Adam's" not in held["found"]
    assert _claims(_row(optimizer_bytes=32_000_000))["C2"]["verdict"].startswith(
        "contradicted: Adam's state is 2.0x larger")


def test_c3_says_what_its_row_lacks_instead_of_judging_it():
    big = dict(size="gpt3-175b", param_count=175_000_000_000, params_bytes=700e9, batch_size=8)
    c3 = _claims(_row(**big, optimizer_bytes=None, activations_bytes=None))["C3"]
    assert c3["verdict"].startswith("contradicted: parameters 2.00x the stated")
    assert "optimizer state, activations at batch 1024 not measurable" in c3["verdict"] and "nan" not in c3["verdict"]
    assert "the total" not in c3["verdict"]  # unknown without the optimizer's and the activations' bytes


def test_c3_scales_only_the_activations_that_grow_with_the_batch():
    # Autocast's 16-bit weight copies (2 B/param) sit in a mixed-precision row's activations at any batch:
    # 350 GB of copies + 80 GB per sample at batch 1 is 350 GB + 1024 x 80 GB at batch 1024, not 1024 x 430 GB.
    big = dict(size="gpt3-175b", param_count=175_000_000_000, params_bytes=700e9, optimizer_bytes=1400e9,
               batch_size=1, activations_bytes=430e9)
    c3 = _claims(_row(**big))["C3"]
    at_1024 = 350e9 + 1024 * 80e9
    assert f"{at_1024 / 1e12:,.0f} TB scaled linearly" in c3["found"] and "350 GB of them autocast's" in c3["found"]
    assert f"activations at batch 1024 {at_1024 / 500e9:,.0f}x the stated" in c3["verdict"]
    total = 700e9 + 1400e9 + 4_000_000 + at_1024  # the row's gradients: _row's 4 MB
    assert c3["verdict"].endswith(f"the guide's 'more than 3 TB in total' holds: {total / 1e12:,.0f} TB here, "
                                  f"{at_1024 / total:.0%} of it activations")
    fp32 = _claims(_row(**big, technique="baseline", precision="fp32"))["C3"]  # fp32 weights are not copied
    assert f"{1024 * 430e9 / 1e12:,.0f} TB scaled linearly" in fp32["found"] and "copies" not in fp32["found"]


def test_c8_pairs_accumulation_with_a_baseline_of_its_own_source():
    accumulated = _row(gpu="h100-sxm", technique="grad-accumulation", batch_size=8, source="measured",
                       peak_reserved_bytes=int(2.2 * GIB))
    projected_micro = _row(gpu="h100-sxm", technique="baseline", batch_size=2, peak_reserved_bytes=2 * GIB)
    assert _claims(accumulated, projected_micro)["C8"]["rows"] == "none"  # measured against projected: no pair
    measured_micro = dict(projected_micro, source="measured")
    c8 = _claims(accumulated, measured_micro)["C8"]
    assert c8["rows"] == "1 measured pairs" and c8["verdict"] == "supported" and "+10%" in c8["found"]


def test_c11_says_tensor_parallelism_splits_weights_only_where_rank_rows_show_it():
    assert "not in these rows" in _claims(_row())["C11"]["verdict"]
    whole = _row(technique="baseline", size="gpt2-124m", source="measured", params_bytes=500_000_000)
    rank = dict(whole, technique="tensor-parallel", world_size=2, rank=0)
    assert "does split the sharded weights" in _claims(whole, dict(rank, params_bytes=300_000_000))["C11"]["verdict"]
    assert "not a split" in _claims(whole, dict(rank, params_bytes=500_000_000))["C11"]["verdict"]


def test_c14_and_c15_judge_what_the_rows_hold():
    assert "no multi-GPU cells in these results" in _claims(_row())["C14"]["verdict"]
    sharded = _row(technique="fsdp+amp-bf16", world_size=8)
    assert "1 multi-GPU cells in these results" in _claims(_row(), sharded)["C14"]["verdict"]
    # A measured A100 row and the projected H100's: the A100's projected twin is what the H100 is set against.
    a100 = dict(gpu="a100-sxm4-80gb", usd_per_million_samples=1.0)
    rows = [_row(**a100, source="measured", throughput_samples_s=10.0),
            _row(**a100, throughput_samples_s=20.0),
            _row(gpu="h100-sxm", throughput_samples_s=40.0, usd_per_million_samples=1.5)]
    c15 = _claims(*rows)["C15"]
    assert "h100-sxm runs x2.00 as fast as a100-sxm4-80gb" in c15["found"] and "1 projected cells" in c15["found"]
    assert c15["rows"] == "projected cells on both GPUs"
    assert c15["verdict"] == "train contradicted: h100-sxm faster (guide: A100 80GB better)"
    rows[2] = _row(gpu="h100-sxm", throughput_samples_s=20.8, usd_per_million_samples=1.5)
    assert _claims(*rows)["C15"]["verdict"] == "train: neither (within 5%; guide: A100 80GB better)"
    rows[2] = _row(gpu="h100-sxm", throughput_samples_s=None)
    assert _claims(*rows)["C15"]["verdict"] == "train: not measurable (no speed on both GPUs)"


def test_a_ratio_claim_judged_on_projections_alone_says_so():
    resnet = dict(workload="resnet50", size="resnet50", batch_size=32)
    base = _row(**resnet, technique="baseline", peak_reserved_bytes=10 * GIB, step_time_ms_p50=30.0)
    amp = _row(**resnet, technique="amp-fp16", peak_reserved_bytes=6 * GIB, step_time_ms_p50=20.0)
    assert _claims(base, amp)["C5"]["verdict"] == "supported (projected only)"
    measured = [dict(row, source="measured") for row in (base, amp)]
    assert _claims(*measured)["C5"]["verdict"] == "supported"


def test_c14_counts_a_bucket_that_agrees_on_part_of_the_guides_stack_as_partial():
    c14 = _claims(_row(usd_per_million_samples=1.0))["C14"]  # <1B, amp-bf16 without checkpointing wins
    assert c14["verdict"].startswith("partly supported: 0 of 1 buckets agree, 1 partly")
    both = _claims(_row(technique="amp-bf16+checkpointing", usd_per_million_samples=1.0))["C14"]
    assert both["verdict"].startswith("supported: 1 of 1 buckets agree;")
    assert _claims(_row(technique="baseline", precision="fp32"))["C14"]["verdict"].startswith("contradicted: 0 of 1")


def test_c16_rules_out_80_percent_only_where_enough_cells_do():
    gpus = ["t4", "a10", "l4", "a100-pcie-40gb", "a100-sxm4-80gb", "h100-sxm", "h200", "l40s", "b200", "mi300x"]
    rows = [row for gpu in gpus for row in (_row(gpu=gpu, technique="baseline", status="oom", fits=False),
                                            _row(gpu=gpu, technique="amp-bf16", status="oom", fits=False),
                                            _row(gpu=gpu, technique="checkpointing"))]
    # 0 of 10 cells made to fit by mixed precision or sharing alone: 80% lies outside the interval.
    assert _claims(*rows)["C16"]["verdict"].startswith("contradicted: 0% of 10 cells (95% interval 0%-31%), not 80%")
    assert _claims(*rows[:3])["C16"]["verdict"].startswith("inconclusive: 0% of 1 cells")
    # Where mixed precision was never tried alone, the cells say nothing about it, and what to add is named.
    untried = [row for row in rows if row["technique"] != "amp-bf16"]
    c16 = _claims(*untried)["C16"]
    assert c16["verdict"] == "not measurable here" and "add one of them to --technique" in c16["found"]
    # Nor where it was asked for but could not run (no bf16 on a T4): unsupported is not "tried and short".
    refused = [dict(row, status="unsupported", fits=None) if row["technique"] == "amp-bf16" else row for row in rows]
    assert _claims(*refused)["C16"]["verdict"] == "not measurable here"
