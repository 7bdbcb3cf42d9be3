"""The `headroom` command's argument types and output guards: each parses and checks one flag's value
(a count, a size, a price, a path to write) before any work starts, so bad input costs one line and
exit code 2 (harness/cli.py), never a half-done run.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


def printable(text: str) -> str:
    """`text` with control characters escaped (`\\x1b`): a path or name from the user is printed as what
    it is, and an escape sequence in it cannot redraw the terminal."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _profiles(args):
    from harness.profiles import load_profiles

    return load_profiles(args.profiles)


def _csv(text: str) -> list[str]:
    """A comma-separated list of names; empty is refused (it would silently mean "nothing" or "all")."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected one or more names, got nothing")
    return parts


# Batches and sequence lengths beyond this are refused: tensor sizes, the records' integer columns and
# every allocator figure derived from them stay far from overflow, and no device holds such a batch.
MAX_COUNT = 2**31 - 1
# A cell may take a week, no more: a larger timeout overflows the OS's timers (and means "none").
MAX_CELL_TIMEOUT_S = 7 * 24 * 3600.0


def _name(text: str, what: str = "") -> str:
    """One id (a workload, size, GPU or stack); empty is refused rather than taken for the default, and a
    comma-separated list (what `headroom run` takes) is refused with how to ask for one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name, got nothing (give one, or leave the flag out where it "
                                         "has a default)")
    if "," in text:
        raise argparse.ArgumentTypeError(f"expected one name, got the list {text.strip()!r}: this command answers for "
                                         f"one at a time{what}; `headroom run` takes comma-separated lists")
    return text.strip()


def _names(text: str) -> str:
    """One id, or several separated by commas (project's GPUs): only empty is refused."""
    _name(text.replace(",", " "))  # refuses an empty list; commas are the list's separators here
    return text.strip()


def _stack(text: str) -> str:
    """One technique stack: `_name`, whose refusal of a list says how a stack joins its techniques."""
    return _name(text, " (one stack joins its techniques with '+': amp-bf16+checkpointing)")


def _bounded(low: int, high: int, what: str):
    """An integer type from `low` to `high`: `what` it counts is named in the refusal."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high} {what}, got {text}")
        return value

    return parse


def _count(text: str) -> int:
    """A positive integer no larger than MAX_COUNT."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_COUNT}, got {text}")
    return value


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _seconds(text: str) -> float:
    """A finite, positive number of seconds, at most a week."""
    value = _number(text, "seconds")
    if not 0 < value <= MAX_CELL_TIMEOUT_S:  # also false for nan
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most {MAX_CELL_TIMEOUT_S:g}, got {text}")
    return value


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _memory_size(text: str) -> int:
    """Bytes from `16G`, `512M`, `1.5T` or a plain number of bytes; at least 2 GiB (importing torch alone
    needs about 1 GiB of data segment) and at most 1 PiB."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 16G or 512M, got {text!r}")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if not 2**31 <= value <= 2**50:
        raise argparse.ArgumentTypeError(f"expected a size from 2G to 1024T, got {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    """A number strictly between 0 and 1 (a coefficient of variation to flag noise at)."""
    value = _number(text, "a number between 0 and 1")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, got {text}")
    return value


def _folder(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return Path(text)


def _out_path(text: str) -> Path:
    """A path to write: a folder of results is written as Parquet, whose strings must be UTF-8, so a
    name that is not (bytes a terminal passed through) is refused before any work is done."""
    path = _folder(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{printable(text)!r} is not valid UTF-8; choose another name") from None
    return path


# The files a results folder keeps (harness/records.py, ledger.py, serve_matrix.py, reports/fragmentation.py).
RUN_FILES = ("results.parquet", "results.csv", "ledger.csv", "accuracy.csv", "fragmentation.csv", "serve_matrix.csv")


def guard_output(path: Path, own: str | None = None, flag: str = "--out", folder: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written or a file that would overwrite a results
    folder's own files: a run's rows, twins, accuracy, probe or matrix, or a cell file (`own`: the one file
    name this command writes where it would be the run's own, e.g. serve_matrix.csv for serve-matrix).
    `folder`: the output is a folder (calibrate's overlays)."""
    if folder and path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {printable(str(path))} is a file; it names a folder: choose another {flag}")
    if not folder and path.is_dir():
        raise UsageError(f"{flag} {printable(str(path))} is a folder; give a file name")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{flag} {printable(str(path))}: {printable(str(parent))} is a file, not a folder; "
                         f"choose another {flag}")
    if folder:
        return
    holds_run = path.parent.is_dir() and any((path.parent / name).exists() for name in (*RUN_FILES, "cells"))
    in_cells = path.parent.name == "cells" and any((path.parent.parent / name).exists() for name in RUN_FILES)
    if (path.name in RUN_FILES and path.name != own and holds_run) or in_cells:
        raise UsageError(f"{flag} {printable(str(path))} would overwrite a results folder's own file; "
                         f"choose another {flag}")


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a price in USD such as 0.15, got {text!r}") from None
    if not 0 < value < 1e3 or value != value:
        raise argparse.ArgumentTypeError(f"expected a positive price below 1000 USD, got {text!r}")
    return value
