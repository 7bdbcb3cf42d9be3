"""The report's fragmentation section: the probe's rows (`headroom fragmentation --out`, or a results
folder's fragmentation.csv) as a table, and the guide's C4 judged on them."""

from __future__ import annotations

import dataclasses

import pandas as pd

from harness.fragmentation import FragmentationResult, judge_c4
from reports import format as fmt

FILE = "fragmentation.csv"
COLUMNS = [("scenario", "scenario", fmt.text), ("allocator", "allocator", fmt.text), ("source", "source", fmt.text),
           ("peak_reserved_bytes", "peak reserved", fmt.bytes_),
           ("allocated_at_reserved_peak_bytes", "allocated at that peak", fmt.bytes_),
           ("waste", "reserved not allocated", fmt.percent),
           ("most_held_free_bytes", "most held free", fmt.bytes_),
           ("largest_free_block_bytes", "largest free block", fmt.bytes_), ("retries", "retries", fmt.text)]


def fragmentation_section(rows: pd.DataFrame | None) -> dict | None:
    """The probe's table and C4's verdict; None without rows."""
    if rows is None or rows.empty:
        return None
    names = {f.name for f in dataclasses.fields(FragmentationResult)}

    def result(row) -> FragmentationResult:
        values = {k: (None if fmt.missing(v) else v) for k, v in row.items() if k in names}
        return FragmentationResult(**values)

    results = [result(row) for _, row in rows.iterrows()]
    table = [{"cells": [f(row[c]) if c in row else fmt.EMPTY for c, _, f in COLUMNS], "status": "ok", "reason": ""}
             for _, row in rows.iterrows()]
    return {"headers": [h for _, h, _ in COLUMNS], "rows": table, "c4": judge_c4(results)}
