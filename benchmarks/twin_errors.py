"""The projection against its measured twins in one results folder: peak allocated, peak reserved
(the allocator model; GPUs only) and step time, as projected / measured - 1, per cell.
Usage: python benchmarks/twin_errors.py results/RUN [more results folders]
"""

from __future__ import annotations

import sys

import pandas as pd

from harness.records import read_results

KEY = ["workload", "size", "mode", "technique", "gpu", "batch_size"]
ERRORS = {"peak_error_vs_measured": "peak", "reserved_error_vs_measured": "reserved",
          "step_time_error_vs_measured": "step time"}
MEASURES = {"peak_error_vs_measured": "peak_allocated_bytes", "reserved_error_vs_measured": "peak_reserved_bytes",
            "step_time_error_vs_measured": "step_time_ms_p50"}


def twin_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per projected cell that has a measured twin: both peaks and the three errors."""
    measured = frame[(frame["source"] == "measured") & (frame["status"] == "ok")]
    projected = frame[(frame["source"] == "projected") & (frame["status"] == "ok")]
    pairs = projected.merge(measured, on=KEY, suffixes=("", "_measured"))
    table = pairs[KEY].copy()
    table["measured_peak_mib"] = pairs["peak_allocated_bytes_measured"].astype("Float64") / 2**20
    table["projected_peak_mib"] = pairs["peak_allocated_bytes"].astype("Float64") / 2**20
    table["measured_step_ms"] = pairs["step_time_ms_p50_measured"]
    # From the pair itself, not the attached columns: a run cut short never attaches them.
    for column, label in ERRORS.items():
        measure = MEASURES[column]
        projected_value = pd.to_numeric(pairs[measure], errors="coerce")
        measured_value = pd.to_numeric(pairs[f"{measure}_measured"], errors="coerce")
        table[f"{label} err"] = (projected_value / measured_value.where(measured_value > 0) - 1).astype("Float64")
    return table


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    frames = []
    for path in paths:
        try:
            frames.append(read_results(path))
        except (OSError, ValueError) as exc:  # a run cut short may have written nothing yet
            print(f"skipped {path}: {exc}", file=sys.stderr)
    if not frames:
        print("no readable results")
        return 1
    table = twin_table(pd.concat(frames, ignore_index=True))
    if table.empty:
        print("no projected row has a measured twin in these results")
        return 1
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 500,
                           "display.float_format", "{:,.3f}".format):
        print(table.to_string(index=False))
    for label in ERRORS.values():
        values = pd.to_numeric(table[f"{label} err"], errors="coerce").dropna().abs()
        if len(values):
            print(f"{label}: {len(values)} twins, mean |error| {values.mean():.1%}, worst {values.max():.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
