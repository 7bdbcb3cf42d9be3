"""The report's charts as SVG: text stays text (searchable, a fifth of the bytes of glyph paths) and a name
from a results file cannot become markup."""

from __future__ import annotations

from reports import charts


def _dots(gpu: str) -> str:
    return charts.cost_dots([{"gpu": gpu, "size": "gpt2-124m", "cost": 0.5, "low": 0.4, "high": 0.7,
                              "measured": False}], "gpt train: USD per million tokens", "tokens")


def test_chart_labels_are_svg_text_not_glyph_paths():
    svg = _dots("h100-sxm")
    assert svg.startswith("<svg")
    assert ">gpt train: USD per million tokens</text>" in svg and ">h100-sxm</text>" in svg
    assert "<use xlink:href=\"#DejaVuSans" not in svg  # glyphs drawn as paths would be referenced this way


def test_a_name_from_the_results_stays_text():
    svg = _dots("<script>alert(1)</script>")
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg
