"""GPU prices for costing a results frame: one basis (on-demand USD per GPU-hour), each price with its
date and source, from the profiles or from a user's file (`headroom report --prices FILE`).

Rows keep the cost they were written with; the report costs them again from their throughput at the
prices shown beside them, so a price update or a negotiated rate changes every ranking consistently.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import pandas as pd

from harness.gpu_profile import price_day
from harness.profiles import PRICE_BASIS, GpuProfile, unknown_name

PRICE_COLUMNS = ("gpu", "usd_per_hour", "date", "source")
# Hyperscaler list prices moved by 40-70% during 2025-26 (the team's GPU reference notes, from providers'
# pages and secondary sources): a price over a year old may be far from today's, and the report says so.
STALE_AFTER_DAYS = 365


@dataclass(frozen=True)
class Price:
    """USD per hour for a GPU as it is rented (a package: an MI250X is one GPU of two devices)."""
    gpu: str
    usd_per_hour: float
    date: str
    source: str
    basis: str = PRICE_BASIS
    devices: int = 1  # devices in the package; each cell runs on one and pays its share

    @property
    def per_device(self) -> float:
        return self.usd_per_hour / self.devices

    @property
    def label(self) -> str:
        """`$3.78/h, 2026-05-07`: what the report prints beside a cost."""
        share = f" (${self.per_device:,.2f} per device)" if self.devices > 1 else ""
        return f"${self.usd_per_hour:,.2f}/h{share}, {self.date}"


def price_age_days(price: Price, today: date) -> int:
    """Days from a price's date (validated where it was read: harness/gpu_profile.price_day) to `today`."""
    return (today - price_day(price.date)).days


def age_text(price: Price, today: date) -> str:
    """How old a price is, in words, with a warning past STALE_AFTER_DAYS."""
    days = price_age_days(price, today)
    if days < 60:
        return f"{max(days, 0)} days"
    if days <= STALE_AFTER_DAYS:
        return f"{days // 30} months"
    return f"{days / 365.25:.1f} years: re-check, prices have moved since"


def profile_prices(profiles: dict[str, GpuProfile]) -> dict[str, Price]:
    """The profiles' own prices, for the profiles that have one."""
    return {pid: Price(pid, profile.usd_per_hour, profile.price_date, profile.price_source,
                       devices=profile.devices_per_package)
            for pid, profile in profiles.items() if profile.usd_per_hour}


def read_prices(path: Path, profiles: dict[str, GpuProfile]) -> dict[str, Price]:
    """A CSV file with columns gpu, usd_per_hour, date, source (and optionally basis), one row per
    profile id, each the GPU's price as rented (a whole MI250X package). Every problem is one line
    naming the file, the row and what to write instead."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO or a device would block, or never end
        raise ValueError(f"--prices {path}: not a regular file (a FIFO, a device or a folder); give a CSV file")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: a spreadsheet's byte-order mark
            reader = csv.DictReader(handle)
            rows, header = list(reader), reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"--prices {path}: cannot read it ({exc})") from None
    missing = [c for c in PRICE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"--prices {path}: expected a CSV with columns {', '.join(PRICE_COLUMNS)} (and optionally "
                         f"basis), one row per GPU; missing: {', '.join(missing)}")
    if not rows:
        raise ValueError(f"--prices {path}: no prices under the header; add one row per GPU")
    prices = {}
    for number, row in enumerate(rows, start=2):  # line 1 is the header
        where = f"--prices {path} line {number}"
        gpu = (row["gpu"] or "").strip()
        if gpu not in profiles:
            raise ValueError(f"{where}: {unknown_name('GPU', gpu, sorted(profiles))}")
        try:
            usd = float(row["usd_per_hour"])
        except (TypeError, ValueError):
            usd = math.nan
        if not math.isfinite(usd) or usd <= 0:
            raise ValueError(f"{where}: usd_per_hour must be a positive number of USD, got {row['usd_per_hour']!r}")
        date, source = (row["date"] or "").strip(), (row["source"] or "").strip()
        if price_day(date) is None or not source:
            raise ValueError(f"{where}: every price needs a date (YYYY, YYYY-MM or YYYY-MM-DD) and a source")
        basis = (row.get("basis") or PRICE_BASIS).strip()
        if gpu in prices:
            raise ValueError(f"{where}: {gpu} is priced twice; keep one row per GPU")
        prices[gpu] = Price(gpu, usd, date, source, basis, devices=profiles[gpu].devices_per_package)
    return prices


def price_table(profiles: dict[str, GpuProfile], override: Path | None = None) -> dict[str, Price]:
    """The profiles' prices, replaced GPU by GPU by the file's; refuses a table that mixes bases."""
    prices = profile_prices(profiles)
    if override is not None:
        prices.update(read_prices(override, profiles))
    bases = sorted({price.basis for price in prices.values()})
    if len(bases) > 1:
        raise ValueError(f"--prices {override}: prices would mix bases ({', '.join(bases)}), which reorders "
                         "rankings; price every GPU on one basis (give the others in the file too)")
    return prices


def priced_profiles(profiles: dict[str, GpuProfile], override: Path | None) -> dict[str, GpuProfile]:
    """`profiles` with each price `override` (a --prices file) gives in place of the profile's own, so what
    costs from profiles (advise's cheaper GPUs, serve-matrix) costs at the user's rates; unchanged without one."""
    if override is None:
        return profiles
    prices = price_table(profiles, override)  # validates the file, and refuses a table of mixed bases
    return {pid: replace(profile, usd_per_hour=prices[pid].usd_per_hour, price_date=prices[pid].date,
                         price_source=prices[pid].source) if pid in prices else profile
            for pid, profile in profiles.items()}


def tokens_per_sample(row) -> float | None:
    """Tokens a sample is costed by: the generated ones of a served decoder, else the sequence."""
    if row.get("mode") == "infer" and not _missing(row.get("gen_len")):
        return float(row["gen_len"])
    return None if _missing(row.get("seq_len")) else float(row["seq_len"])


def cost_rows(frame: pd.DataFrame, prices: dict[str, Price]) -> pd.DataFrame:
    """`frame` with usd_per_hour, price_label, price_source and both USD-per-million columns from
    each row's throughput at `prices` (every rank of a cell is rented: world_size devices)."""
    def costs(row):
        price = prices.get(row["gpu"])
        throughput = pd.to_numeric(row.get("throughput_samples_s"), errors="coerce")
        if price is None or _missing(throughput) or throughput <= 0:
            return None, None
        devices = 1 if _missing(row.get("world_size")) else float(row["world_size"])
        per_million = price.per_device * devices / 3600 / throughput * 1e6
        tokens = tokens_per_sample(row)
        return per_million, per_million / tokens if tokens else None

    frame = frame.copy()
    pairs = [costs(row) for _, row in frame.iterrows()]
    frame["usd_per_million_samples"] = [pair[0] for pair in pairs]
    frame["usd_per_million_tokens"] = [pair[1] for pair in pairs]
    frame["usd_per_hour"] = [prices[g].per_device if g in prices else None for g in frame["gpu"]]
    frame["price_label"] = [prices[g].label if g in prices else "no price known" for g in frame["gpu"]]
    frame["price_source"] = [prices[g].source if g in prices else None for g in frame["gpu"]]
    frame["price_date"] = [prices[g].date if g in prices else None for g in frame["gpu"]]
    return frame


def _missing(value) -> bool:
    try:
        return value is None or bool(pd.isna(value))
    except (TypeError, ValueError):
        return False
