"""`headroom report --compare OLD NEW`: which cells got better or worse by more than their noise.

Cells are matched on their identity (workload, size, mode, technique, GPU, source, shape); a figure's
change new / old - 1 counts only beyond its noise: twice the combined spread of the two measurements
for timings and accuracy (about a 95% bound), a small fixed tolerance where a figure has no run-to-run
noise (projections, memory). A status that leaves or reaches `ok` is a verdict on its own.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.records import DEFAULT_NOISE_THRESHOLD
from reports import format as fmt
from reports.markdown import escape, milliseconds, table, write_text

# What makes two rows the same cell. Only rows of the same source compare: a projection is never
# judged against a measurement here (that is the report's projection-error section).
IDENTITY = ["workload", "size", "mode", "technique", "gpu", "source", "batch_size", "world_size", "rank",
            "seq_len", "gen_len", "image_size"]
_MISSING_KEY = "\x00missing"  # stands for an empty identity value, so that NaN matches NaN
COLUMNS = [*IDENTITY, "figure", "metric", "old_status", "new_status", "old", "new", "change", "threshold", "basis",
           "verdict"]

VERDICTS = ("worse", "better", "changed", "added", "removed", "within noise")  # the order tables show them in
# figure -> higher is better
TIMINGS = {"step_time_ms_p50": False, "throughput_samples_s": True}
MEMORY = ("peak_allocated_bytes", "peak_reserved_bytes")
LABELS = {"status": "status", "cell": "cell", "step_time_ms_p50": "step time p50", "throughput_samples_s": "throughput",
          "peak_allocated_bytes": "peak allocated", "peak_reserved_bytes": "peak reserved", "accuracy": "accuracy"}

# Timing. `step_time_cv` is the coefficient of variation of a measured cell's repeats (the spread one
# measurement of it has). The difference of two such independent figures has a relative spread of
# sqrt(cv_old^2 + cv_new^2), so a change beyond twice that is outside about 95% of what noise alone gives.
NOISE_SIGMAS = 2.0
TIMING_FLOOR = 0.02  # a cell with a CV near 0 (a quiet machine, few repeats) is not flagged for a 1% wobble
MISSING_CV = DEFAULT_NOISE_THRESHOLD  # a single repeat has no CV: assume the spread at which a row is noisy
# A projection has no run-to-run noise: the same inputs give the same figure, so any change beyond
# rounding comes from the code, the profile or the ledger; 1% keeps float rounding out of the verdicts.
PROJECTED_TOLERANCE = 0.01
# Memory: the caching allocator is deterministic to the block (the same program allocates the same
# tensors in the same order), so peaks repeat to the byte on the same stack; 1 MiB (a few blocks or a
# workspace) or 1%, whichever is larger, absorbs a library's workspace and small allocations.
MEMORY_TOLERANCE_BYTES = 2**20
MEMORY_TOLERANCE = 0.01
# Accuracy: `accuracy` is the mean over seeds and `accuracy_noise` the seeds' spread (sample standard
# deviation), so the mean's standard error is noise / sqrt(seeds); twice the two means' combined error
# bounds their difference at about 95%. Without a recorded spread, a fixed 1%.
ACCURACY_FLOOR = 0.001
ACCURACY_TOLERANCE = 0.01
# Metrics where a lower figure is better (suites/tasks/base.py BITS_PER_BYTE; not imported, it brings torch).
LOWER_IS_BETTER_METRICS = frozenset({"bits-per-byte"})
NOT_OK_STATUSES = ("oom", "error", "timeout", "unsupported")


def compare_results(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """One row per (matched cell, figure) with old, new, change (new / old - 1), the threshold beyond
    which the change is not noise (relative; a timing's rise beyond +t, its fall beyond -t / (1 + t)), the
    basis of that threshold and a verdict:
    better, worse or within noise; a status change is its own row (`figure` "status"; ok to oom, error,
    timeout or unsupported is worse, the reverse better, one failure to another "changed", as is a figure one
    side lacks where both are ok); cells only
    in OLD or only in NEW are one row each, "removed" or "added" (`figure` "cell"). Rows are sorted
    worse first (largest change first), then better, changed, added, removed, within noise. A cell
    appearing twice on one side (a run merged twice) counts once, as its last row."""
    before, after = _cells(old), _cells(new)
    rows = []
    for key in [*before, *(key for key in after if key not in before)]:
        if key not in after:
            rows.append(_row(before[key], "cell", verdict="removed", old_status=before[key]["status"]))
        elif key not in before:
            rows.append(_row(after[key], "cell", verdict="added", new_status=after[key]["status"]))
        else:
            rows += _compare_cell(before[key], after[key])
    frame = pd.DataFrame(rows, columns=COLUMNS, dtype=object)  # object: a batch stays 32 beside an empty one
    for column in ("old", "new", "change", "threshold"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype(float)
    order = frame["verdict"].map({verdict: index for index, verdict in enumerate(VERDICTS)})
    # Largest first on the ratio's logarithm (a halving ranks with a doubling), as timings are judged.
    size = [abs(math.log1p(c)) if c == c and c > -1 else math.inf for c in frame["change"]]
    frame = frame.assign(_order=order, _size=[-s for s in size])
    return frame.sort_values(["_order", "_size"], kind="stable").drop(columns=["_order", "_size"]) \
        .reset_index(drop=True)


def verdict_counts(comparison: pd.DataFrame) -> dict[str, int]:
    """Rows per verdict, every verdict named (0 where none)."""
    counts = comparison["verdict"].value_counts()
    return {verdict: int(counts.get(verdict, 0)) for verdict in VERDICTS}


def counts_line(comparison: pd.DataFrame) -> str:
    """'3 worse, 5 better, 40 within noise (figures of 12 matched cells); 1 added, 0 removed cells'."""
    counts = verdict_counts(comparison)
    changed = f", {counts['changed']} changed (a failure for another, or a figure one run lacks)" \
        if counts["changed"] else ""
    return (f"{counts['worse']} worse, {counts['better']} better, {counts['within noise']} within noise"
            f"{changed} (figures of {_matched(comparison)} matched cells); {counts['added']} added, "
            f"{counts['removed']} removed cells")


def _matched(comparison: pd.DataFrame) -> int:
    matched = comparison[~comparison["verdict"].isin(("added", "removed"))]
    return len(matched[IDENTITY].astype(str).drop_duplicates())


def _key(value) -> str:
    if fmt.missing(value):
        return _MISSING_KEY
    if isinstance(value, float) and value.is_integer():  # a batch read back as 32.0 is batch 32
        return str(int(value))
    return str(value)


def _cells(frame: pd.DataFrame) -> dict[tuple, dict]:
    """Identity key -> the row (a dict, None where empty); the last row of a cell given twice."""
    frame = frame.reset_index(drop=True)
    for column in IDENTITY:
        if column not in frame:  # an older or hand-made frame: a column it lacks is empty throughout
            frame[column] = None
    records = frame.astype(object).where(frame.notna(), None).to_dict("records")
    return {tuple(_key(row[column]) for column in IDENTITY): row for row in records}


def _row(cell: dict, figure: str, verdict: str, old=None, new=None, change=None, threshold=None, basis: str = "",
         old_status=None, new_status=None, metric=None) -> dict:
    return {**{column: cell[column] for column in IDENTITY}, "figure": figure, "metric": metric,
            "old_status": old_status,
            "new_status": new_status, "old": old, "new": new, "change": change, "threshold": threshold,
            "basis": basis, "verdict": verdict}


def _judge(difference: float, tolerance: float, higher_is_better: bool) -> str:
    if abs(difference) <= tolerance:
        return "within noise"
    return "better" if (difference > 0) == higher_is_better else "worse"


def _number(value) -> float | None:
    if fmt.missing(value):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _compare_cell(old: dict, new: dict) -> list[dict]:
    statuses = {"old_status": old["status"], "new_status": new["status"]}
    rows = []
    if old["status"] != new["status"]:
        verdict = ("worse" if old["status"] == "ok" else "better" if new["status"] == "ok" else "changed")
        rows.append(_row(new, "status", verdict, basis="status", **statuses))
    projected = old["source"] == "projected"
    rows += _one_sided(old, new, statuses)
    for figure, higher in TIMINGS.items():
        before, after = _number(old.get(figure)), _number(new.get(figure))
        if before is None or after is None or before <= 0:
            continue
        if projected:
            threshold, basis = PROJECTED_TOLERANCE, "projected: fixed 1%"
        else:
            cvs = [_number(row.get("step_time_cv")) for row in (old, new)]
            spread = math.sqrt(sum((MISSING_CV if cv is None else cv) ** 2 for cv in cvs))
            threshold = max(TIMING_FLOOR, NOISE_SIGMAS * spread)
            basis = "2 x combined CV" + (f" ({MISSING_CV:.0%} assumed where unknown)" if None in cvs else "")
        change = after / before - 1
        # Judged on the log of the ratio, so that a step time and the throughput it gives agree: a relative
        # change is lopsided (a 73% shorter step is a 270% higher throughput), its logarithm is not.
        verdict = _judge(math.log(after / before), math.log1p(threshold), higher) if after > 0 else \
            _judge(change, threshold, higher)  # fell to nothing: a throughput of 0 is worse, as before
        rows.append(_row(new, figure, verdict, before, after, change, threshold, basis, **statuses))
    for figure in MEMORY:
        before, after = _number(old.get(figure)), _number(new.get(figure))
        if before is None or after is None:
            continue
        tolerance = max(MEMORY_TOLERANCE_BYTES, MEMORY_TOLERANCE * before)
        rows.append(_row(new, figure, _judge(after - before, tolerance, False), before, after,
                         after / before - 1 if before > 0 else None, tolerance / before if before > 0 else None,
                         "memory: max(1 MiB, 1%)", **statuses))
    rows += _compare_accuracy(old, new, statuses)
    return rows


def _one_sided(old: dict, new: dict, statuses: dict) -> list[dict]:
    """A timing or memory figure one run has and the other lacks, both cells ok ("changed": a projection that
    gained a step time from a calibrated profile, a measurement that lost one), which no threshold can judge."""
    if old["status"] != "ok" or new["status"] != "ok":
        return []
    rows = []
    for figure in [*TIMINGS, *MEMORY]:
        before, after = _number(old.get(figure)), _number(new.get(figure))
        if (before is None) != (after is None):
            basis = "only the new run has it" if before is None else "only the old run has it"
            rows.append(_row(new, figure, "changed", before, after, None, None, basis, **statuses))
    return rows


def _compare_accuracy(old: dict, new: dict, statuses: dict) -> list[dict]:
    metric = old.get("accuracy_metric")
    before, after = _number(old.get("accuracy")), _number(new.get("accuracy"))
    if before is None or after is None or fmt.missing(metric) or metric != new.get("accuracy_metric"):
        return []
    errors = [_standard_error(row) for row in (old, new)]
    if None in errors:
        tolerance, basis = ACCURACY_TOLERANCE * abs(before), "accuracy: no spread recorded, fixed 1%"
    else:
        tolerance = max(ACCURACY_FLOOR * abs(before), NOISE_SIGMAS * math.sqrt(sum(e**2 for e in errors)))
        basis = "accuracy: 2 x combined standard error over seeds"
    higher = metric not in LOWER_IS_BETTER_METRICS
    return [_row(new, "accuracy", _judge(after - before, tolerance, higher), before, after,
                 after / before - 1 if before else None, tolerance / abs(before) if before else None, basis,
                 metric=metric, **statuses)]


def _standard_error(row: dict) -> float | None:
    noise, seeds = _number(row.get("accuracy_noise")), _number(row.get("accuracy_seeds"))
    if noise is None:
        return None
    return noise / math.sqrt(seeds) if seeds and seeds > 1 else noise


# --- formatting: every number becomes text here, for the Markdown summary and the HTML page alike ---

def cell_label(row) -> str:
    """'gpt small train · baseline · cpu · measured · batch 32, seq 128' (the shape where given)."""
    shape = [f"{name} {fmt.text(row[column])}" for column, name in (
        ("batch_size", "batch"), ("seq_len", "seq"), ("gen_len", "gen"), ("image_size", "image"),
        ("world_size", "world"), ("rank", "rank")) if not fmt.missing(row[column])
        and not (column == "world_size" and _key(row[column]) == "1")]
    parts = [f"{fmt.text(row['workload'])} {fmt.text(row['size'])} {fmt.text(row['mode'])}",
             fmt.text(row["technique"]), fmt.text(row["gpu"]), fmt.text(row["source"])]
    return " · ".join(parts + ([", ".join(shape)] if shape else []))


def _figure_label(row) -> str:
    label = LABELS.get(row["figure"], str(row["figure"]))
    return label if fmt.missing(row["metric"]) else f"{label} ({row['metric']})"


def _value(row, side: str) -> str:
    figure = row["figure"]
    if figure in ("status", "cell"):
        return fmt.text(row[f"{side}_status"])
    value = row[side]
    if figure == "step_time_ms_p50":
        return milliseconds(value)
    if figure == "throughput_samples_s":
        return fmt.EMPTY if fmt.missing(value) else f"{fmt.number(value)}/s"
    if figure in MEMORY:
        return fmt.bytes_(value)
    if fmt.missing(value):
        return fmt.EMPTY
    # accuracy as the accuracy section shows it: bits per byte as they are, a share in percent
    return fmt.number(value, 3) if row["metric"] in LOWER_IS_BETTER_METRICS else f"{100 * float(value):.2f}%"


def _threshold(value, figure: str = "") -> str:
    """The threshold as shown: a timing's is symmetric in the ratio's logarithm, so a fall counts beyond
    -t / (1 + t) where a rise counts beyond +t."""
    if fmt.missing(value):
        return fmt.EMPTY
    if figure in TIMINGS:
        return f"+{fmt.percent(value)} / -{fmt.percent(value / (1 + value))}"
    return f"±{fmt.percent(value)}"


def formatted_rows(comparison: pd.DataFrame, verdict: str) -> list[dict]:
    """The rows with one verdict as text: cell, figure, old, new, change, threshold, basis."""
    return [{"cell": cell_label(row), "figure": _figure_label(row), "old": _value(row, "old"),
             "new": _value(row, "new"), "change": fmt.signed_percent(row["change"]),
             "threshold": _threshold(row["threshold"], row["figure"]), "basis": fmt.text(row["basis"]),
             "verdict": verdict}
            for _, row in comparison[comparison["verdict"] == verdict].iterrows()]


# verdict -> (heading, how the counts name it)
SECTIONS = {"worse": ("Worse", "worse"), "better": ("Better", "better"),
            "changed": ("Changed: a failure for another, or a figure one run lacks", "changed"),
            "added": ("Added cells", "added"),
            "removed": ("Removed cells", "removed"), "within noise": ("Within noise", "within noise")}
METHOD = ("Cells match on workload, size, mode, technique, GPU, source and shape (batch, sequence, image, ranks); "
          "measured rows compare with measured, projected with projected. A measured timing counts when its change "
          "exceeds twice the two runs' combined coefficient of variation (about 95%; at least 2%), a projected one "
          "beyond 1%, either way on the ratio's logarithm (a rise beyond +t, a fall beyond -t / (1 + t)); memory "
          "beyond max(1 MiB, 1%); accuracy beyond twice the combined standard error over seeds.")


def compare_markdown(comparison: pd.DataFrame, old_label: str, new_label: str) -> str:
    """A pull-request summary: the counts, then the worse rows, the better ones, status changes between
    failures and added and removed cells (within-noise rows are only counted), at most 50 rows a table."""
    lines = [f"## headroom comparison: {escape(old_label)} → {escape(new_label)}", "",
             f"**{counts_line(comparison)}**.", "", METHOD, ""]
    for verdict, (title, _) in SECTIONS.items():
        rows = formatted_rows(comparison, verdict)
        if not rows or verdict == "within noise":
            continue
        # An added or removed cell has no figures to set side by side: its status says what became of it.
        cells_only = verdict in ("added", "removed")
        headers = ["cell", "old", "new"] if cells_only else ["cell", "figure", "old", "new", "change", "threshold"]
        lines += [f"### {title} ({len(rows)})", "",
                  table(headers, [[row[key] for key in headers] for row in rows], right_from=3 if cells_only else 2),
                  ""]
    if not len(comparison):
        lines += ["No cells in either results.", ""]
    return "\n".join(lines)


def comparison_context(comparison: pd.DataFrame, old_label: str, new_label: str) -> dict:
    """Everything compare.html.j2 shows, already formatted."""
    counts = verdict_counts(comparison)
    return {"title": f"headroom comparison: {old_label} → {new_label}", "old_label": old_label,
            "new_label": new_label, "summary": counts_line(comparison), "method": METHOD,
            "counts": [{"verdict": name, "count": str(counts[verdict])} for verdict, (_, name) in SECTIONS.items()],
            "headers": ["cell", "figure", "old", "new", "change", "threshold", "noise basis"],
            "sections": [{"verdict": verdict, "title": title, "rows": formatted_rows(comparison, verdict)}
                         for verdict, (title, _) in SECTIONS.items()]}


def render_comparison(comparison: pd.DataFrame, old_label: str, new_label: str) -> str:
    from reports.build import environment_for_templates

    context = comparison_context(comparison, old_label, new_label)
    return environment_for_templates().get_template("compare.html.j2").render(**context)


def write_comparison(comparison: pd.DataFrame, out: Path, old_label: str, new_label: str,
                     markdown: bool = False) -> Path:
    """Write the comparison atomically: an HTML page, or with `markdown` the pull-request summary."""
    text = (compare_markdown if markdown else render_comparison)(comparison, old_label, new_label)
    return write_text(text, out)
