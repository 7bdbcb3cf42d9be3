"""Results frames -> a report context -> self-contained HTML through Jinja2 templates.

`build_context` decides what to show and formats every number; the templates only lay it out
(autoescape on, StrictUndefined, so a name from a results file can never inject markup and a
missing value fails loudly instead of printing nothing).
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import jinja2
import pandas as pd

from reports import format as fmt

# Column -> (header, formatter) for the per-workload tables.
TABLE_COLUMNS = [
    ("size", "size", fmt.text), ("mode", "mode", fmt.text), ("technique", "technique", fmt.text),
    ("gpu", "GPU", fmt.text), ("source", "source", fmt.text), ("status", "status", fmt.text),
    ("world_size", "ranks", fmt.text), ("rank", "rank", fmt.text),  # a parallel cell's row has no rank: the max
    ("batch_size", "batch", fmt.text), ("precision", "precision", fmt.text),
    ("peak_allocated_bytes", "peak allocated", fmt.bytes_), ("peak_reserved_bytes", "peak reserved", fmt.bytes_),
    ("peak_reserved_range", "projected reserved range", fmt.text),
    ("params_bytes", "params", fmt.bytes_), ("grads_bytes", "grads", fmt.bytes_),
    ("optimizer_bytes", "optimizer", fmt.bytes_), ("activations_bytes", "activations", fmt.bytes_),
    ("temporaries_bytes", "temporaries at peak", fmt.bytes_),
    ("step_time_ms_p50", "step p50 (ms)", lambda v: fmt.number(v, 2)),
    ("step_time_range", "projected step range (ms)", fmt.text),
    ("step_time_ms_p90", "step p90 (ms)", lambda v: fmt.number(v, 2)),
    ("step_time_ms_mean", "step mean (ms)", lambda v: fmt.number(v, 2)),
    ("step_time_cv", "CV", fmt.percent), ("noisy", "noisy", lambda v: fmt.flag(v, "NOISY")),
    ("throughput_samples_s", "samples/s (by mean step)", fmt.number),
    ("tokens_per_s", "tokens/s", lambda v: fmt.number(v, 0)),
    ("mfu", "MFU", fmt.percent), ("usd_per_million_samples", "USD / M samples", fmt.usd),
    ("usd_per_million_tokens", "USD / M tokens", fmt.usd), ("price_label", "price (on-demand, date)", fmt.text),
    ("fits", "fits", lambda v: fmt.EMPTY if fmt.missing(v) else ("yes" if v else "NO")),
    ("peak_error_vs_measured", "peak err vs measured", fmt.percent),
    ("step_time_error_vs_measured", "step err vs measured", fmt.percent),
    ("reserved_error_vs_measured", "reserved err vs measured", fmt.percent),
    ("comm_error_vs_measured", "comm err vs measured", fmt.percent),
]
# Projection error columns (projected / measured twin - 1) -> what they check.
ACCURACY_COLUMNS = [("peak_error_vs_measured", "peak allocated (trace)"),
                    ("reserved_error_vs_measured", "peak reserved (allocator model)"),
                    ("step_time_error_vs_measured", "step time (roofline)"),
                    ("comm_error_vs_measured", "bytes sent per rank (communication model)")]
ENV_COLUMNS = ["device_name", "torch_version", "cuda_version", "driver_version", "git_sha", "hostname"]
PROJECTED_ENV_COLUMNS = ["hostname", "torch_version", "git_sha", "run_id"]


def merge(frames: list[pd.DataFrame]) -> pd.DataFrame:
    from harness.records import records_frame

    return pd.concat(frames, ignore_index=True) if frames else records_frame([])  # no frames: no rows, every column


def projection_accuracy(frame: pd.DataFrame) -> list[dict]:
    """Per error column: how many projected rows have a measured twin, their mean |error| and the worst
    one with its cell, so a reader sees how far to trust the projected rows of GPUs not measured."""
    summary = []
    for column, label in ACCURACY_COLUMNS:
        if column not in frame:
            continue
        errors = pd.to_numeric(frame[column], errors="coerce").dropna()
        if errors.empty:
            continue
        worst = frame.loc[errors.abs().idxmax()]
        summary.append({
            "what": label, "twins": str(len(errors)), "mean_abs": fmt.percent(errors.abs().mean()),
            "worst": fmt.percent(errors.loc[errors.abs().idxmax()]),
            "worst_cell": fmt.text(f"{worst['workload']} {worst['size']} {worst['mode']} {worst['technique']} "
                                   f"on {worst['gpu']}")})
    return summary


def _ranges(frame: pd.DataFrame) -> pd.DataFrame:
    """Projected rows' intervals as text: `low - high (n pairs)`, from the ledger (harness/ledger.py)."""
    def text(low, high, pairs, formatter):
        if fmt.missing(low) or fmt.missing(high):
            return None
        return f"{formatter(low)} - {formatter(high)} ({0 if fmt.missing(pairs) else int(pairs)} cells)"

    def column(name):
        return frame[name] if name in frame else pd.Series([None] * len(frame), index=frame.index)

    return frame.assign(
        step_time_range=[text(lo, hi, n, lambda v: fmt.number(v, 2)) for lo, hi, n in zip(
            column("step_time_ms_low"), column("step_time_ms_high"), column("step_time_cells"), strict=True)],
        peak_reserved_range=[text(lo, hi, n, fmt.bytes_) for lo, hi, n in zip(
            column("peak_reserved_low_bytes"), column("peak_reserved_high_bytes"), column("peak_reserved_cells"),
            strict=True)])


def capacities_of(profiles: dict) -> dict[str, int]:
    """GPU profile id -> the memory one device gives a process (CPU profiles are not GPUs to buy)."""
    return {pid: profile.per_device().capacity_bytes for pid, profile in profiles.items()
            if profile.vendor != "cpu" and profile.per_device().capacity_bytes}


def fitted_keys(profiles: dict, checked: list[str]) -> dict[str, str]:
    """GPU profile id -> the vendor whose fitted speed constants its projections are costed with (one fit for all
    of a vendor's generations: projections on them err together), for the generations of the `checked` GPUs
    (those benchmarks/cross_gpu_ratios.py measured the ratio error on); other GPUs are left out."""
    from harness.project.speed_constants import constants_for

    generations = {profiles[gpu].generation for gpu in checked if gpu in profiles}
    keys = {}
    for pid in capacities_of(profiles):
        constants = constants_for(profiles[pid].per_device())
        if constants.gpu.fitted and profiles[pid].generation in generations:
            keys[pid] = constants.key.split(".")[0]
    return keys


def price_rows(prices: dict, profiles: dict, frame: pd.DataFrame, today: date | None = None) -> list[dict]:
    """Every GPU in the rows with the price costs are computed at (and its age on `today`, default the
    report's date), or why there is none."""
    from harness.prices import age_text

    today = today or datetime.now(UTC).date()
    gpus = sorted(set(frame["gpu"].dropna()) & set(capacities_of(profiles))) if len(frame) else []
    return [{"GPU": gpu, "USD per GPU-hour (as rented)": prices[gpu].label.rsplit(", ", 1)[0] if gpu in prices
             else fmt.EMPTY,
             "date": prices[gpu].date if gpu in prices else fmt.EMPTY,
             "age": age_text(prices[gpu], today) if gpu in prices else fmt.EMPTY,
             "basis": prices[gpu].basis if gpu in prices else fmt.EMPTY,
             "source": prices[gpu].source if gpu in prices else
             "no dated on-demand price known: costs stay empty (give one with --prices FILE)"} for gpu in gpus]


def _with_serving(sections: dict, served: list[dict]) -> dict:
    """The serving answers beside the sections, and on each inference answer of a size they cover a pointer
    to them: the rows' stacks serve with eager steps in the stack's own precision, the serving matrix with
    16-bit or quantised weights and a compiled decode, which is what a buyer would run."""
    sizes = {answer["size"] for answer in served}
    answers = [dict(answer, served=answer["mode"] == "infer" and answer["size"] in sizes)
               for answer in sections["answers"]]
    return {**sections, "answers": answers, "serving_answers": served}


def decision_sections(frame: pd.DataFrame, profiles: dict, prices: dict, claims_from: dict) -> dict:
    """The sections that decide a purchase: the answer, fit matrices, memory and speed trade-offs, OOM
    advice, prices and the guide's claims judged (reports/answer.py, tradeoffs.py, advice.py, claims.py)."""
    from harness.project.speed_constants import ratio_check
    from reports.advice import oom_advice, unfixed
    from reports.answer import answers, cost_charts, number_bases
    from reports.claims import judge_claims, single_gpu_cells
    from reports.claims_parallel import strategy_table
    from reports.tradeoffs import fit_matrices, memory_sections

    capacities = capacities_of(profiles)
    ratio_error = ratio_check().get("worst_abs_error")
    picks = answers(frame, capacities, fitted_keys(profiles, ratio_check().get("gpus", [])), ratio_error)
    advice = oom_advice(frame, capacities)
    return {
        "answers": picks, "interval_bases": number_bases(picks),
        "ratio_check": ratio_check(), "cost_charts": cost_charts(frame, capacities),
        "fit_matrices": fit_matrices(frame, capacities), "memory": memory_sections(frame, capacities),
        "advice": advice, "advice_unfixed": unfixed(advice), "prices": price_rows(prices, profiles, frame),
        "claims": judge_claims(frame, capacities, **claims_from),
        "strategy": strategy_table(single_gpu_cells(frame, capacities)) if len(frame) else [],
    }


def _timeline_item(index: int, chart: dict) -> dict:
    """A memory timeline as the chart macro takes it; its chart draws no title, so the caption names the cell."""
    title = f"{chart['cell']} (peak {fmt.bytes_(chart['peak'])})"
    return dict(chart, name=f"timeline-{index}", title=title, caption=title)


def build_context(frame: pd.DataFrame, matrix: pd.DataFrame | None = None, timelines: list[Path] = (),
                  fragmentation: pd.DataFrame | None = None, accuracy: pd.DataFrame | None = None,
                  prices: dict | None = None, profiles: dict | None = None) -> dict:
    """Everything the template shows, already formatted; `matrix` is a serving fit matrix
    (harness/serve_matrix.py) to draw and judge the guide's C1 with; `timelines` are kept memory
    timelines (--memory-timeline) to draw; `accuracy` is accuracy.csv's rows (harness/accuracy);
    `prices` (harness/prices.py) cost every row again, the profiles' own by default."""
    from harness.prices import cost_rows, price_table
    from harness.profiles import load_profiles
    from harness.serve_matrix import judge_matrix
    from reports.accuracy import accuracy_section
    from reports.answer import serving_answers
    from reports.fragmentation import fragmentation_section
    from reports.serving import generation_rows, matrix_section, reprice_matrix
    from reports.timelines import timeline_charts

    profiles = load_profiles() if profiles is None else profiles
    prices = price_table(profiles) if prices is None else prices
    frame = _ranges(cost_rows(frame, prices) if len(frame) else frame.assign(price_label=None))
    quality = accuracy_section(accuracy)
    # The serving table at the report's prices, as every other cost (serving_answers reprices for itself).
    serving = matrix_section(reprice_matrix(matrix, prices), judge_matrix(matrix)) if matrix is not None else None
    probe = fragmentation_section(fragmentation)
    claims_from = {"c1": serving["c1"] if serving else None, "c4": probe["c4"] if probe else None,
                   "c6": quality["c6"] if quality else None, "c9": quality["c9"] if quality else None}
    workloads = []
    for name, group in frame.groupby("workload", sort=False):
        group = group.sort_values(["size", "mode", "technique", "gpu", "source"], kind="stable")
        rows = [{"cells": [formatter(row[col]) for col, _, formatter in TABLE_COLUMNS],
                 "status": str(row["status"]),
                 # Why a cell did not run, or else what its techniques did (ranks, sparsity, paths taken).
                 "reason": fmt.text(row["reason"]) if not fmt.missing(row["reason"]) and row["reason"]
                 else fmt.text(row["notes"])}
                for _, row in group.iterrows()]
        workloads.append({"name": str(name), "headers": [h for _, h, _ in TABLE_COLUMNS], "rows": rows})
    # Where each measured row ran; a projected row's device name is its profile's, not a device that ran it,
    # so projections list only the machine and code that computed them.
    measured = frame[frame["source"] == "measured"] if len(frame) else frame
    projected = frame[frame["source"] == "projected"] if len(frame) else frame
    environments = (measured[ENV_COLUMNS + ["run_id"]].drop_duplicates().astype(object)
                    .map(fmt.text).to_dict("records") if len(measured) else [])
    projected_on = (projected[PROJECTED_ENV_COLUMNS].drop_duplicates().astype(object)
                    .map(fmt.text).to_dict("records") if len(projected) else [])
    sources = sorted(frame["source"].dropna().unique()) if len(frame) else []
    measured_gpus = set(frame.loc[frame["source"] == "measured", "gpu"]) if len(frame) else set()
    projected_gpus = sorted(set(frame.loc[frame["source"] == "projected", "gpu"]) - measured_gpus) if len(frame) else []
    return {
        "title": "headroom report",
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "run_ids": sorted(frame["run_id"].dropna().unique()) if len(frame) else [],
        "row_count": len(frame),
        # Cells, not rows: a parallel cell's rank rows repeat its status.
        "status_counts": (frame.loc[frame["rank"].isna(), "status"].value_counts().to_dict()
                          if len(frame) and "rank" in frame else
                          frame["status"].value_counts().to_dict() if len(frame) else {}),
        "projected_only": sources == ["projected"],
        "projected_gpus": projected_gpus,
        "sources": sources,
        "workloads": workloads,
        "accuracy": projection_accuracy(frame) if len(frame) else [],
        "environments": environments,
        "projected_on": projected_on,
        "generation": generation_rows(frame) if len(frame) else None,
        "serve_matrix": serving,
        "timelines": [_timeline_item(index, chart) for index, chart in enumerate(timeline_charts(list(timelines)))],
        "fragmentation": probe,
        "quality": quality,
        "intervals": interval_summary(frame) if len(frame) else [],
        "ledger_basis": ledger_basis(),
        **_with_serving(decision_sections(frame, profiles, prices, claims_from), serving_answers(matrix, prices)),
        "price_basis": ", ".join(sorted({price.basis for price in prices.values()})) or "on-demand",
    }


def interval_summary(frame: pd.DataFrame) -> list[dict]:
    """How wide the ledger's step-time intervals are, per precision of the projected rows: the median
    low and high end relative to the projected figure (harness/ledger.py derives them from twins)."""
    rows = frame[(frame["source"] == "projected") & (frame["status"] == "ok")]
    if "step_time_ms_low" not in rows:
        return []
    p50 = pd.to_numeric(rows["step_time_ms_p50"], errors="coerce").astype(float)
    rows = rows.assign(low=pd.to_numeric(rows["step_time_ms_low"], errors="coerce").astype(float) / p50 - 1,
                       high=pd.to_numeric(rows["step_time_ms_high"], errors="coerce").astype(float) / p50 - 1)
    rows = rows.dropna(subset=["low", "high"])
    return [{"precision": fmt.text(precision), "projected rows": str(len(group)),
             "median interval": f"{fmt.percent(group['low'].median())} to +{fmt.percent(group['high'].median())}"}
            for precision, group in rows.groupby("precision", sort=True)]


def ledger_basis() -> str:
    """What the shipped ledger and speed fit rest on, in a sentence: how many pairs, on which GPUs and
    precisions, and the fit's held-out error, so a reader weighs every interval by its evidence."""
    from harness.ledger import shipped_ledger
    from harness.project.speed_constants import fit_provenance

    ledger = shipped_ledger()
    if ledger.empty:
        return "The ledger holds no measured pair yet: every interval is the wide default."
    devices = ", ".join(f"{name} ({count})" for name, count in ledger["device_name"].value_counts().items())
    precisions = ", ".join(f"{name} {count}" for name, count in ledger["precision"].value_counts().items())
    text = (f"The ledger shipped with headroom holds {len(ledger)} pairs, measured on {devices}; by precision: "
            f"{precisions}.")
    fit = fit_provenance()
    if "held_out_median_abs_error" in fit:
        text += (f" The speed model's constants were fitted on {fit.get('rows', '?')} rows (those pairs and published "
                 f"runs): held-out median |error| {fit['held_out_median_abs_error']:.1%}, worst "
                 f"{fit['held_out_worst_abs_error']:.1%}.")
    return text + (" A row of a GPU generation none of them ran on has its interval widened to the fit's held-out "
                   "worst, and says what it rests on.")


def environment_for_templates() -> jinja2.Environment:
    # PackageLoader finds the templates inside an installed wheel as well as in a checkout.
    return jinja2.Environment(loader=jinja2.PackageLoader("reports", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render(frames: list[pd.DataFrame], matrix: pd.DataFrame | None = None, timelines: list[Path] = (),
           fragmentation: pd.DataFrame | None = None, accuracy: pd.DataFrame | None = None,
           prices: dict | None = None, profiles: dict | None = None, warnings: tuple[str, ...] = ()) -> str:
    """The report page; `warnings` (a run read while going or cut short) head it."""
    context = build_context(merge(frames), matrix, timelines, fragmentation, accuracy, prices, profiles)
    context["warnings"] = list(warnings)
    return environment_for_templates().get_template("report.html.j2").render(**context)


def write_report(frames: list[pd.DataFrame], out: Path, matrix: pd.DataFrame | None = None,
                 timelines: list[Path] = (), fragmentation: pd.DataFrame | None = None,
                 accuracy: pd.DataFrame | None = None, prices: dict | None = None,
                 profiles: dict | None = None, warnings: tuple[str, ...] = ()) -> Path:
    """Render and write atomically; the folder must exist or be creatable."""
    from harness.records import atomic_write_text

    out = Path(out)
    try:
        atomic_write_text(out, render(frames, matrix, timelines, fragmentation, accuracy, prices, profiles,
                                      warnings))
    except OSError as exc:
        raise ValueError(f"cannot write report {out} ({exc.strerror}); choose another --out") from None
    return out
