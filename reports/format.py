"""Number formatting for people: the only place raw values become text."""

from __future__ import annotations

import pandas as pd

EMPTY = "–"


def missing(value) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # containers are not missing scalars
        return False


def bytes_(value) -> str:
    """Bytes in binary units (GiB/MiB/KiB), as allocators and nvidia-smi count them."""
    if missing(value):
        return EMPTY
    value = float(value)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        # Compare after rounding to one decimal, so 2**20 - 1 reads "1.0 MiB", not "1024.0 KiB"
        # (bytes below 1 KiB are printed whole, so they need no rounding).
        if abs(value) >= size or (size > 2**10 and round(abs(value) / size, 1) >= 1):
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def number(value, digits: int = 1) -> str:
    if missing(value):
        return EMPTY
    return f"{float(value):,.{digits}f}"


def rate(value) -> str:
    """A throughput in whole units from 100 up, to three significant figures below: a projection's interval
    spans tens of percent, so the decimals of 86,730.8 tokens/s would claim a precision no figure here has."""
    if missing(value):
        return EMPTY
    value = float(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def percent(value) -> str:
    if missing(value):
        return EMPTY
    return f"{100 * float(value):.1f}%"


def signed_percent(value) -> str:
    """A relative change with its sign always shown: "+30.0%", "-2.5%"."""
    if missing(value):
        return EMPTY
    return f"{100 * float(value):+.1f}%"


def usd(value) -> str:
    """Dollars to the cent; below ten cents to two significant digits, so a cheap cost still ranks."""
    if missing(value):
        return EMPTY
    value = float(value)
    if 0 < abs(value) < 0.1:
        return f"${value:.2g}" if abs(value) >= 1e-4 else "< $0.0001"
    return f"${value:,.2f}"


def text(value) -> str:
    return EMPTY if missing(value) or value == "" else str(value)


def flag(value, label: str) -> str:
    """`label` where a boolean flag is set, the empty mark where it is unset or unknown."""
    return label if not missing(value) and bool(value) else EMPTY
