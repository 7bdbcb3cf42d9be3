"""Property tests for profile parsing: arbitrary and mutated TOML documents either give a profile or a
one-line ProfileError, never another exception."""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.profiles import BUILTIN_PROFILES_DIR, GpuProfile, ProfileError, parse_profile


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and len(message.splitlines()) == 1, f"not one line: {message!r}"
    return message


RAW = {p.stem: tomllib.loads(p.read_text(encoding="utf-8")) for p in sorted(BUILTIN_PROFILES_DIR.glob("*.toml"))}

# --- property tests: parse_profile never raises anything but ProfileError -----------------------------------------

TOP_LEVEL_KEYS = ["id", "family", "name", "vendor", "match", "architecture", "compute_capability", "gfx_target",
                  "memory_gib", "memory_bandwidth_gb_s", "tdp_w", "sm_count", "l2_mib", "devices_per_package",
                  "peak_tflops", "sparse_tflops", "features", "interconnect", "price", "sources", "unverified",
                  "measured_at_runtime"]
# Keys without line-break characters (a key with one is a known bug, test_error_for_key_with_newline_is_one_line).
KEYS = st.text(st.characters(exclude_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
                             exclude_categories=("Cs",)), max_size=10)


def _toml_values():
    scalars = (st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1) | st.booleans()
               | st.floats() | st.dates() | st.datetimes() | st.times()
               | st.sampled_from(["", "x", "8.0", "nvidia", "bf16", "memory_gib", "fp32", "true"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        KEYS | st.sampled_from(["bf16", "fp16", "tf32", "date", "source", "usd_per_hour", "fields"]), inner,
        max_size=5), max_leaves=12)


def _check_outcome(data, path):
    try:
        profile = parse_profile(data, path)
    except ProfileError as exc:
        assert str(path) in _one_line(exc)
        return None
    assert isinstance(profile, GpuProfile)
    assert profile.memory_bytes is None or (isinstance(profile.memory_bytes, int) and profile.memory_bytes > 0)
    assert all(v > 0 for v in profile.peak_flops.values())
    assert set(profile.features) == {"bf16", "tf32", "fp8", "sparse_2to4", "flash_attention"}
    return profile


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(TOP_LEVEL_KEYS) | KEYS, _toml_values(), max_size=10))
def test_parse_profile_arbitrary_dicts(data):
    _check_outcome(data, Path("x.toml"))


# (path of keys) a mutation may delete or replace; the parent table is created when replacing under a missing one.
MUTATION_KEYS = [(k,) for k in TOP_LEVEL_KEYS] + [
    ("features", "bf16"), ("features", "fp8"), ("features", "flash_attention"), ("peak_tflops", "bf16"),
    ("peak_tflops", "fp32"), ("sparse_tflops", "fp16"), ("price", "date"), ("price", "source"),
    ("price", "usd_per_hour"), ("sources", "memory_gib"), ("sources", "peak_tflops"), ("interconnect", "gpu_link"),
    ("interconnect", "host_link_gb_s"), ("unverified", "fields"), ("colour",), ("features", "avx"),
]
REQUIRED = {("id",), ("family",), ("name",), ("vendor",), ("match",), ("features",), ("features", "bf16"),
            ("features", "fp8"), ("features", "flash_attention")}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(RAW)), st.sampled_from(MUTATION_KEYS), st.booleans(),
       _toml_values(), st.data())
def test_parse_profile_mutated_builtin(pid, keys, delete, junk, data):
    doc = copy.deepcopy(RAW[pid])
    parent = doc
    for key in keys[:-1]:
        if not isinstance(parent.get(key), dict):
            if delete:
                break
            parent[key] = {}
        parent = parent[key]
    else:
        if delete:
            parent.pop(keys[-1], None)
        else:
            parent[keys[-1]] = junk
    profile = _check_outcome(doc, Path(f"{pid}.toml"))
    if delete and keys in REQUIRED:
        assert profile is None, f"deleting {'.'.join(keys)} was accepted"
    if keys == ("memory_gib",) and profile is not None and profile.memory_bytes is not None:
        assert isinstance(junk, (int, float)) and not isinstance(junk, bool) and math.isfinite(junk) and junk > 0
