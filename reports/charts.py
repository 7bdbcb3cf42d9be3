"""The report's charts, drawn with matplotlib and embedded as inline SVG (no network at view time;
matplotlib's SVG backend escapes every text it draws, so a name from a results file stays text).

Each function takes plain, already-chosen data and returns an `<svg>` string; what to show is decided
by the section modules (reports/answer.py, fit.py, memory.py).
"""

from __future__ import annotations

import io
import math
import textwrap

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # no display: the figures only ever become SVG text
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

GIB = 2**30
# One colour per memory category, in the order the stacked bars draw them.
CATEGORY_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
                    "KV cache": "#937860", "activations": "#c44e52", "temporaries": "#8172b3",
                    "allocator overhead": "#bbbbbb"}


def svg_of(figure) -> str:
    """The figure as an `<svg>` element (the XML prolog and doctype dropped: it sits inside HTML). Its text
    stays text (`svg.fonttype` none), drawn in the page's sans-serif font, rather than each glyph as a path:
    a report's charts shrink about threefold, and their labels can be searched and copied."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


# Costs spanning less than this factor are drawn on a linear axis: a log axis over less than a decade has
# at most one labelled power of ten (often none), leaving a chart without a readable number.
LOG_AXIS_SPAN = 10.0


def _cost_axis(axis, values: list[float]) -> None:
    """Log scale for costs that span decades, linear otherwise; ticks labelled as plain numbers (0.002, not
    2x10^-3) and never more than about six of them, so neighbouring labels do not collide."""
    positive = [v for v in values if v > 0]
    span = max(positive) / min(positive) if positive else 1.0
    if span > LOG_AXIS_SPAN:
        axis.set_xscale("log")
        if span < 1000:  # a decade or two: label 1, 2 and 5 of each, not the powers of ten alone
            axis.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=6))
    axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))


def cost_dots(points: list[dict], title: str, unit: str, palette: list[str] | None = None) -> str:
    """USD per million per GPU (`_cost_axis` picks the scale), one marker per model size, with each point's
    range as an error bar; hollow markers are projected, filled ones measured. `points`: gpu, size, cost, low,
    high, measured. `palette`: the report's sizes in order, so a size keeps its colour from chart to chart."""
    gpus = sorted({p["gpu"] for p in points}, key=lambda g: min(p["cost"] for p in points if p["gpu"] == g))
    sizes = list(dict.fromkeys(p["size"] for p in points))
    palette = palette or sizes
    figure, axis = plt.subplots(figsize=(7.5, 0.32 * len(gpus) + 1.4))
    for index, size in enumerate(sizes):
        colour = plt.cm.tab10((palette.index(size) if size in palette else index) % 10)
        for point in (p for p in points if p["size"] == size):
            y = gpus.index(point["gpu"]) + (index - (len(sizes) - 1) / 2) * 0.12
            error = [[point["cost"] - point["low"]], [point["high"] - point["cost"]]] \
                if point["low"] is not None and point["high"] is not None else None
            axis.errorbar(point["cost"], y, xerr=error, fmt="o", color=colour, markersize=5, elinewidth=0.8,
                          markerfacecolor=colour if point["measured"] is True else "white",
                          label=size if point is next(p for p in points if p["size"] == size) else None)
    _cost_axis(axis, [v for p in points for v in (p["cost"], p["low"], p["high"]) if v])
    axis.set_yticks(range(len(gpus)), gpus, fontsize=8)
    axis.invert_yaxis()  # cheapest on top
    axis.set_xlabel(f"USD per million {unit}: best stack per GPU; hollow projected, filled measured; "
                    "bars: projection interval or noise", fontsize=7)
    axis.set_title(title, fontsize=9)
    axis.grid(axis="x", alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="size",
                title_fontsize=7)  # beside the axes, never over a point
    figure.tight_layout()
    return svg_of(figure)


def fit_heatmap(labels: list[str], gpus: list[str], left: list[list[float | None]], title: str,
                marginal: list[list[bool]] | None = None) -> str:
    """Rows (size / stack) x GPUs: green where the cell fits, red where it does not, yellow where it fits as
    projected but not at the high end of the projection's interval (`marginal`), written with the memory
    left (or missing) in GiB; `left` is bytes, None where no row exists."""
    width = max(6.0, 0.62 * len(gpus) + 3)
    figure, axis = plt.subplots(figsize=(width, 0.28 * len(labels) + 1.6))
    marginal = marginal or [[False] * len(row) for row in left]
    shade = [[float("nan") if value is None else 0.5 if edge else (1.0 if value >= 0 else 0.0)
              for value, edge in zip(row, edges, strict=True)] for row, edges in zip(left, marginal, strict=True)]
    axis.imshow(shade, cmap="RdYlGn", vmin=-0.3, vmax=1.3, aspect="auto")
    for i, row in enumerate(left):
        for j, value in enumerate(row):
            text = "-" if value is None else "OOM" if value == float("-inf") else \
                f"{value / GIB:+.0f}" if abs(value) >= GIB else f"{value / GIB:+.1f}"
            axis.text(j, i, text, ha="center", va="center", fontsize=7)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.set_xticks(range(len(gpus)), gpus, fontsize=7, rotation=45, ha="right")
    legend = "GiB left, negative: short by" + ("; yellow: may not fit within the projection's interval"
                                                 if any(map(any, marginal)) else "")
    # The title centres on the axes, which the row labels push right: wrap it to the axes' share of the width.
    axis.set_title(_wrapped(f"{title} ({legend})", 0.6 * width), fontsize=9)
    figure.tight_layout()
    return svg_of(figure)


def _wrapped(title: str, width_inches: float, fontsize: float = 9) -> str:
    """`title` broken into lines that fit a figure `width_inches` wide (a line longer than the figure is cut
    off at its edge in the saved SVG); a character of a sans-serif font is about 0.55 em wide."""
    return textwrap.fill(title, width=max(20, int(width_inches * 72 / (0.55 * fontsize))))


def memory_bars(stacks: list[str], parts: dict[str, list[float]], title: str, capacity: float | None = None) -> str:
    """Horizontal bars, one per stack, split into memory categories (bytes, drawn in GiB), with the GPU's memory
    (`capacity` bytes) as a dashed line where known: a bar past it does not fit."""
    figure, axis = plt.subplots(figsize=(9.0, 0.34 * len(stacks) + 1.5))
    left = [0.0] * len(stacks)
    for category, values in parts.items():
        widths = [v / GIB for v in values]
        axis.barh(range(len(stacks)), widths, left=left, color=CATEGORY_COLOURS.get(category), label=category)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if capacity:
        axis.axvline(capacity / GIB, color="#333333", lw=1, ls="--", label=f"GPU memory ({capacity / GIB:,.0f} GiB)")
    axis.set_yticks(range(len(stacks)), stacks, fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("GiB at the step's peak", fontsize=8)
    axis.set_title(title, fontsize=9)
    if parts or capacity:  # rows without a breakdown (all figures unknown) draw empty bars and no legend
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    figure.tight_layout()
    return svg_of(figure)


def pareto_scatter(points: list[dict], title: str, unit: str = "samples/s") -> str:
    """Peak memory against throughput (in `unit`), one labelled point per stack, the Pareto front (no other
    stack both smaller and faster) joined by a line. `points`: label, memory (bytes), speed, front (bool),
    and optionally memory_low/_high and speed_low/_high, drawn as error bars.
    Stacks within 1% of each other on both axes share one point and one label, which would overprint."""
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    ranged = False
    for point in _merged(points):
        colour = "#c44e52" if point["front"] else "#999999"
        axis.scatter(point["memory"] / GIB, point["speed"], s=28, color=colour, zorder=3)
        xerr, yerr = _bar(point, "memory", scale=GIB), _bar(point, "speed")
        if xerr is not None or yerr is not None:
            ranged = True
            axis.errorbar(point["memory"] / GIB, point["speed"], xerr=xerr, yerr=yerr, fmt="none", ecolor=colour,
                          elinewidth=0.8, alpha=0.6, zorder=2)
        axis.annotate(point["label"], (point["memory"] / GIB, point["speed"]), fontsize=7,
                      xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in points if p["front"]), key=lambda p: p["memory"])
    axis.plot([p["memory"] / GIB for p in front], [p["speed"] for p in front], color="#c44e52", lw=1,
              label="Pareto front")
    axis.set_xlabel("peak reserved (GiB)" + ("; bars: projection interval or measured noise" if ranged else ""),
                    fontsize=8)
    axis.set_ylabel(unit, fontsize=8)
    # Both axes from zero: an axis starting near the slowest stack makes a 10% gap look like a factor.
    axis.set_xlim(left=0)
    axis.set_ylim(bottom=0)
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return svg_of(figure)


def _bar(point: dict, axis_name: str, scale: float = 1.0) -> list[list[float]] | None:
    """Matplotlib's asymmetric error (below, above) for one axis of a point from its `<axis>_low`/`_high`,
    None where the point has no range on that axis."""
    low, high = point.get(f"{axis_name}_low"), point.get(f"{axis_name}_high")
    if low is None and high is None:
        return None
    value = point[axis_name]
    # A missing end (measured noise of 100% or more has no slow end) draws none; nor does an infinite one, or a
    # range that does not hold its own point (a rounding edge).
    below = value - low if low is not None and math.isfinite(low) else 0.0
    above = high - value if high is not None and math.isfinite(high) else 0.0
    return [[max(below, 0.0) / scale], [max(above, 0.0) / scale]]


def _merged(points: list[dict]) -> list[dict]:
    """`points` with those within 1% of an earlier one on both axes folded into it, labels joined."""
    merged: list[dict] = []
    for point in points:
        same = next((m for m in merged if abs(m["memory"] - point["memory"]) <= 0.01 * max(m["memory"], 1)
                     and abs(m["speed"] - point["speed"]) <= 0.01 * max(m["speed"], 1e-12)), None)
        if same is None:
            merged.append(dict(point))
        else:
            same["label"] += ", " + point["label"]
            same["front"] = same["front"] or point["front"]
    return merged
