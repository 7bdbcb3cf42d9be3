"""`headroom report --compare OLD NEW`: cells judged against their noise, the Markdown summary, the HTML
page (escaped), and the command end to end; `--format md` for one set of results."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.cli import main
from harness.records import Record, ResultsStore, records_frame
from reports.compare import compare_markdown, compare_results, counts_line, render_comparison
from reports.markdown import results_markdown

XSS = "<script>alert(1)</script>"
MIB = 2**20


def _record(**kw) -> dict:
    base = dict(run_id="run-1", workload="gpt", size="small", mode="train", technique="baseline", gpu="cpu",
                source="measured", status="ok", batch_size=8, cell_id="c0")
    base.update(kw)
    return Record(**base).to_dict()


def _frame(*rows: dict) -> pd.DataFrame:
    return records_frame(list(rows))


def _verdict(table: pd.DataFrame, figure: str, **identity) -> str:
    hits = table[table["figure"] == figure]
    for column, value in identity.items():
        hits = hits[hits[column] == value]
    assert len(hits) == 1, hits
    return hits["verdict"].iloc[0]


def test_a_30_percent_slower_cell_with_a_2_percent_cv_is_worse():
    old = _frame(_record(step_time_ms_p50=10.0, step_time_cv=0.02))
    new = _frame(_record(step_time_ms_p50=13.0, step_time_cv=0.02))
    table = compare_results(old, new)
    row = table[table["figure"] == "step_time_ms_p50"].iloc[0]
    assert row["verdict"] == "worse"
    assert row["change"] == pytest.approx(0.3)
    assert row["threshold"] == pytest.approx(2 * (2 * 0.02**2) ** 0.5)  # 2 x sqrt(cv_old^2 + cv_new^2)


def test_a_3_percent_change_with_a_5_percent_cv_is_within_noise():
    old = _frame(_record(step_time_ms_p50=10.0, step_time_cv=0.05, throughput_samples_s=800.0))
    new = _frame(_record(step_time_ms_p50=10.3, step_time_cv=0.05, throughput_samples_s=776.0))
    table = compare_results(old, new)
    assert _verdict(table, "step_time_ms_p50") == "within noise"
    assert _verdict(table, "throughput_samples_s") == "within noise"


def test_a_noisy_cells_step_time_and_throughput_get_the_same_verdict():
    # A run with a 115% CV: its p50 fell 73% (a 3.7x faster step), its throughput rose 987%. Judged on relative
    # change, the first was "within noise" (|-73%| < 230%) and the second "better"; on the log ratio, both better.
    old = _frame(_record(step_time_ms_p50=34.5, step_time_cv=1.15, throughput_samples_s=39.0))
    new = _frame(_record(step_time_ms_p50=9.3, step_time_cv=0.05, throughput_samples_s=424.4))
    table = compare_results(old, new)
    assert _verdict(table, "step_time_ms_p50") == _verdict(table, "throughput_samples_s") == "better"
    slower = _frame(_record(step_time_ms_p50=34.5 * 2, step_time_cv=0.05, throughput_samples_s=19.5))
    table = compare_results(old, slower)  # twice as slow: inside 2 x 115%, either way round
    assert _verdict(table, "step_time_ms_p50") == _verdict(table, "throughput_samples_s") == "within noise"


def test_a_zero_cv_does_not_flag_rounding_but_a_missing_one_is_assumed_noisy():
    quiet = compare_results(_frame(_record(step_time_ms_p50=10.0, step_time_cv=0.0)),
                            _frame(_record(step_time_ms_p50=10.15, step_time_cv=0.0)))
    assert _verdict(quiet, "step_time_ms_p50") == "within noise"  # the 2% floor
    unknown = compare_results(_frame(_record(step_time_ms_p50=10.0)), _frame(_record(step_time_ms_p50=11.0)))
    assert _verdict(unknown, "step_time_ms_p50") == "within noise"  # 10%, under 2 x sqrt(2) x 5%


def test_higher_throughput_is_better():
    table = compare_results(_frame(_record(throughput_samples_s=100.0, step_time_cv=0.01)),
                            _frame(_record(throughput_samples_s=130.0, step_time_cv=0.01)))
    assert _verdict(table, "throughput_samples_s") == "better"


def test_projected_rows_have_a_fixed_1_percent_tolerance():
    old = _frame(_record(source="projected", technique="a", step_time_ms_p50=100.0),
                 _record(source="projected", technique="b", step_time_ms_p50=100.0))
    new = _frame(_record(source="projected", technique="a", step_time_ms_p50=100.5),
                 _record(source="projected", technique="b", step_time_ms_p50=105.0))
    table = compare_results(old, new)
    assert _verdict(table, "step_time_ms_p50", technique="a") == "within noise"
    assert _verdict(table, "step_time_ms_p50", technique="b") == "worse"


def test_memory_is_judged_at_max_of_1_mib_and_1_percent():
    old = _frame(_record(technique="big", peak_reserved_bytes=1000 * MIB, peak_allocated_bytes=1000 * MIB),
                 _record(technique="small", peak_reserved_bytes=MIB // 10))
    new = _frame(_record(technique="big", peak_reserved_bytes=1005 * MIB, peak_allocated_bytes=900 * MIB),
                 _record(technique="small", peak_reserved_bytes=MIB))
    table = compare_results(old, new)
    assert _verdict(table, "peak_reserved_bytes", technique="big") == "within noise"  # +0.5%
    assert _verdict(table, "peak_allocated_bytes", technique="big") == "better"  # -10%
    assert _verdict(table, "peak_reserved_bytes", technique="small") == "within noise"  # +0.9 MiB, 10x


def test_accuracy_direction_follows_the_metric_and_its_noise():
    old = _frame(_record(technique="lm", accuracy_metric="bits-per-byte", accuracy=2.0, accuracy_noise=0.01,
                         accuracy_seeds=4),
                 _record(technique="cls", accuracy_metric="top1", accuracy=0.80, accuracy_noise=0.01,
                         accuracy_seeds=4))
    new = _frame(_record(technique="lm", accuracy_metric="bits-per-byte", accuracy=1.9, accuracy_noise=0.01,
                         accuracy_seeds=4),
                 _record(technique="cls", accuracy_metric="top1", accuracy=0.795, accuracy_noise=0.01,
                         accuracy_seeds=4))
    table = compare_results(old, new)
    assert _verdict(table, "accuracy", technique="lm") == "better"  # fewer bits per byte
    assert _verdict(table, "accuracy", technique="cls") == "within noise"  # 0.5 points, within 2 x 0.7


def test_ok_to_oom_is_worse_and_the_reverse_better():
    old = _frame(_record(technique="a", step_time_ms_p50=10.0), _record(technique="b", status="oom"))
    new = _frame(_record(technique="a", status="oom"), _record(technique="b", step_time_ms_p50=10.0))
    table = compare_results(old, new)
    assert _verdict(table, "status", technique="a") == "worse"
    assert _verdict(table, "status", technique="b") == "better"
    assert table.iloc[0]["verdict"] == "worse"


def test_cells_only_on_one_side_are_added_or_removed_and_sources_never_cross():
    old = _frame(_record(technique="gone"), _record(technique="kept", seq_len=None),
                 _record(technique="twin", source="measured"))
    new = _frame(_record(technique="fresh"), _record(technique="kept", seq_len=None),
                 _record(technique="twin", source="projected"))
    table = compare_results(old, new)
    assert _verdict(table, "cell", technique="gone") == "removed"
    assert _verdict(table, "cell", technique="fresh") == "added"
    assert _verdict(table, "cell", technique="twin", source="measured") == "removed"
    assert _verdict(table, "cell", technique="twin", source="projected") == "added"
    assert "kept" not in set(table["technique"])  # matched (empty seq_len equals empty), nothing changed
    assert counts_line(table).endswith("2 added, 2 removed cells")


def test_markdown_lists_the_worse_cell_first():
    old = _frame(_record(technique="faster", step_time_ms_p50=10.0, step_time_cv=0.01),
                 _record(technique="slower", step_time_ms_p50=10.0, step_time_cv=0.01))
    new = _frame(_record(technique="faster", step_time_ms_p50=7.0, step_time_cv=0.01),
                 _record(technique="slower", step_time_ms_p50=13.0, step_time_cv=0.01))
    text = compare_markdown(compare_results(old, new), "torch-2.5", "torch-2.6")
    assert "**1 worse, 1 better, 0 within noise" in text
    assert text.index("### Worse") < text.index("slower") < text.index("### Better") < text.index("faster")
    assert "10.00 ms | 13.00 ms | +30.0% |" in text


def test_markdown_tables_stop_at_50_rows():
    old = _frame(*[_record(technique=f"t{i}", step_time_ms_p50=10.0, step_time_cv=0.01) for i in range(60)])
    new = _frame(*[_record(technique=f"t{i}", step_time_ms_p50=20.0, step_time_cv=0.01) for i in range(60)])
    text = compare_markdown(compare_results(old, new), "a", "b")
    assert "... and 10 more rows." in text
    assert text.count("| gpt small train") == 50


def test_names_are_escaped_in_html_and_markdown():
    old = _frame(_record(technique=XSS, step_time_ms_p50=10.0, step_time_cv=0.01))
    new = _frame(_record(technique=XSS, step_time_ms_p50=20.0, step_time_cv=0.01))
    table = compare_results(old, new)
    html = render_comparison(table, XSS, "new")
    assert XSS not in html and "&lt;script&gt;" in html
    assert 'class="verdict-worse"' in html
    text = compare_markdown(table, XSS, "new|x")
    assert "<script>" not in text and "new\\|x" in text


def test_a_figure_one_run_lacks_is_a_changed_row_not_silence():
    # A projection that gained a step time (a calibrated profile) has nothing to judge a threshold on.
    old = _frame(_record(source="projected", peak_allocated_bytes=MIB))
    new = _frame(_record(source="projected", peak_allocated_bytes=MIB, step_time_ms_p50=16.5))
    table = compare_results(old, new)
    gained = table[table["verdict"] == "changed"]
    assert list(gained["figure"]) == ["step_time_ms_p50"] and gained["basis"].iloc[0] == "only the new run has it"
    assert "1 changed (a failure for another, or a figure one run lacks)" in counts_line(table)


def test_results_markdown_summarises_measured_cells():
    frame = _frame(_record(run_id="r-1", step_time_ms_p50=12.5, peak_reserved_bytes=3 * 2**30),
                   _record(run_id="r-1", source="projected", gpu="a100", status="oom"),
                   _record(run_id="r-1", gpu="cpu", technique="amp-bf16", step_time_ms_p50=40.0,
                           peak_allocated_bytes=2**30))  # the CPU has no caching allocator: nothing reserved
    text = results_markdown(frame)
    assert "3 rows from 1 run: r-1." in text
    assert "| measured | ok | 2 |" in text and "| projected | oom | 1 |" in text
    assert "### gpt · train (measured cells only)" in text and "12.50 ms | 3.0 GiB |" in text
    assert "40.00 ms | 1.0 GiB allocated |" in text and "a100" not in text.split("### gpt")[1]
    assert text.rstrip().endswith("accuracy and fragmentation.")  # what only the HTML report has, said


def test_results_markdown_names_each_rows_run_where_several_and_marks_noisy_times():
    frame = _frame(_record(run_id="r-1", step_time_ms_p50=12.5, noisy=True, step_time_cv=0.4),
                   _record(run_id="r-2", step_time_ms_p50=10.0))
    text = results_markdown(frame)
    assert "| run | size |" in text
    assert "| r-1 | small | baseline | cpu |" in text and "12.50 ms (noisy, cv 40%)" in text
    assert "| r-2 | small |" in text and "10.00 ms |" in text
    assert "| run |" not in results_markdown(_frame(_record(run_id="r-1", step_time_ms_p50=12.5)))


def test_results_markdown_answers_from_a_serving_matrix_at_the_reports_prices():
    from tests.test_report_decision import PRICES, _matrix

    frame = _frame(_record(run_id="r-1", step_time_ms_p50=12.5))
    assert "Serving a decoder" not in results_markdown(frame, prices=PRICES)
    text = results_markdown(frame, prices=PRICES, matrix=_matrix())
    serving = text.split("### Serving a decoder (projected, compiled decode, 4k context)")[1]
    assert "| gpt-7b | a10 · int4 weights: largest batch 8" in serving
    assert "h100-sxm · bf16 weights: 150 tokens/s for one stream (decode)" in serving


def _write_run(folder, rows: list[dict]):
    store = ResultsStore(folder)
    store.prepare()
    for index, row in enumerate(rows):
        store.add(Record(**{**row, "cell_id": f"c{index}"}))
    store.write_frame()
    return folder


@pytest.fixture
def two_runs(tmp_path):
    old = _write_run(tmp_path / "old", [_record(technique="a", step_time_ms_p50=10.0, step_time_cv=0.01),
                                        _record(technique="b", step_time_ms_p50=10.0, step_time_cv=0.01)])
    new = _write_run(tmp_path / "new", [_record(run_id="run-2", technique="a", step_time_ms_p50=15.0,
                                                step_time_cv=0.01),
                                        _record(run_id="run-2", technique="b", status="timeout")])
    return old, new


def test_the_command_writes_html_and_markdown_comparisons(two_runs, tmp_path, capsys):
    old, new = two_runs
    assert main(["report", "--compare", str(old), str(new / "results.csv"), "--out", str(tmp_path / "c.html")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "c.html" in out and "2 worse, 0 better" in out
    assert 'class="verdict-worse"' in (tmp_path / "c.html").read_text()
    assert main(["report", "--compare", str(old), str(new), "--format", "md", "--out", str(tmp_path / "c.txt")]) == 0
    assert "2 worse" in capsys.readouterr().out
    text = (tmp_path / "c.txt").read_text()
    assert text.startswith("## headroom comparison:") and "### Worse (2)" in text
    assert "| status | ok | timeout |" in text
    assert main(["report", "--compare", str(old), str(new), "--out", str(tmp_path / "c.md")]) == 0  # by suffix
    assert (tmp_path / "c.md").read_text().startswith("## headroom comparison:")
    # A name that says one kind while --format asks for the other, or neither without --format: refused.
    assert main(["report", str(old), "--format", "html", "--out", str(tmp_path / "r.md")]) == 2
    assert "--format html writes HTML, but --out names a .md file" in capsys.readouterr().err
    assert main(["report", str(old), "--out", str(tmp_path / "r.pdf")]) == 2
    assert "name the report .html or .md, or give --format html|md" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists() and not (tmp_path / "r.pdf").exists()


def test_the_command_writes_a_markdown_summary_of_results(two_runs, tmp_path, capsys):
    old, _ = two_runs
    assert main(["report", str(old), "--format", "md", "--out", str(tmp_path / "summary.md")]) == 0
    assert "summary.md" in capsys.readouterr().out
    assert "2 rows from 1 run: run-1." in (tmp_path / "summary.md").read_text()


def test_compare_needs_exactly_two_results(two_runs, tmp_path, capsys):
    old, new = two_runs
    assert main(["report", "--compare", str(old), str(new), str(old), "--out", str(tmp_path / "c.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare takes exactly two results, OLD and NEW (got 3)" in err
    assert not (tmp_path / "c.html").exists()
