"""Twins: a projected row and the measured row of the same cell on the same device in the same run,
and the projection's error against it (projected / measured - 1) for peak allocated, peak reserved,
step time and (parallel cells) the bytes a rank sends per step. The reserved figure compared is the one
projected for the allocator setting the measured process ran under."""

from __future__ import annotations

import pandas as pd

from harness.records import DEFAULT_NOISE_THRESHOLD

# What makes two rows the same cell on the same device.
KEY = ("workload", "size", "mode", "technique", "gpu", "batch_size")
# What makes a measured row a projected row's twin: the same cell in the same run (a run measures
# the cell it projects; other runs of it, e.g. the GPU check's under other allocator settings, are
# other pairs).
TWIN_KEY = ("run_id", *KEY)
# Shapes a resumed run can change within one run id (`--seq-len`, `--gen-len`, `--world-size`): a pair
# must agree on them too, or a 64-token prompt's projection would be judged against a 512-token measurement.
SHAPE_KEY = ("seq_len", "gen_len", "world_size")
# The projected reserved figure for each allocator setting a measured CUDA row can report.
RESERVED_COLUMN = {"native": "peak_reserved_bytes", "expandable_segments": "peak_reserved_expandable_bytes",
                   "cudaMallocAsync": "peak_reserved_async_bytes"}


def relative_error(projected: float | None, measured: float | None) -> float | None:
    if projected is None or pd.isna(projected) or measured is None or pd.isna(measured) or not measured:
        return None
    return float(projected) / float(measured) - 1


def projected_reserved(projected: dict, measured: dict):
    """The projected row's reserved bytes under the allocator setting its measured twin ran under."""
    setting = measured.get("allocator")
    setting = setting if isinstance(setting, str) else "native"
    return projected.get(RESERVED_COLUMN.get(setting, "peak_reserved_bytes"))


def timing_noisy(measured: dict) -> bool:
    """Whether a measured row's step time is flagged noisy. A row written without the flag (an export
    that dropped it, as the 2026-11-30 H200 check's CSV did) is judged from its recorded coefficient of
    variation by the same threshold the runner used, as schema 2's migration does."""
    flag = measured.get("noisy")
    if not pd.isna(flag):  # a bool, numpy's or Python's, or its text from a CSV
        return str(flag).lower() in ("true", "1")
    cv = pd.to_numeric(measured.get("step_time_cv"), errors="coerce")
    return bool(cv > DEFAULT_NOISE_THRESHOLD) if pd.notna(cv) else False


def twin_errors(projected: dict, measured: dict) -> dict[str, float | None]:
    """The error columns of a projected row against its measured twin. Only a CUDA twin has
    a caching allocator to compare the allocator model with (a CPU twin's reserved is unknown), and a
    twin whose timing is flagged noisy has no step time to compare with: its step-time error stays
    unknown rather than reflect the machine's load."""
    noisy = timing_noisy(measured)
    return dict(
        peak_error_vs_measured=relative_error(projected["peak_allocated_bytes"], measured["peak_allocated_bytes"]),
        reserved_error_vs_measured=relative_error(projected_reserved(projected, measured),
                                                  measured["peak_reserved_bytes"]),
        step_time_error_vs_measured=None if noisy else relative_error(projected["step_time_ms_p50"],
                                                                      measured["step_time_ms_p50"]),
        comm_error_vs_measured=relative_error(projected.get("comm_bytes_per_step"),
                                              measured.get("comm_bytes_per_step")))


def twin_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(projected, measured) for every ok projected row whose twin measured ok; the one definition of
    a twin, used by the runner (to attach the errors) and by `twin_table`."""
    ok = [row for row in rows if row["status"] == "ok"]
    # A parallel cell's twin is its cell row (the maximum over ranks), never one rank's row.
    measured = {_twin_key(row): row for row in ok if row["source"] == "measured" and pd.isna(row.get("rank"))}
    pairs = []
    for row in ok:
        if row["source"] == "projected":
            twin = measured.get(_twin_key(row))
            if twin is not None:
                pairs.append((row, twin))
    return pairs


def _twin_key(row: dict) -> tuple:
    """What a twin must share, with the shapes as plain numbers: a CSV gives 128.0 or NaN where a run gives
    128 or None, and NaN never equals NaN."""
    def shape(value):
        return None if value is None or pd.isna(value) else int(value)

    return (*(row[k] for k in TWIN_KEY), *(shape(row.get(k)) for k in SHAPE_KEY))


def twin_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per projected cell that has an ok measured twin: the peaks, the measured step time,
    the twin's allocator setting and the three errors, from the pair itself (a run cut short never
    attaches the error columns)."""
    rows = []
    for row, twin in twin_pairs(frame.to_dict("records")):
        errors = twin_errors(row, twin)
        rows.append({**{k: row[k] for k in KEY},
                     "measured_peak_mib": _mib(twin["peak_allocated_bytes"]),
                     "projected_peak_mib": _mib(row["peak_allocated_bytes"]),
                     "measured_step_ms": twin["step_time_ms_p50"],
                     "allocator": twin.get("allocator"),
                     "peak err": errors["peak_error_vs_measured"],
                     "reserved err": errors["reserved_error_vs_measured"],
                     "step time err": errors["step_time_error_vs_measured"],
                     "comm err": errors["comm_error_vs_measured"]})
    return pd.DataFrame(rows, columns=[*KEY, "measured_peak_mib", "projected_peak_mib", "measured_step_ms",
                                       "allocator", "peak err", "reserved err", "step time err", "comm err"])


def _mib(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value) / 2**20
