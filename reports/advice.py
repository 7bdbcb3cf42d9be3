"""OOM advice in the report: for every cell that does not fit, the stacks among the report's own rows
that fit the same model on the same GPU, ranked by step time (harness/advise.py ranks and words them,
as `headroom advise` does for a cell it projects, trying more stacks than a run's rows hold)."""

from __future__ import annotations

import pandas as pd

from harness.advise import rank_fixes, row_memory_left, row_memory_left_worst
from reports.cells import gpu_cells

CELL = ["workload", "size", "mode", "gpu"]


def _summary(row, capacity) -> dict:
    number = lambda name: None if pd.isna(pd.to_numeric(row.get(name), errors="coerce")) \
        else float(pd.to_numeric(row.get(name), errors="coerce"))  # noqa: E731
    return {"stack": str(row["technique"]), "reserved": number("peak_reserved_bytes"),
            "step_ms": number("step_time_ms_p50"), "source": str(row["source"]),
            "left": row_memory_left(row, capacity),
            "worst": row_memory_left_worst(row, capacity) if str(row.get("source")) == "projected" else None}


def oom_advice(frame: pd.DataFrame, capacities: dict[str, int]) -> list[dict]:
    """One entry per OOM cell on a GPU profile: the cell, how short it is, and the ranked fixes found."""
    if not len(frame):
        return []
    rows = gpu_cells(frame, capacities)
    entries = []
    for key, group in rows.groupby(CELL, sort=False):
        fitting = group[group["status"] == "ok"]
        for _, oom in group[group["status"] == "oom"].iterrows():
            capacity = capacities[oom["gpu"]]
            target = _summary(oom, capacity)
            same_batch = fitting[fitting["batch_size"] == oom["batch_size"]] if "batch_size" in fitting else fitting
            lines = rank_fixes(target, [_summary(row, capacity) for _, row in same_batch.iterrows()])
            entries.append({"cell": " ".join(str(k) for k in key) + f" / {oom['technique']}",
                            "model": " ".join(str(k) for k in key[:3]), "gpu": str(key[3]),
                            "short": "unknown" if target["left"] is None else f"{-target['left'] / 2**30:,.1f} GiB",
                            "fixes": lines[:3], "more": max(0, len(lines) - 3)})
    # The cells a stack in these rows rescues first; the rest need what the rows did not try.
    return sorted(entries, key=lambda entry: not entry["fixes"])


def unfixed(entries: list[dict]) -> list[dict]:
    """The cells no stack in the rows fits, one line per model and mode: which GPUs, how many cells, and the
    range they are short by (a report's hundreds of such cells would otherwise repeat one sentence each)."""
    groups: dict[str, dict] = {}
    for entry in entries:
        if entry["fixes"]:
            continue
        group = groups.setdefault(entry["model"], {"model": entry["model"], "gpus": [], "cells": 0})
        group["cells"] += 1
        if entry["gpu"] not in group["gpus"]:
            group["gpus"].append(entry["gpu"])
    return [dict(group, gpus=", ".join(group["gpus"])) for group in groups.values()]
