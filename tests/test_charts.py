"""The report's charts as SVG: text stays text (searchable, a fifth of the bytes of glyph paths) and a name
from a results file cannot become markup."""

from __future__ import annotations

import re

import pytest

from reports import charts


def _dots(gpu: str, cost: float = 0.5, low: float = 0.4, high: float = 0.7) -> str:
    return charts.cost_dots([{"gpu": gpu, "size": "gpt2-124m", "cost": cost, "low": low, "high": high,
                              "measured": False}], "gpt train: USD per million tokens", "tokens")


def _numbers(svg: str) -> list[float]:
    """The plain numbers the chart labels its axis with."""
    return [float(text) for text in re.findall(r">\s*([0-9]+(?:\.[0-9]+)?)\s*</text>", svg)]


@pytest.mark.parametrize("cost, low, high", [(0.0018, 0.0013, 0.0026), (0.35, 0.11, 1.03), (3.0, 0.01, 90.0)])
def test_a_cost_axis_carries_readable_numbers_whatever_its_span(cost, low, high):
    """A log axis over less than a decade has one power of ten to label, often none: such a chart had no number."""
    numbers = _numbers(_dots("h100-sxm", cost, low, high))
    assert len(numbers) >= 3, numbers
    assert all(low / 2 <= n <= high * 2 for n in numbers), numbers


def test_chart_labels_are_svg_text_not_glyph_paths():
    svg = _dots("h100-sxm")
    assert svg.startswith("<svg")
    assert ">gpt train: USD per million tokens</text>" in svg and ">h100-sxm</text>" in svg
    assert "<use xlink:href=\"#DejaVuSans" not in svg  # glyphs drawn as paths would be referenced this way


def test_a_name_from_the_results_stays_text():
    svg = _dots("<script>alert(1)</script>")
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def test_a_fit_matrix_title_stays_inside_its_figure(monkeypatch):
    """A long title centred over axes that long row labels push right ran past the figure's edge, cut off."""
    seen = {}
    original = charts.svg_of

    def measured(figure):
        renderer = figure.canvas.get_renderer()
        title = figure.axes[0].title.get_window_extent(renderer)
        seen["inside"] = 0 <= title.x0 and title.x1 <= figure.bbox.x1
        return original(figure)

    monkeypatch.setattr(charts, "svg_of", measured)
    labels = [f"bert-base b32 / {stack}" for stack in ("amp-bf16", "checkpointing", "grad-accumulation")]
    svg = charts.fit_heatmap(labels, ["h100-pcie", "h100-sxm", "h100-nvl"], [[2**30] * 3] * 3,
                             "bert train: fits on which GPU (projected)", marginal=[[True, False, False]] * 3)
    assert seen["inside"]
    assert "interval)" in svg  # the legend's end is drawn, not cut
