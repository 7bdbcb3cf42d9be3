"""The report's accuracy section: each stack's accuracy on real data with its noise, and the guide's
claims about accuracy (C6 layer sharing, C9 INT8) judged on those rows (harness/accuracy)."""

from __future__ import annotations

import pandas as pd

from reports import format as fmt

FILE = "accuracy.csv"
GUIDE_C6_COST = 0.012  # "Layer sharing on BERT-base ... at a 1.2% accuracy cost" (GUIDE.md C6), in points
GUIDE_C9_LOSS = 0.005  # "INT8 BERT loses under 0.5% accuracy on GLUE" (GUIDE.md C9)


def _figure(value, metric: str) -> str:
    if fmt.missing(value):
        return fmt.EMPTY
    return fmt.number(value, 3) if metric == "bits-per-byte" else f"{100 * float(value):.2f}%"


def _delta(value, half, metric: str) -> str:
    if fmt.missing(value):
        return fmt.EMPTY
    unit = " bits/byte" if metric == "bits-per-byte" else " pts"
    scale = 1 if metric == "bits-per-byte" else 100
    text = f"{float(value):+.3g}" if scale == 1 else f"{scale * float(value):+.2f}"
    return text + ("" if fmt.missing(half) else f" ± {scale * float(half):.3g}") + unit


COLUMNS = ["workload", "stack", "metric", "mean ± spread", "baseline", "delta (95% CI)", "verdict",
           "top-1 agreement", "KL (nats)", "seeds x steps", "status"]


def _row(row) -> dict:
    metric = str(row["metric"])
    spread = "" if fmt.missing(row["accuracy_std"]) else f" ± {_figure(row['accuracy_std'], metric)}"
    cells = [fmt.text(row["workload"]), fmt.text(row["technique"]), fmt.text(metric),
             _figure(row["accuracy"], metric) + spread, _figure(row["baseline"], metric),
             _delta(row["delta"], row["delta_ci95"], metric), fmt.text(row["verdict"]),
             fmt.percent(row["agreement"]), fmt.number(row["kl"], 4) if not fmt.missing(row["kl"]) else fmt.EMPTY,
             f"{int(row['seeds'])} x {int(row['steps'])}", fmt.text(row["status"])]
    return {"cells": cells, "status": str(row["status"]), "reason": fmt.text(row["reason"] or row["notes"])}


def _find(frame: pd.DataFrame, workload: str, technique: str):
    hit = frame[(frame["workload"] == workload) & (frame["technique"] == technique) & (frame["status"] == "ok")]
    return None if hit.empty else hit.iloc[-1]


def _basis(row) -> str:
    return (f"{row['task']}: a {row['seeds']}-seed paired comparison on the task's small model "
            f"({int(row['steps'])} steps), not {row['workload']} at a published size on its benchmark")


def judge_c6(frame: pd.DataFrame) -> str:
    """C6: layer sharing costs 1.2 points of accuracy; judged on BERT's param-sharing row."""
    row = _find(frame, "bert", "param-sharing")
    if row is None:
        return ("not measured in these results: run headroom run --workload bert --technique param-sharing "
                "--accuracy")
    if fmt.missing(row["delta_ci95"]):
        return f"no verdict: {row['verdict']}"
    low, high = row["delta"] - row["delta_ci95"], row["delta"] + row["delta_ci95"]
    measured = f"measured {100 * row['delta']:+.2f} ± {100 * row['delta_ci95']:.2f} pts ({row['verdict']})"
    if low <= -GUIDE_C6_COST and high >= 0:
        verdict = ("inconclusive: the interval holds both no cost and the guide's 1.2 points (more seeds, or "
                   "--scale standard's longer training, narrow it)")
    elif low <= -GUIDE_C6_COST <= high:
        verdict = "consistent with the guide's 1.2-point cost"
    elif low > -GUIDE_C6_COST:
        verdict = "supported as an upper bound: sharing costs less than the guide's 1.2 points here"
    else:
        verdict = f"contradicted: sharing costs more than 1.2 points here (at least {-100 * high:.2f})"
    return f"{verdict}; {measured}; {_basis(row)}"


def judge_c9(frame: pd.DataFrame) -> str:
    """C9: INT8 BERT loses under 0.5 points; judged on BERT's ptq-int8 (and qat-int8) rows."""
    verdicts = []
    for technique in ("ptq-int8", "qat-int8"):
        row = _find(frame, "bert", technique)
        if row is None:
            continue
        basis = _basis(row)
        if fmt.missing(row["delta_ci95"]):
            verdicts.append(f"{technique}: no verdict ({row['verdict']})")
            continue
        low, high = row["delta"] - row["delta_ci95"], row["delta"] + row["delta_ci95"]
        measured = f"{100 * row['delta']:+.2f} ± {100 * row['delta_ci95']:.2f} pts"
        if low > -GUIDE_C9_LOSS:
            verdicts.append(f"{technique}: supported (loses less than 0.5 pts: {measured})")
        elif high < -GUIDE_C9_LOSS:
            verdicts.append(f"{technique}: contradicted (loses more than 0.5 pts: {measured})")
        else:
            verdicts.append(f"{technique}: inconclusive (the interval {measured} spans the 0.5-pt line; more seeds "
                            "narrow it)")
    if not verdicts:
        return "not measured in these results: run headroom run --workload bert --technique ptq-int8 --accuracy"
    return "; ".join(verdicts) + f"; {basis}"


def cost_at_quality(results: pd.DataFrame) -> pd.DataFrame:
    """Rows whose stack's accuracy is within noise of the baseline (or is the baseline), with their cost:
    the frame's answer to "what does a million samples cost at unchanged quality"."""
    keep = results["accuracy_verdict"].isin(["within noise", "reference"]) & (results["status"] == "ok")
    return results.loc[keep, ["workload", "size", "mode", "technique", "gpu", "source", "accuracy_metric",
                              "accuracy", "accuracy_verdict", "usd_per_million_samples"]]


def accuracy_section(frame: pd.DataFrame | None) -> dict | None:
    """The table and the C6/C9 verdicts; None without rows."""
    if frame is None or frame.empty:
        return None
    frame = frame.copy()
    for column in ("accuracy", "accuracy_std", "baseline", "delta", "delta_ci95", "agreement", "kl", "seeds", "steps"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    frame = frame.fillna({"reason": "", "data": "", "verdict": "", "notes": ""})
    if "notes" not in frame:
        frame["notes"] = ""
    rows = [_row(row) for _, row in frame.iterrows()]
    data = sorted({str(d) for d in frame["data"] if d})
    return {"headers": COLUMNS, "rows": rows, "c6": judge_c6(frame), "c9": judge_c9(frame), "data": data}
