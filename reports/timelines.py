"""The report's memory timelines: for each measured cell kept with `--memory-timeline`, its memory over
one step by category (parameters, optimizer state, inputs, temporaries, activations, gradients) as a
stacked area chart, inline SVG.
"""

from __future__ import annotations

from pathlib import Path

from harness.measure.artifacts import TIMELINES, read_timeline

# Charts drawn at most (a run with --memory-timeline over many cells keeps them all on disk).
MAX_CHARTS = 24


def timeline_files(folders: list[Path]) -> list[Path]:
    """The kept timelines of these results folders, in cell order."""
    return sorted(p for folder in folders if Path(folder).is_dir() for p in (Path(folder) / TIMELINES).glob("*.json"))


def timeline_charts(paths: list[Path]) -> list[dict]:
    """One chart per readable timeline (at most MAX_CHARTS): {"cell": id, "svg": markup, "peak": bytes}."""
    charts = []
    for path in paths[:MAX_CHARTS]:
        timeline = read_timeline(path)
        if timeline is None or not timeline[0]:
            continue
        seconds, by_category = timeline
        totals = [sum(values) for values in zip(*by_category.values(), strict=True)]
        charts.append({"cell": path.stem, "svg": _chart(seconds, by_category), "peak": max(totals)})
    return charts


def _chart(seconds: list[float], by_category: dict[str, list[int]]) -> str:
    from reports.charts import plt, svg_of

    shown = {name: [v / 2**20 for v in values] for name, values in by_category.items() if any(values)}
    figure, axis = plt.subplots(figsize=(7.0, 2.6))
    axis.stackplot([s * 1e3 for s in seconds], *shown.values(), labels=list(shown), step="post")
    axis.set_xlabel("ms into the step", fontsize=8)
    axis.set_ylabel("MiB", fontsize=8)
    axis.tick_params(labelsize=7)
    axis.legend(fontsize=7, loc="upper left", frameon=False, ncol=min(3, len(shown)))
    figure.tight_layout()
    return svg_of(figure)


