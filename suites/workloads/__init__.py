"""The workload registry: every benchmarked model, by name, imported explicitly (no directory scan)."""

from __future__ import annotations

import difflib

from suites.workloads import bert, gpt, resnet50
from suites.workloads.base import Workload

WORKLOADS: dict[str, Workload] = {}

for _workload in (resnet50.WORKLOAD, bert.WORKLOAD, gpt.WORKLOAD):
    if _workload.name in WORKLOADS:
        raise ValueError(f"duplicate workload name {_workload.name!r}")
    WORKLOADS[_workload.name] = _workload


def get_workload(name: str) -> Workload:
    """The workload called `name`; ValueError listing the valid ones (and the closest) otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        message = f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}"
        close = difflib.get_close_matches(name, WORKLOADS, n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        raise ValueError(message) from None
