"""GPU profile files: user profile folders, malformed files and the one-line errors they give.

(The built-in datasheets and device detection: tests/test_profiles.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.profiles import (
    BUILTIN_PROFILES_DIR,
    PROFILES_ENV,
    ProfileError,
    load_profile,
    load_profiles,
    resolve_gpus,
)
from tests.test_profiles import EXPECTED_FAMILIES

BASE_ID = "a100-sxm4-80gb"
BASE_TEXT = (BUILTIN_PROFILES_DIR / f"{BASE_ID}.toml").read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch):
    monkeypatch.delenv(PROFILES_ENV, raising=False)


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and len(message.splitlines()) == 1, f"not one line: {message!r}"
    return message

# --- user profile folders ----------------------------------------------------------------------------------------


def _custom_text(pid: str = "my-gpu", family: str = "mine", match: str = "My GPU 1") -> str:
    text = BASE_TEXT
    for pattern, repl in ((r'^id = ".*"$', f'id = "{pid}"'), (r'^family = ".*"$', f'family = "{family}"'),
                          (r'^match = \[.*\]$', f'match = ["{match}"]')):
        text, count = re.subn(pattern, repl, text, flags=re.M)
        assert count == 1, pattern
    return text


def _write_custom(folder: Path, pid: str = "my-gpu", **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{pid}.toml"
    path.write_text(_custom_text(pid, **kw), encoding="utf-8")
    return path


def test_user_profile_via_extra(tmp_path):
    path = _write_custom(tmp_path / "mine")
    loaded = load_profiles(extra=tmp_path / "mine")
    assert set(loaded) == set(EXPECTED_FAMILIES) | {"my-gpu"}
    mine = loaded["my-gpu"]
    assert mine.path == path and mine.family == "mine" and mine.match == ("My GPU 1",)
    assert mine.peak("bf16") == pytest.approx(312e12)
    assert [p.id for p in resolve_gpus(["mine"], loaded)] == ["my-gpu"]
    # Also as a str path.
    assert "my-gpu" in load_profiles(extra=str(tmp_path / "mine"))


def test_user_profile_via_env(tmp_path, monkeypatch):
    _write_custom(tmp_path / "env")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "env"))
    loaded = load_profiles()
    assert "my-gpu" in loaded and len(loaded) == len(EXPECTED_FAMILIES) + 1
    # Env and --profiles together add both folders.
    _write_custom(tmp_path / "cli", pid="other-gpu", family="other", match="Other GPU")
    both = load_profiles(extra=tmp_path / "cli")
    assert {"my-gpu", "other-gpu"} <= set(both)


def test_missing_profiles_folder_errors(tmp_path, monkeypatch):
    with pytest.raises(ProfileError) as info:
        load_profiles(extra=tmp_path / "nope")
    assert str(tmp_path / "nope") in _one_line(info.value)
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "nope-env"))
    with pytest.raises(ProfileError) as info:
        load_profiles()
    assert str(tmp_path / "nope-env") in _one_line(info.value)


def test_duplicate_id_across_user_folders(tmp_path, monkeypatch):
    first = _write_custom(tmp_path / "a")
    second = _write_custom(tmp_path / "b", match="My GPU 2")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "a"))
    with pytest.raises(ProfileError) as info:
        load_profiles(extra=tmp_path / "b")
    message = _one_line(info.value)
    assert str(first) in message and str(second) in message
    assert "my-gpu" in message


def test_duplicate_of_builtin_id(tmp_path):
    shadow = tmp_path / "t4.toml"
    shadow.write_text((BUILTIN_PROFILES_DIR / "t4.toml").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profiles(extra=tmp_path)
    message = _one_line(info.value)
    assert str(shadow) in message and str(BUILTIN_PROFILES_DIR / "t4.toml") in message


# --- malformed files ---------------------------------------------------------------------------------------------


def _line_of(text: str, pattern: str) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(pattern, line):
            return number
    raise AssertionError(pattern)


def _sub(pattern: str, repl: str):
    def mutate(text: str) -> str:
        out, count = re.subn(pattern, repl, text, count=1, flags=re.M)
        assert count == 1, f"mutation {pattern!r} did not apply: the base profile changed"
        return out

    return mutate


MEMORY_LINE = _line_of(BASE_TEXT, r"^memory_gib = 80")
# (test id, mutation of the base TOML text, text the message must name besides the path)
MUTATIONS = [
    ("missing-features-bf16", _sub(r"^bf16 = true.*\n", ""), "features.bf16"),
    ("features-bf16-string", _sub(r"^bf16 = true", 'bf16 = "yes"'), "features.bf16"),
    ("unknown-feature", _sub(r"^\[features\]\n", "[features]\navx512 = true\n"), "features.avx512"),
    ("memory-negative", _sub(r"^memory_gib = 80.*$", "memory_gib = -1"), "memory_gib"),
    ("memory-zero", _sub(r"^memory_gib = 80.*$", "memory_gib = 0"), "memory_gib"),
    ("memory-string", _sub(r"^memory_gib = 80.*$", 'memory_gib = "80"'), "memory_gib"),
    ("memory-bool", _sub(r"^memory_gib = 80.*$", "memory_gib = true"), "memory_gib"),
    ("memory-nan", _sub(r"^memory_gib = 80.*$", "memory_gib = nan"), "memory_gib"),
    ("sm-count-float", _sub(r"^sm_count = 108", "sm_count = 108.5"), "sm_count"),
    ("unknown-top-level", lambda t: 'colour = "green"\n' + t, "colour"),
    ("peak-fp4", _sub(r"^\[peak_tflops\].*\n", "[peak_tflops]\nfp4 = 1\n"), "peak_tflops.fp4"),
    ("peak-negative", _sub(r"^bf16 = 312$", "bf16 = -312"), "peak_tflops.bf16"),
    ("sparse-string", _sub(r"^bf16 = 624$", 'bf16 = "624"'), "sparse_tflops.bf16"),
    ("id-not-stem", _sub(r'^id = ".*"$', 'id = "a100-sxm4-80gb-copy"'), "id"),
    ("invalid-toml", _sub(r"^memory_gib = 80.*$", "memory_gib = = 80"), f"line {MEMORY_LINE}"),
    ("unterminated-string", _sub(r'^name = ".*$', 'name = "NVIDIA A100'), f"line {_line_of(BASE_TEXT, '^name = ')}"),
    ("missing-source", _sub(r'^memory_gib = "public.*\n', ""), "sources.memory_gib"),
    ("missing-peak-source", _sub(r'^peak_tflops = ".*\n', ""), "sources.peak_tflops"),
    ("price-without-date", _sub(r'^date = ".*\n', ""), "price.date"),
    ("price-empty-source", _sub(r'^source = ".*$', 'source = "  "'), "price.source"),
    ("price-negative", _sub(r"^usd_per_hour = .*$", "usd_per_hour = -1"), "price.usd_per_hour"),
    ("price-extra-field", _sub(r"^\[price\]\n", '[price]\ncurrency = "EUR"\n'), "price.currency"),
    ("cc-word", _sub(r'^compute_capability = ".*"$', 'compute_capability = "eight"'), "compute_capability"),
    ("cc-number", _sub(r'^compute_capability = ".*"$', "compute_capability = 8.0"), "compute_capability"),
    ("cc-three-parts", _sub(r'^compute_capability = ".*"$', 'compute_capability = "8.0.1"'), "compute_capability"),
    ("vendor-unknown", _sub(r'^vendor = ".*"$', 'vendor = "intel"'), "vendor"),
    ("match-not-list", _sub(r"^match = \[.*\]$", 'match = "NVIDIA A100"'), "match"),
    ("match-empty-name", _sub(r"^match = \[.*\]$", 'match = [""]'), "match"),
    ("missing-name", _sub(r'^name = ".*\n', ""), "name"),
    ("blank-family", _sub(r'^family = ".*"$', 'family = "   "'), "family"),
    ("interconnect-unknown", _sub(r"^\[interconnect\]\n", "[interconnect]\nlanes = 16\n"), "interconnect.lanes"),
    ("interconnect-type", _sub(r"^gpu_link_gb_s = 600", 'gpu_link_gb_s = "600"'), "interconnect.gpu_link_gb_s"),
    ("unverified-fields", lambda t: t + '\n[unverified]\nfields = "tdp_w"\n', "unverified.fields"),
]


@pytest.mark.parametrize(("mutate", "field"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_malformed_profile(tmp_path, mutate, field):
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text(mutate(BASE_TEXT), encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = _one_line(info.value)
    assert str(path) in message
    assert field in message


def test_unmutated_copy_loads(tmp_path):
    # The control for test_malformed_profile: the base text itself is valid in a new folder.
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text(BASE_TEXT, encoding="utf-8")
    assert load_profile(path).memory_bytes == 80 * 2**30


def test_unreadable_profile_path(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile(tmp_path / "ghost.toml")
    assert str(tmp_path / "ghost.toml") in _one_line(info.value)


def test_malformed_file_in_user_folder_stops_load(tmp_path):
    path = _write_custom(tmp_path)
    path.write_text(path.read_text(encoding="utf-8").replace("memory_gib = 80", "memory_gib = -80"),
                    encoding="utf-8")
    with pytest.raises(ProfileError, match=re.escape(str(path))):
        load_profiles(extra=tmp_path)


# --- bugs found while writing these tests -----------------------------------------------------------------------


@pytest.mark.parametrize("line", ["memory_gib = inf", "memory_gib = 1e400"])
def test_infinite_memory_is_a_profile_error(tmp_path, line):
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text(_sub(r"^memory_gib = 80.*$", line)(BASE_TEXT), encoding="utf-8")
    with pytest.raises(ProfileError, match="memory_gib"):
        load_profile(path)


def test_infinite_peak_is_rejected(tmp_path):
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text(_sub(r"^bf16 = 312$", "bf16 = inf")(BASE_TEXT), encoding="utf-8")
    with pytest.raises(ProfileError, match="peak_tflops.bf16"):
        load_profile(path)


def test_measured_at_runtime_nested_list_is_a_profile_error(tmp_path):
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text('measured_at_runtime = [["memory_gib"]]\n' + BASE_TEXT, encoding="utf-8")
    with pytest.raises(ProfileError, match="measured_at_runtime"):
        load_profile(path)


def test_a_compute_capability_of_non_ascii_digits_is_refused_and_an_accepted_one_has_a_cc_tuple(tmp_path):
    # "²" is a digit to str.isdigit() but not to int(): it must be refused, not crash later in cc_tuple.
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text(_sub(r'^compute_capability = ".*"$', 'compute_capability = "\u00b2.0"')(BASE_TEXT),
                    encoding="utf-8")
    with pytest.raises(ProfileError, match="compute_capability"):
        load_profile(path)
    path.write_text(_sub(r'^compute_capability = ".*"$', 'compute_capability = "9.0"')(BASE_TEXT), encoding="utf-8")
    assert load_profile(path).cc_tuple == (9, 0)


def test_error_for_key_with_newline_is_one_line(tmp_path):
    path = tmp_path / f"{BASE_ID}.toml"
    path.write_text('"bad\\nkey" = 1\n' + BASE_TEXT, encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    _one_line(info.value)
