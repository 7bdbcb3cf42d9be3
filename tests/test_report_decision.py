"""The report's decision sections (reports/answer.py, tradeoffs.py, advice.py, claims.py): picks among the
cells that fit, the fit matrix, the Pareto front, advice for OOM cells, the guide's claims judged, and a
reader's test: from the page alone, which GPU to fine-tune gpt2-1.3b on and to serve a 7B model on, and
at what cost per million tokens."""

from __future__ import annotations

from html.parser import HTMLParser

import pandas as pd
import pytest

from harness.prices import Price, cost_rows
from harness.profiles import load_profiles
from harness.records import Record, records_frame
from reports.advice import oom_advice
from reports.answer import answers
from reports.build import capacities_of, render
from reports.claims import CLAIMS, _from_text, judge_claims
from reports.tradeoffs import fit_matrices, memory_sections

GIB = 2**30
PROFILES = load_profiles()
CAPACITIES = capacities_of(PROFILES)
PRICES = {"a10": Price("a10", 0.9, "2026-01", "test"), "h100-sxm": Price("h100-sxm", 4.0, "2026-01", "test"),
          "b200": Price("b200", 6.0, "2026-01", "test")}


def _row(**kw) -> dict:
    base = dict(run_id="r", workload="gpt", size="gpt2-1.3b", mode="train", technique="amp-bf16", gpu="a10",
                source="projected", status="ok", reason="", notes="", batch_size=4, seq_len=2048, world_size=1,
                precision="bf16-mixed", param_count=1_000_000, params_bytes=4_000_000, grads_bytes=4_000_000,
                optimizer_bytes=8_000_000, activations_bytes=GIB, temporaries_bytes=0, peak_allocated_bytes=2 * GIB,
                peak_reserved_bytes=3 * GIB, device_overhead_bytes=512 * 2**20)
    base.update(kw)
    if base["status"] == "ok" and "fits" not in kw and base["source"] == "projected":
        base["fits"] = True
    return Record(**base).to_dict()


def _frame() -> pd.DataFrame:
    rows = [
        _row(gpu="a10", throughput_samples_s=10.0, step_time_ms_p50=400.0, step_time_ms_low=200.0,
             step_time_ms_high=800.0),
        _row(gpu="h100-sxm", throughput_samples_s=50.0, step_time_ms_p50=80.0),
        _row(gpu="h100-sxm", technique="baseline", status="oom", fits=False, peak_reserved_bytes=90 * GIB,
             peak_allocated_bytes=89 * GIB),
        _row(gpu="b200", technique="baseline", source="measured", throughput_samples_s=100.0, step_time_ms_p50=40.0,
             step_time_cv=0.05),
        _row(gpu="b200", technique="baseline", throughput_samples_s=200.0, step_time_ms_p50=20.0),  # its twin
        _row(gpu="b200", technique="checkpointing", throughput_samples_s=80.0, step_time_ms_p50=50.0,
             peak_reserved_bytes=2 * GIB, peak_allocated_bytes=GIB),
        _row(gpu="b200", technique="grad-accumulation", throughput_samples_s=60.0, step_time_ms_p50=66.0,
             peak_reserved_bytes=int(2.5 * GIB)),  # bigger and slower than checkpointing: off the front
    ]
    return cost_rows(records_frame(rows), PRICES)


def test_the_picks_are_the_cheapest_hour_the_fastest_and_the_best_value():
    [answer] = answers(_frame(), CAPACITIES)
    picks = answer["picks"]
    assert picks["cheapest"]["gpu"] == "a10"
    # The measured b200 cell replaces its projected twin (200 samples/s): 100 samples/s, with its noise.
    assert picks["fastest"]["gpu"] == "b200" and picks["fastest"]["source"] == "measured"
    assert picks["fastest"]["speed"].startswith("204,800 tokens/s (194,560 - 215,040, run-to-run noise)")
    # USD per million samples: a10 0.9/10, h100 4/50, b200 6/100 (per hour over samples per second).
    assert picks["value"]["gpu"] == "b200" and picks["value"]["stack"] == "baseline"
    # The projected a10 pick carries its interval: a step of 200-800 ms around 400 is 5-20 samples/s.
    assert "(10,240 - 40,960, projection interval)" in picks["cheapest"]["speed"]
    assert picks["cheapest"]["price"] == "$0.90/h, 2026-01"
    assert answer["fitting"] == 5 and answer["tried"] == 7


def test_a_sure_fit_is_picked_before_one_that_may_not_fit_and_unpriced_gpus_are_named():
    # The a10 is cheaper by the hour but its interval reaches past its memory: the b200, sure to fit, is picked;
    # the h200 fits with no price to rank it, and is named rather than silently left out.
    rows = [_row(gpu="a10", throughput_samples_s=10.0, peak_reserved_high_bytes=CAPACITIES["a10"]),
            _row(gpu="b200", throughput_samples_s=100.0, peak_reserved_high_bytes=4 * GIB),
            _row(gpu="h200", throughput_samples_s=90.0)]
    [answer] = answers(cost_rows(records_frame(rows), PRICES), CAPACITIES)
    assert answer["picks"]["cheapest"]["gpu"] == "b200" and answer["unpriced"] == ["h200"]
    # The a10 passed over is named beside the pick, with why, so the pick is not read as the cheapest there is.
    assert answer["picks"]["cheapest"]["passed"] == ("cheaper: a10 with amp-bf16 ($0.90 an hour), but it may not "
                                                     "fit: its interval reaches 512.0 MiB past the memory")
    assert answer["picks"]["fastest"]["gpu"] == "b200" and answer["picks"]["fastest"]["passed"] == ""
    # Where only an uncertain fit exists, it is still the answer, flagged.
    [alone] = answers(cost_rows(records_frame(rows[:1]), PRICES), CAPACITIES)
    assert alone["picks"]["cheapest"]["gpu"] == "a10" and "may not fit" in alone["picks"]["cheapest"]["left"]


def test_a_pick_among_many_within_its_range_says_there_is_no_clear_winner_and_what_its_range_rests_on():
    rows = [_row(gpu="a10", technique=t, throughput_samples_s=10.0 + i, step_time_ms_p50=400.0, step_time_ms_low=200.0,
                 step_time_ms_high=800.0, step_time_cells=12,
                 interval_basis="step time: 12 cells (gpt bf16-mixed on hopper); peak reserved: 14 cells (gpt)")
            for i, t in enumerate(["amp-bf16", "checkpointing", "baseline", "amp-fp16", "grad-accumulation", "lora"])]
    fastest = answers(cost_rows(records_frame(rows), PRICES), CAPACITIES)[0]["picks"]["fastest"]
    assert fastest["ties"] == "5 others too close to call: no clear winner at this error bar (measured twins narrow it)"
    assert fastest["speed"].endswith(", projection interval)")
    assert fastest["basis"] == "12 cells (gpt bf16-mixed on hopper)"
    few = answers(cost_rows(records_frame(rows[:2]), PRICES), CAPACITIES)[0]["picks"]["fastest"]
    assert few["ties"] == "1 other too close to call"
    measured = [dict(row, source="measured", step_time_cv=0.5) for row in rows]
    noisy = answers(cost_rows(records_frame(measured), PRICES), CAPACITIES)[0]["picks"]["fastest"]
    assert noisy["ties"].endswith("(more repeats narrow it)")


def test_projections_sharing_one_fit_tie_only_within_its_held_out_ratio_error():
    # Wide intervals (x2 either way) overlap, but a projection's error moves both GPUs together: what is in doubt is
    # their ratio, off by at most 25% on held-out GPU pairs here. 1.2x apart is a tie; 2x apart is a verdict.
    wide = dict(step_time_ms_p50=100.0, step_time_ms_low=50.0, step_time_ms_high=200.0)
    rows = [_row(gpu="h100-sxm", throughput_samples_s=200.0, **wide),
            _row(gpu="a10", throughput_samples_s=100.0, **wide), _row(gpu="b200", throughput_samples_s=240.0, **wide)]
    frame = cost_rows(records_frame(rows), PRICES)
    shared = {"h100-sxm": "nvidia", "a10": "nvidia", "b200": "nvidia"}
    fastest = answers(frame, CAPACITIES, shared, 0.25)[0]["picks"]["fastest"]
    assert fastest["gpu"] == "b200" and fastest["ties"] == "1 other too close to call"  # the h100, not the a10
    assert answers(frame, CAPACITIES)[0]["picks"]["fastest"]["ties"] == "2 others too close to call"  # overlap alone
    # A GPU costed by other constants (another vendor's, or priors) is judged by its range, as before.
    apart = answers(frame, CAPACITIES, {"h100-sxm": "nvidia", "b200": "nvidia"}, 0.25)[0]["picks"]["fastest"]
    assert apart["ties"] == "2 others too close to call"
    # Two stacks on one GPU are not a GPU-to-GPU ratio: judged by their ranges.
    stacks = [_row(gpu="h100-sxm", technique=t, throughput_samples_s=v, **wide)
              for t, v in (("amp-bf16", 200.0), ("baseline", 100.0))]
    same = answers(cost_rows(records_frame(stacks), PRICES), CAPACITIES, shared, 0.25)[0]["picks"]["fastest"]
    assert same["ties"] == "1 other too close to call"


def test_the_ratio_rule_covers_the_generations_the_ratio_check_measured():
    from reports.build import fitted_keys

    keys = fitted_keys(PROFILES, ["a100-sxm4-80gb", "h100-sxm"])  # Ampere and Hopper
    assert keys["a10"] == keys["h200"] == "nvidia"
    assert "t4" not in keys and "b200" not in keys and "mi300x" not in keys  # Turing, Blackwell; AMD is not fitted


def test_what_an_interval_rests_on_is_told_once_under_the_table_not_in_every_pick():
    from reports.answer import number_bases

    basis = "step time: 12 cells (gpt bf16-mixed on hopper)"
    rows = [_row(gpu=gpu, throughput_samples_s=speed, step_time_ms_p50=100.0, step_time_ms_low=80.0,
                 step_time_ms_high=120.0, interval_basis=basis) for gpu, speed in (("a10", 10.0), ("b200", 90.0))]
    listed = answers(cost_rows(records_frame(rows), PRICES), CAPACITIES)
    assert number_bases(listed) == ["12 cells (gpt bf16-mixed on hopper)"]
    picks = listed[0]["picks"]
    assert {picks[name]["note"] for name in ("cheapest", "fastest", "value")} == {1}
    assert "12 cells" not in picks["fastest"]["speed"]


def test_a_size_keeps_its_colour_from_one_cost_chart_to_the_next():
    from reports.answer import cost_charts

    rows = [_row(size="gpt2-1.3b", param_count=1_300_000_000, throughput_samples_s=10.0),
            _row(size="gpt-7b", param_count=7_000_000_000, throughput_samples_s=2.0),
            _row(size="gpt-7b", param_count=7_000_000_000, mode="infer", throughput_samples_s=5.0)]
    train, infer = cost_charts(cost_rows(records_frame(rows), PRICES), CAPACITIES)
    # tab10's second colour for the second-smallest model, in the chart without the smallest too.
    assert "#ff7f0e" in train["svg"] and "#ff7f0e" in infer["svg"] and "#1f77b4" not in infer["svg"]


def test_the_markdown_answer_says_what_its_intervals_rest_on_as_the_page_does():
    from reports.markdown import answer_markdown

    basis = "step time: 12 cells (gpt bf16-mixed on hopper)"
    row = _row(gpu="a10", throughput_samples_s=10.0, step_time_ms_p50=100.0, step_time_ms_low=80.0,
               step_time_ms_high=120.0, interval_basis=basis)
    text = "\n".join(answer_markdown(records_frame([row]), PROFILES, PRICES))
    assert "projection interval) (interval: 12 cells (gpt bf16-mixed on hopper))" in text


def test_a_price_over_a_year_old_is_flagged_in_its_pick():
    stale = {"a10": Price("a10", 0.9, "2020-01", "test")}
    [answer] = answers(cost_rows(records_frame([_row(gpu="a10", throughput_samples_s=10.0)]), stale), CAPACITIES)
    assert answer["picks"]["cheapest"]["price"].startswith("$0.90/h, 2020-01; ")
    assert answer["picks"]["cheapest"]["price"].endswith(" years old: re-check, prices have moved since")


def test_nothing_fits_is_said():
    frame = cost_rows(records_frame([_row(gpu="a10", status="oom", fits=False)]), PRICES)
    [answer] = answers(frame, CAPACITIES)
    assert answer["picks"] == {"cheapest": None, "fastest": None, "value": None}


def test_the_fit_matrix_counts_fitting_cells():
    [matrix] = fit_matrices(_frame(), CAPACITIES)
    assert matrix["judged"] == 6 and matrix["fits"] == 5 and "<svg" in matrix["svg"]
    # Each row names its batch, and the same stack at another batch is a row of its own.
    larger = [_row(gpu="a10"), _row(gpu="a10", batch_size=64, status="oom", fits=False, peak_reserved_bytes=30 * GIB)]
    larger = cost_rows(records_frame(larger), PRICES)
    [matrix] = fit_matrices(larger, CAPACITIES)
    assert matrix["judged"] == 2 and matrix["fits"] == 1
    assert "gpt2-1.3b b4 / amp-bf16" in matrix["svg"] and "gpt2-1.3b b64 / amp-bf16" in matrix["svg"]


def test_a_cell_that_fits_only_below_the_high_end_of_its_interval_is_marked_as_may_not_fit():
    edge = _row(gpu="a10", throughput_samples_s=10.0, peak_reserved_high_bytes=CAPACITIES["a10"])
    frame = cost_rows(records_frame([edge]), PRICES)
    [matrix] = fit_matrices(frame, CAPACITIES)
    assert matrix["fits"] == 1 and matrix["marginal"] == 1 and "may not fit" in matrix["svg"]
    [answer] = answers(frame, CAPACITIES)
    assert answer["picks"]["cheapest"]["left"].endswith("left, but may not fit: its interval reaches 512.0 MiB "
                                                        "past the memory")  # the CUDA context's 512 MiB
    # A projection that fits only because the allocator frees its cache (reserved above the room, live bytes
    # below it) may not fit by how far the interval reaches above reserved, not by the whole reserved figure.
    freed = cost_rows(records_frame([dict(edge, peak_reserved_bytes=CAPACITIES["a10"],
                                          peak_reserved_high_bytes=CAPACITIES["a10"] + 2**20)]), PRICES)
    assert fit_matrices(freed, CAPACITIES)[0]["marginal"] == 0
    roomy = cost_rows(records_frame([dict(edge, peak_reserved_high_bytes=4 * GIB)]), PRICES)
    assert fit_matrices(roomy, CAPACITIES)[0]["marginal"] == 0
    assert answers(roomy, CAPACITIES)[0]["picks"]["cheapest"]["left"].endswith("GiB left")


def test_the_pareto_chart_folds_coincident_stacks_and_reads_language_models_in_tokens():
    from reports.charts import _merged

    points = [{"label": "amp-bf16", "memory": 100.0, "speed": 50.0, "front": True},
              {"label": "amp-fp16", "memory": 100.5, "speed": 50.2, "front": False},
              {"label": "baseline", "memory": 200.0, "speed": 40.0, "front": False}]
    assert [(p["label"], p["front"]) for p in _merged(points)] == [("amp-bf16, amp-fp16", True), ("baseline", False)]
    frame = _frame().assign(tokens_per_s=lambda f: f["throughput_samples_s"] * 2048)
    [section] = memory_sections(frame, CAPACITIES)
    assert "tokens/s" in section["pareto"]["svg"] and "samples/s" not in section["pareto"]["svg"]
    [plain] = memory_sections(_frame(), CAPACITIES)  # no tokens column: samples
    assert "samples/s" in plain["pareto"]["svg"]


def test_the_pareto_chart_starts_both_axes_at_zero(monkeypatch):
    from reports import charts

    drawn = {}

    def keep(figure):
        drawn["axis"] = figure.axes[0]
        return "<svg/>"

    monkeypatch.setattr(charts, "svg_of", keep)
    charts.pareto_scatter([{"label": "a", "memory": 50 * GIB, "speed": 55_000.0, "front": True},
                           {"label": "b", "memory": 60 * GIB, "speed": 60_000.0, "front": True}], "t")
    assert drawn["axis"].get_xlim()[0] == 0 and drawn["axis"].get_ylim()[0] == 0


def test_the_pareto_front_holds_the_stacks_no_other_beats_on_both():
    [section] = memory_sections(_frame(), CAPACITIES)
    assert "b200" in section["title"] and section["why"] == "drawn for the GPU these gpt2-1.3b cells were measured on"
    # The b200's memory is drawn as a line: a bar past it does not fit.
    assert f"GPU memory ({CAPACITIES['b200'] / GIB:,.0f} GiB)" in section["svg"]
    projected = _frame()[lambda f: f["source"] == "projected"]
    [drawn] = memory_sections(projected, CAPACITIES)
    assert drawn["why"] == "drawn for the largest size with the most stacks that run, on the GPU where the most run"
    # b200: baseline 3 GiB at 100/s (measured), checkpointing 2 GiB at 80/s, grad-accumulation 2.5 GiB at 60/s.
    assert section["pareto"]["front"] == "checkpointing, baseline"


def test_cells_no_stack_fits_are_listed_once_per_model_not_once_per_cell():
    from reports.advice import unfixed

    rows = [_row(gpu=gpu, technique=stack, status="oom", fits=False, peak_reserved_bytes=200 * GIB)
            for gpu in ("a10", "h100-sxm") for stack in ("baseline", "amp-bf16")]
    advice = oom_advice(cost_rows(records_frame(rows), PRICES), CAPACITIES)
    assert len(advice) == 4 and not any(entry["fixes"] for entry in advice)
    assert unfixed(advice) == [{"model": "gpt gpt2-1.3b train", "gpus": "a10, h100-sxm", "cells": 4}]


def test_oom_cells_get_the_stacks_that_fit_them():
    [entry] = oom_advice(_frame(), CAPACITIES)
    assert entry["cell"] == "gpt gpt2-1.3b train h100-sxm / baseline"
    assert entry["fixes"][0].startswith("amp-bf16 (projected): reserves 87.0 GiB less, 80 ms per step (the fastest), "
                                        "fits with")


def test_every_claim_is_judged_in_order():
    claims = judge_claims(_frame(), CAPACITIES)
    assert [c["id"] for c in claims] == list(CLAIMS)
    by_id = {c["id"]: c for c in claims}
    # 8 bytes of AdamW state per parameter in the rows: half the guide's 16.
    assert by_id["C2"]["verdict"] == "contradicted: Adam's state is 2.0x smaller than stated"
    assert by_id["C13"]["verdict"].startswith("contradicted") and "max |error|" in by_id["C13"]["found"]
    # The h100 baseline OOM is fixed by amp-bf16 alone: 1 of 1 (no param-sharing rows), too few to rule out 80%.
    assert by_id["C16"]["verdict"] == ("inconclusive: 100% of 1 cells (95% interval 3%-100%, 80% inside) "
                                       "(without param-sharing rows: mixed precision alone)")
    # 1 - (34/t) / (10 + 24/t): 23% at t=2, 47% at t=4, 67% at t=8.
    assert by_id["C12"]["verdict"].startswith("not measurable here for T5-XXL") and "-23% at t=2, -47% at t=4" in \
        by_id["C12"]["found"]
    assert by_id["C1"]["verdict"] == "not measurable here" and "serve-matrix" in by_id["C1"]["found"]


def test_a_verdict_judged_elsewhere_keeps_its_words():
    text = "ptq-int8: supported (loses less than 0.5 pts: +0.06 ± 0.14 pts); qat-int8: inconclusive (spans it)"
    assert _from_text("C9", text, "accuracy.csv", "")["verdict"] == "ptq-int8: supported; qat-int8: inconclusive"
    assert _from_text("C1", "contradicted by 3.1x: 13B fits", "m", "")["verdict"] == "contradicted by 3.1x"


def _matrix() -> pd.DataFrame:
    """A serving matrix's rows (harness/serve_matrix.py columns) for a 7B model on two GPUs."""
    base = dict(size="gpt-7b", technique="bf16-weights+compile", gen_len=128, notes="", max_batch_4k=8,
                decode_tokens_s_b1=50.0, decode_tokens_s_max=300.0, usd_per_million_tokens_b1=10.0,
                params_bytes=14e9, peak_reserved_b1_bytes=16e9)
    return pd.DataFrame([
        dict(base, gpu="a10", weights="int4", usd_per_hour=0.9, price_date="2026-01", usd_per_million_tokens_max=0.83),
        dict(base, gpu="h100-sxm", weights="bf16", usd_per_hour=4.0, price_date="2026-01", decode_tokens_s_b1=150.0,
             decode_tokens_s_max=3000.0, usd_per_million_tokens_max=0.37),
        dict(base, gpu="b200", weights="bf16", usd_per_hour=6.0, price_date="2026-01", max_batch_4k=0),
    ])


def test_answers_list_the_smaller_model_first_and_say_what_to_try_where_nothing_fits():
    rows = [_row(size="gpt-7b", param_count=7_000_000_000, status="oom", fits=False),
            _row(size="gpt2-1.3b", param_count=1_300_000_000, throughput_samples_s=10.0)]
    listed = answers(cost_rows(records_frame(rows), PRICES), CAPACITIES)
    assert [a["size"] for a in listed] == ["gpt2-1.3b", "gpt-7b"]
    assert listed[1]["why"].startswith("nothing tried fits one GPU: headroom advise --workload gpt --size gpt-7b")


class _Answers(HTMLParser):
    """The answer tables of a rendered report: rows of cell texts."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[str]]] = []
        self._depth = 0
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag == "table" and "answer" in (dict(attrs).get("class") or ""):
            self.tables.append([])
            self._depth = 1
        elif self._depth and tag == "tr":
            self.tables[-1].append([])
        elif self._depth and tag == "td":
            self._cell = []
        elif self._depth and tag == "br" and self._cell is not None:
            self._cell.append(" / ")

    def handle_endtag(self, tag):
        if self._depth and tag == "td":
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif self._depth and tag == "table":
            self._depth = 0

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def buyers_page() -> str:
    return render([_frame()], matrix=_matrix(), prices=PRICES, profiles=PROFILES)


def test_a_reader_finds_what_to_buy_and_what_it_costs(buyers_page):
    training, serving = ([row for row in table if row] for table in _Answers(buyers_page).tables)
    row = next(r for r in training if r[0].startswith("gpt2-1.3b (gpt) / train"))  # the size, its workload, the mode
    best_value = row[3]
    # Fine-tuning gpt2-1.3b: best value on a b200 (measured), with USD per million tokens and the dated price.
    assert best_value.startswith("b200 · baseline") and "/ M tokens" in best_value and "$6.00/h, 2026-01" in best_value
    seven_b = next(r for r in serving if r[0] == "gpt-7b")
    assert seven_b[3].startswith("h100-sxm · bf16 weights") and "$0.37 / M tokens" in seven_b[3]


def test_an_inference_answer_of_a_served_size_points_to_the_serving_answer():
    served = _row(size="gpt-7b", mode="infer", technique="baseline", precision="fp32", throughput_samples_s=1.0)
    page = render([pd.concat([_frame(), cost_rows(records_frame([served]), PRICES)], ignore_index=True)],
                  matrix=_matrix(), prices=PRICES, profiles=PROFILES)
    training, _ = ([row for row in table if row] for table in _Answers(page).tables)
    rows = {row[0].split(")")[0] + ")": row[0] for row in training}
    assert "served with 16-bit or quantised weights, see serving a decoder" in rows["gpt-7b (gpt)"]
    assert rows["gpt2-1.3b (gpt)"] == "gpt2-1.3b (gpt) / train"  # a training answer, a size the matrix does not serve
    assert 'id="serving-answer"' in page
    # A served decoder's speed and cost count generated tokens; a training row's every token of the sequence.
    decoding = _row(size="gpt-7b", mode="infer", technique="baseline", gen_len=128, throughput_samples_s=1.0)
    [answer] = answers(cost_rows(records_frame([decoding]), PRICES), CAPACITIES)
    assert answer["picks"]["fastest"]["speed"].startswith("128 generated tokens/s")
    assert answer["picks"]["fastest"]["cost"].endswith("/ M generated tokens")
    speed = answers(_frame(), CAPACITIES)[0]["picks"]["fastest"]["speed"]
    assert " tokens/s" in speed and "generated" not in speed


def test_the_strategy_table_sets_the_rows_recommendation_beside_the_guides():
    from reports.claims import single_gpu_cells
    from reports.claims_parallel import strategy_table

    big = _row(size="gpt-13b", gpu="h100-sxm", technique="amp-bf16", status="oom", fits=False, param_count=13e9)
    frame = pd.concat([_frame(), cost_rows(records_frame([big]), PRICES)], ignore_index=True)
    table = {row["bucket"]: row for row in strategy_table(single_gpu_cells(frame, CAPACITIES))}
    assert set(table) == {"<1B", ">10B"}
    # Below 1B the best value is plain baseline on the b200: the guide's mixed precision is not what wins.
    assert table["<1B"]["rows recommend"].startswith("baseline, the best value on one GPU for 1 of 1 sizes")
    assert table["<1B"]["verdict"] == "disagrees"
    assert table[">10B"]["verdict"] == "agrees" and "several GPUs" in table[">10B"]["rows recommend"]


def test_the_pareto_chart_draws_each_stacks_range(monkeypatch):
    from reports import charts, tradeoffs

    given, draw = {}, charts.pareto_scatter
    monkeypatch.setattr(tradeoffs.charts, "pareto_scatter", lambda points, *a: given.setdefault("points", points))
    frame = _frame()
    checkpointing = (frame["gpu"] == "b200") & (frame["technique"] == "checkpointing")
    frame.loc[checkpointing, ["step_time_ms_low", "step_time_ms_high"]] = [25.0, 100.0]
    frame.loc[checkpointing, ["peak_reserved_low_bytes", "peak_reserved_high_bytes"]] = [1.5 * GIB, 3 * GIB]
    memory_sections(frame, CAPACITIES)
    points = {p["label"]: p for p in given["points"]}
    # Projected: 80/s at 50 ms spans 40/s (100 ms) to 160/s (25 ms), and its peak-reserved interval.
    assert points["checkpointing"]["speed_low"] == pytest.approx(40.0)
    assert points["checkpointing"]["speed_high"] == pytest.approx(160.0)
    assert points["checkpointing"]["memory_low"] == 1.5 * GIB and points["checkpointing"]["memory_high"] == 3 * GIB
    # Measured: 5% noise on 100/s; a measured peak is one reading, so no memory bar.
    assert points["baseline"]["speed_low"] == pytest.approx(95.0) and points["baseline"]["memory_low"] is None
    assert points["grad-accumulation"]["speed_low"] is None  # no interval: no bar
    drawn = {}
    monkeypatch.setattr(charts, "svg_of", lambda figure: drawn.setdefault("axis", figure.axes[0]) and "<svg/>")
    draw(given["points"], "t")
    assert len(drawn["axis"].containers) == 2  # one error bar each for the two ranged stacks
    assert "measured noise" in drawn["axis"].get_xlabel()
