"""The ledger: every projected-vs-measured pair (twin) the project has seen, and the error bars it gives.

A versioned CSV ships with the package (`harness/data/ledger.csv`, seeded from the GPU check's twins);
`headroom run` writes its own twins to `ledger.csv` in its results folder, and `headroom ledger add
RESULTS...` merges pairs from any machine into a ledger, deduplicated by a hash of the pair and kept
with its provenance (device, driver, torch, headroom version). A projected row's interval is a
95% prediction interval of measured / projected over the cells of its kind (workload, precision, GPU
generation), widening to broader kinds where a narrow one has too few cells, never narrower than
the speed model's held-out error, and says what it rests on.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd

from harness.records import atomic_write
from harness.twins import projected_reserved, timing_noisy, twin_pairs

LEDGER_FILE = Path(__file__).resolve().parent / "data" / "ledger.csv"
LEDGER_VERSION = 1
LEDGER_NAME = "ledger.csv"  # a results folder's own twins
COLUMNS = ["ledger_version", "pair_id", "workload", "size", "mode", "technique", "gpu", "generation", "precision",
           "batch_size", "seq_len", "image_size", "allocator", "measured_step_ms", "projected_step_ms",
           "measured_peak_reserved_bytes", "projected_peak_reserved_bytes", "measured_peak_allocated_bytes",
           "projected_peak_allocated_bytes", "step_time_noisy", "device_name", "driver_version", "torch_version",
           "headroom_version", "measured_at", "projected_by", "origin", "gen_len"]
# Columns added after ledgers were first written: a ledger without one reads it as empty. `gen_len`: tokens a
# served decoder's measured cell generated (its step is the whole generation); empty for one forward pass.
LATER_COLUMNS = ("gen_len",)
NUMERIC_COLUMNS = ["gen_len", "batch_size", "measured_step_ms", "projected_step_ms", "measured_peak_reserved_bytes",
                   "projected_peak_reserved_bytes", "measured_peak_allocated_bytes", "projected_peak_allocated_bytes"]
# A kind needs this many cells before its own spread is trusted; else the next broader kind is used.
MIN_PAIRS = 3
# With no pair at all, the interval spans this factor either side of the projection.
NO_PAIRS_FACTOR = 3.0


def pair_id(row: dict) -> str:
    """A stable hash of what makes a pair the same pair wherever it is merged from."""
    key = [row.get(c) for c in ("workload", "size", "mode", "technique", "gpu", "batch_size", "seq_len",
                                "allocator", "device_name", "driver_version", "torch_version", "measured_step_ms",
                                "measured_peak_reserved_bytes", "measured_at")]
    if _value(row.get("gen_len")) is not None:  # only where present: the ids of earlier pairs stay as they were
        key.append(int(row["gen_len"]))  # 128 whether a frame held it as an integer or a float
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]


def _value(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA else value


def pairs_from_rows(rows: list[dict], generations: dict[str, str], origin: str) -> pd.DataFrame:
    """Ledger rows for the twins among results rows (`generations`: profile id -> generation)."""
    out = []
    for projected, measured in twin_pairs(rows):
        row = {
            "ledger_version": LEDGER_VERSION, "workload": measured["workload"], "size": measured["size"],
            "mode": measured["mode"], "technique": measured["technique"], "gpu": measured["gpu"],
            "generation": generations.get(measured["gpu"], "unknown"), "precision": measured.get("precision"),
            "batch_size": measured["batch_size"], "seq_len": _value(measured.get("seq_len")),
            "image_size": _value(measured.get("image_size")), "allocator": _value(measured.get("allocator")),
            "measured_step_ms": _value(measured.get("step_time_ms_p50")),
            "projected_step_ms": _value(projected.get("step_time_ms_p50")),
            "measured_peak_reserved_bytes": _value(measured.get("peak_reserved_bytes")),
            "projected_peak_reserved_bytes": _value(projected_reserved(projected, measured)),
            "measured_peak_allocated_bytes": _value(measured.get("peak_allocated_bytes")),
            "projected_peak_allocated_bytes": _value(projected.get("peak_allocated_bytes")),
            "step_time_noisy": timing_noisy(measured),
            "device_name": measured.get("device_name"), "driver_version": _value(measured.get("driver_version")),
            "torch_version": measured.get("torch_version"), "headroom_version": measured.get("git_sha"),
            "measured_at": measured.get("created_at"), "projected_by": projected.get("git_sha"), "origin": origin,
            "gen_len": _value(measured.get("gen_len"))}
        row["pair_id"] = pair_id(row)
        out.append(row)
    return pd.DataFrame(out, columns=COLUMNS)


def pairs_from_frame(frame: pd.DataFrame, profiles: dict, origin: str) -> pd.DataFrame:
    """Ledger rows for the twins in a results frame (missing values as None, as cell files hold them)."""
    rows = [{k: _value(v) for k, v in row.items()} for row in frame.astype(object).to_dict("records")]
    return pairs_from_rows(rows, {k: p.generation for k, p in profiles.items()}, origin)


def pairs_from(path: Path, profiles: dict) -> pd.DataFrame:
    """The pairs a path holds: a ledger file as it is, a results folder or file through its twins."""
    path = Path(path)
    if path.is_dir() and (path / LEDGER_NAME).exists() and not (path / "results.parquet").exists():
        path = path / LEDGER_NAME
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or a device would block
        raise ValueError(f"{path}: not a regular file (a FIFO, a device); give a ledger, results file or folder")
    if path.suffix == ".csv" and path.is_file() and "pair_id" in _header(path):
        return read_ledger(path)
    from harness.records import read_results

    return pairs_from_frame(read_results(path), profiles, origin=str(path))


def _header(path: Path) -> list[str]:
    """A CSV file's column names; ValueError naming the file where it cannot be read as text."""
    try:
        return list(pd.read_csv(path, nrows=0).columns)
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable CSV file ({type(exc).__name__}); give a ledger or results "
                         "file") from None


def read_ledger(path: Path = LEDGER_FILE) -> pd.DataFrame:
    """A ledger file as a frame (empty with the columns where the file does not exist)."""
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    frame = pd.read_csv(path)
    for column in LATER_COLUMNS:
        if column not in frame:
            frame[column] = pd.NA
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        raise ValueError(f"{path}: not a headroom ledger (missing columns {', '.join(missing[:3])}); "
                         "give a ledger.csv written by headroom")
    newer = pd.to_numeric(frame["ledger_version"], errors="coerce").fillna(0) > LEDGER_VERSION
    if newer.any():
        raise ValueError(f"{path}: ledger version newer than this headroom's {LEDGER_VERSION}; upgrade headroom")
    for column in NUMERIC_COLUMNS:  # a figure that is not a number would fail every interval built on it, later
        bad = pd.to_numeric(frame[column], errors="coerce").isna() & frame[column].notna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise ValueError(f"{path}: column {column}, row {row + 2}: {str(frame[column].iloc[row])[:40]!r} is not "
                             "a number; mend or remove that row")
    return frame[COLUMNS]


def merge(ledger: pd.DataFrame, new: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """`ledger` with the pairs of `new` it does not hold yet, and how many were added. A pair is its
    measurement (`pair_id`): the projection first recorded beside it is kept, and
    benchmarks/projection_calibration.py --write refreshes every pair's projection with the current model."""
    fresh = new[~new["pair_id"].isin(ledger["pair_id"])].drop_duplicates("pair_id")
    if fresh.empty:
        return ledger, 0
    merged = fresh if ledger.empty else pd.concat([ledger, fresh], ignore_index=True)
    return merged, len(fresh)


def write_ledger(frame: pd.DataFrame, path: Path) -> None:
    atomic_write(path, lambda tmp: frame[COLUMNS].to_csv(tmp, index=False))


@dataclass(frozen=True)
class Interval:
    """The range a projected figure's true value is expected in, and what it rests on."""

    low: float
    high: float
    cells: int  # measured cells it rests on (0: the wide default)
    basis: str


def workload_family(workload: str) -> str:
    """`hf:/x/config.json` -> `hf`, `model:pkg:f` -> `model`; built-in names are their own family."""
    return workload.split(":", 1)[0]


# Two-sided 95% quantiles of Student's t by degrees of freedom (a standard table; scipy.stats.t.ppf
# gives the same, tests check it): importing scipy.stats would cost every projection half a second.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}
CELL = ["workload", "size", "mode", "technique", "gpu", "batch_size", "seq_len", "gen_len"]


def t_975(degrees: int) -> float:
    """The table's quantile for `degrees`, or the largest tabulated one's below it (wider, so the interval
    errs wide); past the table's last entry, that entry's."""
    known = [d for d in T_975 if d <= degrees]
    return T_975[max(known)] if known else T_975[1]


def usable_pairs(ledger: pd.DataFrame, measured_column: str, projected_column: str) -> pd.DataFrame:
    """The pairs an interval on that figure may rest on: both figures present and positive, a step time not
    flagged noisy, a reserved figure measured under the native allocator (the one projected)."""
    usable = ledger.dropna(subset=[measured_column, projected_column])
    if measured_column == "measured_step_ms":
        usable = usable[~usable["step_time_noisy"].astype(str).isin(["True", "true", "1"])]
    else:  # a native reserved figure is compared only with twins measured under the native allocator
        usable = usable[usable["allocator"].isna() | (usable["allocator"] == "native")]
    return usable[(pd.to_numeric(usable[measured_column]) > 0) & (pd.to_numeric(usable[projected_column]) > 0)]


def interval(projected: float, ledger: pd.DataFrame, measured_column: str, projected_column: str,
             workload: str, precision: str | None, generation: str, floor: float = 0.0,
             other_generations_floor: float | None = None) -> Interval:
    """The interval around `projected` from the ledger's errors for the closest kind with enough cells.

    Each cell counts once (its repeated pairs, e.g. under other allocator settings, are averaged); the
    interval is a 95% prediction interval of log(measured / projected) over those cells (Student's t),
    at least `floor` (a relative error) either side, and at least `other_generations_floor` where the
    kind's cells are all on other GPU generations."""
    usable = usable_pairs(ledger, measured_column, projected_column)
    usable = usable.assign(log_ratio=np.log(pd.to_numeric(usable[measured_column]).to_numpy(float)
                                            / pd.to_numeric(usable[projected_column]).to_numpy(float)))
    same_family = usable["workload"].map(workload_family) == workload_family(workload)
    same_precision = usable["precision"] == precision
    kinds = [
        (f"{workload_family(workload)} {precision} on {generation}",
         same_family & same_precision & (usable["generation"] == generation)),
        (f"{workload_family(workload)} {precision}", same_family & same_precision),
        (f"{precision} on any workload", same_precision),
        ("every cell", pd.Series(True, index=usable.index)),
    ]
    for name, chosen in kinds:
        rows = usable[chosen]
        cells = rows.groupby(CELL, dropna=False)["log_ratio"].mean()
        if len(cells) < MIN_PAIRS:
            continue
        ratios = cells.to_numpy(float)
        n = len(ratios)
        half = t_975(n - 1) * ratios.std(ddof=1) * math.sqrt(1 + 1 / n)
        lowest = math.log1p(floor)
        generations = set(rows["generation"])
        note = ""
        if generation not in generations:
            note = f", all on {', '.join(sorted(map(str, generations)))}"
            if other_generations_floor is not None:
                lowest = max(lowest, math.log1p(other_generations_floor))
                note += ": widened"
        centre = ratios.mean()
        low = min(0.0, centre - max(half, lowest))
        high = max(0.0, centre + max(half, lowest))
        return Interval(projected * math.exp(low), projected * math.exp(high), n,
                        f"{n} cells ({name}{note})")
    return Interval(projected / NO_PAIRS_FACTOR, projected * NO_PAIRS_FACTOR, 0,
                    f"no measured pairs: x1/{NO_PAIRS_FACTOR:g} to x{NO_PAIRS_FACTOR:g}")


def unfitted_interval(projected: float, why: str = "speed constants not fitted for this vendor") -> Interval:
    """The wide default, for a GPU whose vendor's speed constants were never fitted on a measurement
    (no pair of another vendor says how far off its priors are), or a kind of step never measured."""
    return Interval(projected / NO_PAIRS_FACTOR, projected * NO_PAIRS_FACTOR, 0,
                    f"{why}: x1/{NO_PAIRS_FACTOR:g} to x{NO_PAIRS_FACTOR:g}")


def decode_interval(projected: float, decode_fit: dict) -> Interval:
    """The interval of a generation of the kind published decodes judge (harness/project/__init__.py): as
    wide as the decode fit's worst error on published decodes it did not see, either way (decode_fit.toml: its
    fit rows left out by model, and the held-out rows it never saw). An error e in tokens/s is a measured time
    of (1 + e) times the projected one, so the band is projected x (1 - worst) to x (1 + worst)."""
    worst = max(decode_fit["held_out_worst_abs_error"], decode_fit.get("held_out_rows_worst_abs_error", 0.0))
    rows = int(decode_fit["rows"]) + int(decode_fit.get("held_out_rows", 0))
    return Interval(projected * (1 - worst), projected * (1 + worst), rows,
                    f"{rows} published one-row compiled decodes (benchmarks/decode_calibration.py): "
                    f"their worst held-out error, {worst:.0%}, either way")


@cache
def shipped_ledger() -> pd.DataFrame:
    """The package's ledger, read once per process."""
    return read_ledger(LEDGER_FILE)
