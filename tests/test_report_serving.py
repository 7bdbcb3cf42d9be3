"""The report's serving answer and table from a serving matrix (reports/serving.py, reports/answer.py): picks at
the report's prices, a replica's GPUs costed together, each speed and cost with its projected range."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.prices import Price
from reports.answer import serving_answers
from tests.test_report_decision import PRICES, _matrix


def test_serving_picks_come_from_the_matrix_at_the_reports_prices():
    prices = {**PRICES, "h100-sxm": Price("h100-sxm", 8.0, "2026-02", "dearer")}
    [answer] = serving_answers(_matrix(), prices)
    assert answer["picks"]["cheapest"]["gpu"] == "a10"  # the b200 row holds no batch: not a pick
    assert answer["picks"]["fastest"]["gpu"] == "h100-sxm" and "150 tokens/s" in answer["picks"]["fastest"]["what"]
    # h100 costed again at twice its price: 0.74 per million tokens, still below the a10's 0.83.
    assert answer["picks"]["value"]["gpu"] == "h100-sxm" and answer["picks"]["value"]["cost"] == "$0.74 / M tokens"
    assert answer["decode"] == "compiled"
    eager = _matrix().assign(technique="bf16-weights")
    assert serving_answers(eager, prices)[0]["decode"] == "eager"


def test_serving_picks_and_table_show_the_projections_range():
    from reports.serving import matrix_section

    # The decode's interval (serve_matrix.py keeps it as factors on the row's speed): x0.8 to x1.25 here.
    matrix = _matrix().assign(speed_factor_low_b1=0.8, speed_factor_high_b1=1.25, speed_factor_low_max=0.8,
                              speed_factor_high_max=1.25)
    [answer] = serving_answers(matrix, PRICES)
    assert answer["picks"]["fastest"]["what"] == "150 (120 - 188) tokens/s for one stream (decode)"
    # A cost is dearest at the slowest speed: $0.37 / 0.8 and / 1.25.
    assert answer["picks"]["value"]["cost"] == "$0.37 ($0.30 - $0.46) / M tokens"
    table = matrix_section(matrix, None)
    assert "3,000 (2,400 - 3,750)" in [cell for row in table["rows"] for cell in row["cells"]]


def test_the_fastest_stream_is_the_one_whose_generation_ends_first_prefill_included():
    # int4 on the a10 decodes faster than bf16 on the h100 here, but its prefill is slow (tinygemm at a prompt's
    # width): over the whole generation the h100 answers first, and is the pick.
    matrix = _matrix().assign(generated_tokens_s_b1=[40.0, 120.0, 200.0])
    matrix.loc[0, "decode_tokens_s_b1"] = 500.0
    [answer] = serving_answers(matrix, PRICES)
    fastest = answer["picks"]["fastest"]
    assert fastest["gpu"] == "h100-sxm", fastest
    assert fastest["what"] == "120 tokens/s for one stream, its prompt's prefill included (decode 150)"
    # Its cost is one stream's (the hour over its 120 tokens a second), not the largest batch's.
    hourly = PRICES["h100-sxm"].per_device
    assert fastest["cost"] == f"${hourly / 3600 / 120 * 1e6:,.2f} / M tokens for one stream"


def test_a_context_past_every_sizes_own_is_not_a_column_of_dashes():
    from harness.cli_serving import _table
    from reports.serving import matrix_section

    matrix = _matrix().assign(max_batch_32k=None)  # gpt-7b's context is 4k: no batch at 32k
    assert "largest batch at 32k" not in matrix_section(matrix, None)["headers"]
    assert "max-batch@32k" not in _table(matrix, "4k").columns
    assert "largest batch at 32k" in matrix_section(matrix.assign(max_batch_32k=2), None)["headers"]


def test_a_tensor_parallel_replica_is_named_by_its_gpus_and_costs_all_their_hours():
    matrix = pd.concat([_matrix(), _matrix().iloc[[0]].assign(gpus=2, usd_per_million_tokens_max=0.5)],
                       ignore_index=True).assign(gpus=lambda m: m["gpus"].fillna(1))
    [answer] = serving_answers(matrix, PRICES)
    assert answer["picks"]["cheapest"]["gpu"] == "a10"  # one a10's hour, not two
    two = matrix[matrix["gpus"] == 2].assign(size="gpt-70b")
    [alone] = serving_answers(two, PRICES)
    assert alone["picks"]["cheapest"]["gpu"] == "2x a10"


def test_the_serving_table_is_costed_at_the_reports_prices():
    from reports.serving import reprice_matrix

    prices = {**PRICES, "h100-sxm": Price("h100-sxm", 8.0, "2026-02", "dearer")}
    repriced = reprice_matrix(_matrix(), prices).set_index("gpu")
    assert repriced.loc["h100-sxm", "usd_per_hour"] == 8.0 and repriced.loc["h100-sxm", "price_date"] == "2026-02"
    assert repriced.loc["h100-sxm", "usd_per_million_tokens_max"] == pytest.approx(0.74)  # twice the price
    assert repriced.loc["h100-sxm", "usd_per_million_tokens_b1"] == pytest.approx(20.0)
    unpriced = reprice_matrix(_matrix(), {}).set_index("gpu")
    assert unpriced["usd_per_million_tokens_max"].isna().all() and unpriced["usd_per_hour"].isna().all()


def test_a_gpu_the_matrix_had_no_price_for_is_costed_at_the_reports_price_from_its_tokens_a_second():
    from reports.serving import reprice_matrix

    # serve-matrix ran without a price for the h100 (no cost), but kept its replica's generated tokens a second.
    matrix = _matrix().assign(generated_tokens_s_max=[300.0, 2700.0, None])
    matrix.loc[matrix["gpu"] == "h100-sxm", ["usd_per_hour", "usd_per_million_tokens_max"]] = None
    prices = {**PRICES, "h100-sxm": Price("h100-sxm", 8.0, "2026-02", "mine")}
    repriced = reprice_matrix(matrix, prices).set_index("gpu")
    assert repriced.loc["h100-sxm", "usd_per_million_tokens_max"] == pytest.approx(8.0 / 3600 / 2700 * 1e6)
    # A two-GPU replica rents both GPUs' hours.
    pair = reprice_matrix(matrix.assign(gpus=2), prices).set_index("gpu")
    assert pair.loc["h100-sxm", "usd_per_million_tokens_max"] == pytest.approx(2 * 8.0 / 3600 / 2700 * 1e6)
    [answer] = serving_answers(matrix, prices)
    assert answer["picks"]["value"]["cost"] == f"${8.0 / 3600 / 2700 * 1e6:.2f} / M tokens"
