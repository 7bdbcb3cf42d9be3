"""The projection against its measured twins in one results folder: peak allocated, peak reserved
(the allocator model, under the allocator setting the twin ran under; GPUs only) and step time, as
projected / measured - 1, per cell.
Usage: python benchmarks/twin_errors.py results/RUN [more results folders]
"""

from __future__ import annotations

import sys

import pandas as pd

from harness.records import read_results
from harness.twins import twin_table

LABELS = ("peak", "reserved", "step time", "comm")


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
    with pd.option_context("display.width", 220, "display.max_columns", 20, "display.max_rows", 500,
                           "display.float_format", "{:,.3f}".format):
        print(table.to_string(index=False))
    for label in LABELS:
        values = pd.to_numeric(table[f"{label} err"], errors="coerce").dropna().abs()
        if len(values):
            print(f"{label}: {len(values)} twins, mean |error| {values.mean():.1%}, worst {values.max():.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
