"""The workload registry: every benchmarked model, by name, imported explicitly (no directory scan)."""

from __future__ import annotations

import difflib

from suites.workloads import bert, fragmentation, gpt, resnet50
from suites.workloads.base import Workload

WORKLOADS: dict[str, Workload] = {}
# Workloads that ask a question of the machine rather than of a model: run when named, never in the default
# plan (`headroom run` without --workload runs WORKLOADS).
PROBES: dict[str, Workload] = {}

for _registry, _workload in ((WORKLOADS, resnet50.WORKLOAD), (WORKLOADS, bert.WORKLOAD), (WORKLOADS, gpt.WORKLOAD),
                             (PROBES, fragmentation.WORKLOAD)):
    if _workload.name in WORKLOADS or _workload.name in PROBES:
        raise ValueError(f"duplicate workload name {_workload.name!r}")
    _registry[_workload.name] = _workload


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
    known = {**WORKLOADS, **PROBES}
    try:
        return known[name]
    except KeyError:
        message = f"unknown workload {name!r}; valid: {', '.join(known)}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        raise ValueError(message) from None
