"""Report contract: escaping, self-contained output, one table per workload, the empty mark, the projected banner."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from harness.profiles import load_profiles
from harness.records import Record, records_frame
from reports import format as fmt
from reports.build import render, write_report

XSS = "<script>alert(1)</script>"
EMPTY = "–"
MISSING_SPELLINGS = {"nan", "NaN", "None", "<NA>", "NaT", "null", "", "0", "0 B", "0.0%", "$0.00"}


class Page(HTMLParser):
    """The bits of a rendered report the tests look at: h2 headings, tables (headers + rows), banners, links."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.events: list[tuple[str, object]] = []   # ("h2", text) | ("table", table dict)
        self.banners: list[str] = []
        self.attrs: list[tuple[str, str, str]] = []   # (tag, attribute, value)
        self._text: list[str] | None = None
        self._what: str | None = None
        self._table: dict | None = None
        self._row: list[str] | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            self.attrs.append((tag, name, value or ""))
        classes = (dict(attrs).get("class") or "").split()
        if tag in ("h2", "h3"):  # h3: a workload's rows, folded under "All rows"
            self._text, self._what = [], "h2"
        elif tag == "p" and "banner" in classes:
            self._text, self._what = [], "banner"
        elif tag == "table":
            self._table = {"headers": [], "rows": [], "row_classes": []}
            self.events.append(("table", self._table))
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table["row_classes"].append(classes)
        elif tag in ("td", "th"):
            self._text, self._what = [], tag

    def handle_endtag(self, tag):
        if tag in ("h2", "h3", "td", "th") and self._what == {"h3": "h2"}.get(tag, tag):
            text = "".join(self._text)
            if tag in ("h2", "h3"):
                self.events.append(("h2", text))
            elif tag == "th":
                self._table["headers"].append(text)
            else:
                self._row.append(text)
            self._text = self._what = None
        elif tag == "p" and self._what == "banner":
            self.banners.append("".join(self._text))
            self._text = self._what = None
        elif tag == "tr" and self._table is not None:
            if self._row:
                self._table["rows"].append(self._row)
            else:
                self._table["row_classes"].pop()
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)

    def sections(self) -> dict[str, list[dict]]:
        """h2 text -> the tables between it and the next h2."""
        out: dict[str, list[dict]] = {}
        current = None
        for kind, value in self.events:
            if kind == "h2":
                assert value not in out, f"heading {value!r} twice"
                current = value
                out[current] = []
            elif current is not None:
                out[current].append(value)
        return out


def _record(**kw) -> dict:
    base = dict(run_id="run-1", workload="gpt", size="small", mode="train", technique="baseline", gpu="cpu",
                source="measured", status="ok", reason="", notes="")
    base.update(kw)
    return Record(**base).to_dict()


def _frame(rows: list[dict]) -> pd.DataFrame:
    return records_frame(rows)


def _hostile_frame() -> pd.DataFrame:
    return _frame([
        _record(cell_id="a", batch_size=32, precision="bf16", peak_allocated_bytes=1536,
                peak_reserved_bytes=3 * 2**30, params_bytes=0, step_time_ms_p50=12.5, step_time_ms_p90=13.0,
                throughput_samples_s=2560.0, tokens_per_s=327680.0, mfu=0.4, usd_per_million_samples=1.5,
                device_name="cpu", torch_version="2.6.0", hostname="box", gpu="h100-sxm"),
        _record(cell_id="b", technique=f"{XSS}&", status="oom", reason=f"{XSS} & more", gpu="<i>gpu</i>"),
        _record(cell_id="c", workload=f"{XSS} & co", status="error", reason="boom & <b>bold</b>",
                run_id="run<2>&", hostname=XSS),
        _record(cell_id="d", workload="resnet50", technique="amp", mfu=0.0, peak_allocated_bytes=0),
        _record(cell_id="e", workload="resnet50", technique="baseline", status="unsupported", reason="needs a GPU"),
    ])


@pytest.fixture(scope="module")
def hostile_html() -> str:
    return render([_hostile_frame()])


def test_hostile_names_are_escaped(hostile_html):
    html = hostile_html
    assert "<script" not in html.lower()
    assert "<b>bold" not in html and "<i>gpu" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&amp;" in html
    # Every '&' left in the page starts an entity: nothing raw slipped through.
    assert re.findall(r"&(?![a-zA-Z][a-zA-Z0-9]*;|#[0-9]+;|#x[0-9a-fA-F]+;)", html) == []
    # Escaped once, not twice: the parsed text is the original.
    page = Page(html)
    sections = page.sections()
    assert f"{XSS} & co" in sections
    cells = [cell for tables in sections.values() for table in tables for row in table["rows"] for cell in row]
    assert f"{XSS} & more" in cells and f"{XSS}&" in cells and "boom & <b>bold</b>" in cells
    assert "<i>gpu</i>" in cells and XSS in cells            # the GPU column; the hostile hostname (environment)


def test_self_contained(hostile_html):
    html = hostile_html
    page = Page(html)
    for tag, name, value in page.attrs:
        if name in ("src", "href", "srcset", "data", "action", "poster"):
            assert not re.match(r"\s*(https?:)?//", value, re.I), (tag, name, value)
    assert not any(tag in ("script", "link", "iframe", "img", "object", "embed") for tag, _, _ in page.attrs)
    assert not re.search(r"<(script|link|iframe|img)\b", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?\s*(https?:)?//", html, re.I)
    assert not re.search(r"(src|href)\s*=\s*['\"]?\s*https?://", html, re.I)


def test_one_table_per_workload(hostile_html):
    frame = _hostile_frame()
    sections = Page(hostile_html).sections()
    workloads = list(dict.fromkeys(frame["workload"]))
    assert len(workloads) == 3
    for name in workloads:
        assert name in sections, name
        assert len(sections[name]) == 1, f"{name}: {len(sections[name])} tables"
        table = sections[name][0]
        assert len(table["rows"]) == int((frame["workload"] == name).sum())
        assert all(len(row) == len(table["headers"]) for row in table["rows"])
    assert set(workloads) | {"Environment"} <= set(sections)
    assert len(sections["Environment"]) == 1


def _row_by(table: dict, header: str, value: str) -> dict[str, str]:
    index = table["headers"].index(header)
    matches = [row for row in table["rows"] if row[index] == value]
    assert len(matches) == 1, (header, value, table["rows"])
    return dict(zip(table["headers"], matches[0], strict=True))


def test_missing_values_show_the_empty_mark(hostile_html):
    sections = Page(hostile_html).sections()
    gpt = sections["gpt"][0]
    missing = _row_by(gpt, "status", "oom")
    for header in ("batch", "precision", "peak allocated", "peak reserved", "params", "grads", "optimizer",
                   "activations", "temporaries at peak", "step p50 (ms)", "step p90 (ms)", "samples/s (by mean step)",
                   "tokens/s", "MFU", "USD / M samples"):
        assert header in missing, f"no column {header!r}: {gpt['headers']}"
        assert missing[header] == EMPTY, (header, missing[header])
    # No cell anywhere spells a missing value as nan/None/<NA>/0 or leaves it blank.
    for tables in sections.values():
        for table in tables:
            for row in table["rows"]:
                for header, cell in zip(table["headers"], row, strict=False):
                    assert cell.strip() not in {"nan", "NaN", "None", "<NA>", "NaT", "null", ""}, (header, row)
    # The environment row of the hostile run has no torch version: the mark, not "None".
    env = sections["Environment"][0]
    hostile_env = _row_by(env, "hostname", XSS)
    assert hostile_env["torch_version"] == EMPTY and hostile_env["device_name"] == EMPTY


def test_present_values_are_formatted_and_zero_is_not_missing(hostile_html):
    sections = Page(hostile_html).sections()
    full = _row_by(sections["gpt"][0], "technique", "baseline")
    assert full["peak allocated"] == "1.5 KiB"
    assert full["peak reserved"] == "3.0 GiB"
    assert full["params"] == "0 B"                      # a real zero stays zero
    assert full["batch"] == "32" and full["precision"] == "bf16"
    assert full["step p50 (ms)"] == "12.50"
    assert full["samples/s (by mean step)"] == "2,560.0"
    assert full["MFU"] == "40.0%"
    # Costed again at the report's price (the row's own 1.50 came from another price): USD/h over samples/h.
    price = load_profiles()["h100-sxm"].usd_per_hour
    assert full["USD / M samples"] == f"${price / 3600 / 2560 * 1e6:,.2f}"
    assert full["price (on-demand, date)"].startswith(f"${price:,.2f}/h, ")
    amp = _row_by(sections["resnet50"][0], "technique", "amp")
    assert amp["MFU"] == "0.0%" and amp["peak allocated"] == "0 B"
    assert amp["step p50 (ms)"] == EMPTY


def test_status_rows_and_summary(hostile_html):
    page = Page(hostile_html)
    gpt = page.sections()["gpt"][0]
    assert ["status-ok"] in gpt["row_classes"] and ["status-oom"] in gpt["row_classes"]
    assert "5 rows" in hostile_html
    assert "run&lt;2&gt;&amp;" in hostile_html


def _banners(frame: pd.DataFrame) -> list[str]:
    return Page(render([frame])).banners


def test_projected_only_shows_banner():
    frame = _frame([_record(cell_id="a", source="projected"), _record(cell_id="b", source="projected",
                                                                       workload="bert", gpu="h100-sxm")])
    banners = _banners(frame)
    assert len(banners) == 1 and "projected" in banners[0].lower()


def test_measured_has_no_banner():
    assert _banners(_frame([_record(cell_id="a")])) == []
    mixed = _frame([_record(cell_id="a"), _record(cell_id="b", source="projected")])
    assert _banners(mixed) == []


def test_merge_of_several_frames(tmp_path):
    first = _frame([_record(cell_id="a", run_id="r1")])
    second = _frame([_record(cell_id="a", run_id="r2", workload="bert")])
    out = write_report([first, second], tmp_path / "report.html")
    html = out.read_text(encoding="utf-8")
    sections = Page(html).sections()
    assert {"gpt", "bert", "Environment"} <= set(sections) and "small" not in sections
    assert "r1" in html and "r2" in html
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_empty_frame_renders():
    html = render([records_frame([])])
    assert "No measured rows." in html and "<table" not in html


def test_projected_rows_list_where_they_were_computed_not_a_device_that_ran_them():
    frame = _frame([_record(cell_id="p", gpu="h100-sxm", source="projected", device_name="NVIDIA H100 80GB HBM3",
                            hostname="laptop", torch_version="2.11.0", git_sha="abc123")])
    html = render([frame])
    [table] = Page(html).sections()["Environment"]
    assert table["headers"] == ["hostname", "torch_version", "git_sha", "run_id"]
    assert table["rows"] == [["laptop", "2.11.0", "abc123", "run-1"]] and "No measured rows." in html


def test_write_report_to_unwritable_place(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(ValueError) as info:
        write_report([_frame([_record(cell_id="a")])], blocker / "report.html")
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "--out" in message and str(blocker / "report.html") in message


# --- reports/format.py ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (2**20, "1.0 MiB"),
    (int(1.25 * 2**20), "1.2 MiB"), (5 * 2**30, "5.0 GiB"), (80 * 2**30, "80.0 GiB"), (3.5 * 2**30, "3.5 GiB"),
    (np.int64(1536), "1.5 KiB"), (-1536, "-1.5 KiB"),
])
def test_bytes_binary_units(value, expected):
    assert fmt.bytes_(value) == expected


def test_bytes_from_nullable_frame_values():
    series = pd.array([1536, None], dtype="Int64")
    assert fmt.bytes_(series[0]) == "1.5 KiB"
    assert fmt.bytes_(series[1]) == EMPTY


MISSING = [None, float("nan"), np.nan, np.float64("nan"), pd.NA]


@pytest.mark.parametrize("value", MISSING, ids=["None", "float-nan", "np-nan", "np-float64-nan", "pd-NA"])
def test_missing_is_the_empty_mark(value):
    assert fmt.EMPTY == EMPTY
    assert fmt.bytes_(value) == EMPTY
    assert fmt.number(value) == EMPTY and fmt.number(value, 0) == EMPTY
    assert fmt.percent(value) == EMPTY
    assert fmt.usd(value) == EMPTY
    assert fmt.text(value) == EMPTY


def test_other_formatters():
    assert fmt.number(1234.5678, 2) == "1,234.57" and fmt.number(2.25e6, 0) == "2,250,000"
    assert fmt.percent(0.4) == "40.0%" and fmt.percent(0) == "0.0%"
    assert fmt.usd(1234.5) == "$1,234.50"
    assert fmt.text("") == EMPTY and fmt.text("x") == "x" and fmt.text(0) == "0"
    assert not math.isnan(float(fmt.number(1.0).replace(",", "")))


# --- bugs found while writing these tests -----------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(2**20 - 1, "1.0 MiB"), (2**30 - 1, "1.0 GiB")])
def test_bytes_rounding_at_unit_boundary(value, expected):
    assert fmt.bytes_(value) == expected


def test_float32_nan_is_missing():
    value = np.float32("nan")
    assert fmt.bytes_(value) == EMPTY and fmt.number(value) == EMPTY and fmt.percent(value) == EMPTY


def test_projection_accuracy_summarises_the_twins_errors():
    frame = _frame([
        _record(cell_id="m", peak_allocated_bytes=100),
        _record(cell_id="p1", source="projected", peak_error_vs_measured=0.01, step_time_error_vs_measured=-0.2),
        _record(cell_id="p2", source="projected", technique="amp-fp16", mode="infer", peak_error_vs_measured=-0.05),
    ])
    sections = Page(render([frame])).sections()
    table = sections["Projection against measurement"][0]
    assert table["headers"] == ["figure", "twins", "mean |error|", "worst", "worst cell"]
    rows = {row[0]: row for row in table["rows"]}
    assert rows["peak allocated (trace)"][1:] == ["2", "3.0%", "-5.0%", "gpt small infer amp-fp16 on cpu"]
    assert rows["step time (roofline)"][1:4] == ["1", "20.0%", "-20.0%"]
    assert "peak reserved (allocator model)" not in rows  # no twin has a reserved figure (no GPU)


def test_no_accuracy_section_without_twins():
    assert "Projection against measurement" not in Page(render([_frame([_record(cell_id="a")])])).sections()


def test_serving_sections_show_generations_and_the_matrix_with_c1():
    gib = 2**30
    frame = _frame([
        _record(cell_id="g", mode="infer", gpu="a100-sxm4-80gb", source="projected", batch_size=4, seq_len=500,
                gen_len=20, ttft_ms=12.0, decode_ms_per_token_p50=3.0, decode_ms_per_token_p90=3.1,
                decode_tokens_s=1333.0, kv_cache_bytes=2 * gib, decode_bandwidth_util=0.7),
        _record(cell_id="t", workload="bert", mode="infer"),
    ])
    matrix = pd.DataFrame([
        {"size": "gpt-13b", "gpu": "a100-sxm4-80gb", "weights": "bf16", "max_batch_4k": 15, "params_bytes": 26e9,
         "peak_reserved_b1_bytes": 30 * gib, "decode_tokens_s_b1": 56.0, "notes": f"{XSS} note"},
        {"size": "gpt-70b", "gpu": "a100-sxm4-80gb", "weights": "bf16", "max_batch_4k": 0, "params_bytes": 141e9,
         "peak_reserved_b1_bytes": 150 * gib, "decode_tokens_s_b1": None, "notes": ""},
    ])
    html = render([frame], matrix)
    sections = Page(html).sections()
    generation = sections["Serving: generation cells"][0]
    assert len(generation["rows"]) == 1  # the BERT row is one-pass inference
    row = _row_by(generation, "size", "small")
    assert row["generated"] == "20" and row["KV cache"] == "2.0 GiB" and row["decode bandwidth use"] == "70.0%"
    table = sections["Serving: which GPU holds which model (projected)"][0]
    assert _row_by(table, "size", "gpt-70b")["largest batch at 4k"] == "does not fit"
    # C1 from the matrix: 13B in bf16 with 80 - 30 GiB to spare holds 13e9 + 50 GiB / 2 bytes = 39.8B, 3.1x.
    assert "contradicted by 3.1x" in html and "<svg" in html and XSS not in html


def _accuracy_row(technique: str, delta: float, ci: float, workload: str = "bert", **kw) -> dict:
    return dict(workload=workload, technique=technique, status="ok", reason="", task="stdlib-bytes-mlm",
                metric="masked-byte-accuracy", higher_is_better=True, budget="smoke", seeds=3, steps=800,
                values="", accuracy=0.3 + delta, accuracy_std=0.01, baseline=0.3, delta=delta, delta_ci95=ci,
                verdict="within noise", agreement=0.9, kl=0.01, wall_s=1.0, data="d", device="cpu", notes="", **kw)


def test_c6_and_c9_are_judged_on_the_intervals_of_bert_rows():
    import pandas as pd

    from reports.accuracy import accuracy_section, judge_c6, judge_c9

    rows = pd.DataFrame([_accuracy_row("baseline", 0.0, 0.0), _accuracy_row("param-sharing", -0.010, 0.004),
                         _accuracy_row("ptq-int8", -0.001, 0.002), _accuracy_row("qat-int8", -0.02, 0.005)])
    assert judge_c6(rows).startswith("consistent with the guide's 1.2-point cost")
    wide = pd.DataFrame([_accuracy_row("param-sharing", 0.001, 0.044)])
    assert judge_c6(wide).startswith("inconclusive")
    c9 = judge_c9(rows)
    assert "ptq-int8: supported" in c9 and "qat-int8: contradicted" in c9
    cheaper = pd.DataFrame([_accuracy_row("param-sharing", -0.001, 0.002)])
    assert judge_c6(cheaper).startswith("supported as an upper bound")
    dearer = pd.DataFrame([_accuracy_row("param-sharing", -0.05, 0.01)])
    assert judge_c6(dearer).startswith("contradicted")
    spanning = pd.DataFrame([_accuracy_row("ptq-int8", -0.004, 0.01)])
    assert "inconclusive" in judge_c9(spanning)
    assert judge_c9(pd.DataFrame([_accuracy_row("ptq-int8", 0.0, 0.0, workload="gpt")])).startswith("not measured")
    section = accuracy_section(rows)
    assert len(section["rows"]) == 4 and section["rows"][1]["cells"][5] == "-1.00 ± 0.4 pts"


def test_cost_at_quality_keeps_stacks_within_noise_of_the_baseline():
    import pandas as pd

    from reports.accuracy import cost_at_quality

    rows = pd.DataFrame([_record(technique=t, accuracy_verdict=v, usd_per_million_samples=c, accuracy_metric="top1",
                                 accuracy=0.9) for t, v, c in (("baseline", "reference", 2.0),
                                                               ("ptq-int8", "within noise", 1.0),
                                                               ("group-quant-int4", "degrades by 2.00 pts", 0.5))])
    kept = cost_at_quality(rows)
    assert list(kept["technique"]) == ["baseline", "ptq-int8"]
    assert kept["usd_per_million_samples"].min() == 1.0


def test_rates_keep_no_more_figures_than_a_projection_has():
    from reports.format import rate

    assert [rate(v) for v in (86_730.8, 152.49, 14.34, 0.07234, None)] == ["86,731", "152", "14.3", "0.0723", EMPTY]


def test_the_projection_section_says_what_the_ledger_and_the_speed_fit_rest_on(monkeypatch):
    import pandas as pd

    from harness import ledger
    from harness.project import speed_constants
    from reports.build import ledger_basis

    pairs = pd.DataFrame({"device_name": ["NVIDIA H200", "NVIDIA H200", "NVIDIA A10"],
                          "precision": ["fp32", "bf16-mixed", "fp32"]})
    monkeypatch.setattr(ledger, "shipped_ledger", lambda: pairs)
    monkeypatch.setattr(speed_constants, "fit_provenance", lambda: {"rows": 9, "held_out_median_abs_error": 0.049,
                                                                     "held_out_worst_abs_error": 0.775})
    text = ledger_basis()
    assert text.startswith("The ledger shipped with headroom holds 3 pairs, measured on NVIDIA H200 (2), NVIDIA A10 "
                           "(1); by precision: fp32 2, bf16-mixed 1.")
    assert "fitted on 9 rows" in text and "held-out median |error| 4.9%, worst 77.5%" in text
    monkeypatch.setattr(ledger, "shipped_ledger", lambda: pairs.iloc[0:0])
    assert ledger_basis().startswith("The ledger holds no measured pair yet")


def test_the_answer_says_how_far_apart_two_projected_gpus_must_be_to_rank_them():
    from harness.project.speed_constants import ratio_check, training_fit_digest

    check = ratio_check()  # benchmarks/cross_gpu_ratios.py --write: shipped with the package
    assert check["n"] >= 10 and 0 < check["median_abs_error"] <= check["worst_abs_error"] < 1
    assert check["training_fit_digest"] == training_fit_digest(), (
        "the speed fit changed since the ratio check: run benchmarks/cross_gpu_ratios.py --write")
    html = render([_frame([_record(cell_id="a", source="projected", gpu="h100-sxm")])])
    assert (f"tie only if they differ by less than the projection's worst error on how much faster one GPU is "
            f"than another, {check['worst_abs_error'] * 100:.0f}% on {check['n']} held-out ratios") in html
