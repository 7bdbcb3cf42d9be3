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


# Users' workloads by the name asked for and by their own name (an `hf:` path made absolute).
_USER_WORKLOADS: dict[str, Workload] = {}


def get_workload(name: str) -> Workload:
    """The workload called `name`: a built-in one, a user's model (`model:package.module:factory`, see
    user.py) or a Hugging Face config (`hf:/path/config.json`, see hf.py), the latter two loaded once per
    process; ValueError listing the valid ones (and the closest) otherwise."""
    if name.startswith(("model:", "hf:")):
        if name not in _USER_WORKLOADS:
            from suites.workloads import hf, user  # hf imports transformers only when used

            loaded = (user.workload if name.startswith("model:") else hf.workload)(name)
            _USER_WORKLOADS[name] = _USER_WORKLOADS.setdefault(loaded.name, loaded)
        return _USER_WORKLOADS[name]
    try:
        return WORKLOADS[name]
    except KeyError:
        message = f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}"
        close = difflib.get_close_matches(name, WORKLOADS, n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        raise ValueError(message) from None
