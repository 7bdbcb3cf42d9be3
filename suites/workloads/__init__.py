"""The workload registry: every benchmarked model, by name, imported explicitly (no directory scan)."""

from __future__ import annotations

import dataclasses
import difflib
import math

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
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown workload {name!r}{hint}; valid: {', '.join(known)}") from None


def spec_as_run(workload: str, size: str, seq_len=None, config: dict | None = None):
    """A built-in size's spec as a measured row ran it: its sequence length (None, blank or NaN: the size's own)
    and any `config` overrides of the model's shape (a name the model does not take fails where it is built)."""
    spec = WORKLOADS[workload].sizes[size]
    if seq_len and not (isinstance(seq_len, float) and math.isnan(seq_len)) and spec.seq_len != int(seq_len):
        spec = dataclasses.replace(spec, seq_len=int(seq_len))
    if config:
        spec = dataclasses.replace(spec, config={**spec.config, **config})
    return spec
