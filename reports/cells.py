"""Which rows the report's decision sections read: one row per cell on a GPU profile, the measured row
standing in for its projected twin whatever either's status (a cell measured to run out of memory is
out of memory, whatever its projection said), a parallel cell by its own row (the maximum over ranks)."""

from __future__ import annotations

import pandas as pd

CELL = ["workload", "size", "mode", "technique", "gpu", "batch_size", "world_size", "seq_len"]


def gpu_cells(frame: pd.DataFrame, capacities: dict, single_device: bool = False, twins: bool = False) -> pd.DataFrame:
    """Cell rows on the GPUs of `capacities` (not the CPU), measured rows replacing projected twins (kept
    beside them with `twins`); `single_device` keeps only cells on one device."""
    if not len(frame):
        return frame
    rows = frame[frame["gpu"].isin(capacities)]
    if "rank" in rows:
        rows = rows[rows["rank"].isna()]
    if single_device and "world_size" in rows:
        rows = rows[pd.to_numeric(rows["world_size"], errors="coerce").fillna(1) <= 1]
    key = [column for column in CELL if column in rows]
    if not len(rows) or twins:
        return rows
    keys = pd.Series(["|".join(map(str, values)) for values in rows[key].itertuples(index=False)], index=rows.index)
    measured = set(keys[rows["source"] == "measured"])
    return rows[(rows["source"] == "measured") | ~keys.isin(measured)]
