"""GPU profile contract tests: the built-in datasheets and detection (files and their errors:
tests/test_profile_files.py).

Expected figures are typed in by hand from ../shared/reference/gpu_specs.md, never read back from the TOMLs.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from harness.profiles import (
    BUILTIN_PROFILES_DIR,
    LOCAL_DEVICE_ENV,
    PROFILES_ENV,
    GpuProfile,
    ProfileError,
    detect_local,
    load_profile,
    load_profiles,
    resolve_gpus,
)

EXPECTED_FAMILIES = {
    "t4": "t4", "a10": "a10", "l4": "l4",
    "a100-pcie-40gb": "a100", "a100-sxm4-40gb": "a100", "a100-pcie-80gb": "a100", "a100-sxm4-80gb": "a100",
    "h100-pcie": "h100", "h100-sxm": "h100", "h100-nvl": "h100", "h200": "h200", "h200-nvl": "h200",
    "l40s": "l40s", "b200": "b200", "v100-sxm2-32gb": "v100",
    "mi250x": "mi250x", "mi300x": "mi300x", "cpu": "cpu",
}
# Top-level fields that are datasheet figures and so must cite a source when present (from the module docs:
# "with a source for every figure").
FIGURES = ("memory_gib", "memory_bandwidth_gb_s", "tdp_w", "sm_count", "l2_mib", "compute_capability",
           "peak_tflops", "sparse_tflops", "interconnect")
BASE_ID = "a100-sxm4-80gb"
BASE_TEXT = (BUILTIN_PROFILES_DIR / f"{BASE_ID}.toml").read_text(encoding="utf-8")
RAW = {p.stem: tomllib.loads(p.read_text(encoding="utf-8")) for p in sorted(BUILTIN_PROFILES_DIR.glob("*.toml"))}


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch):
    monkeypatch.delenv(PROFILES_ENV, raising=False)


@pytest.fixture(scope="module")
def profiles() -> dict[str, GpuProfile]:
    return load_profiles()


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and len(message.splitlines()) == 1, f"not one line: {message!r}"
    return message


# --- built-in profiles ------------------------------------------------------------------------------------------


def test_builtin_ids_and_families(profiles):
    assert set(profiles) == set(EXPECTED_FAMILIES)
    assert {pid: p.family for pid, p in profiles.items()} == EXPECTED_FAMILIES
    for pid, profile in profiles.items():
        assert profile.id == pid
        assert profile.path == BUILTIN_PROFILES_DIR / f"{pid}.toml"
        assert profile.vendor in ("nvidia", "amd", "cpu")
        assert profile.match and all(isinstance(m, str) and m for m in profile.match)


def test_each_builtin_file_loads_on_its_own():
    for path in sorted(BUILTIN_PROFILES_DIR.glob("*.toml")):
        assert load_profile(path).id == path.stem


def test_match_strings_are_unique(profiles):
    # detect_local takes the first profile whose match list holds the device name: a shared name would make
    # the choice depend on file order.
    seen: dict[str, str] = {}
    for profile in profiles.values():
        for name in profile.match:
            assert name not in seen, f"{name!r} in both {seen[name]} and {profile.id}"
            seen[name] = profile.id


def test_resolve_family_and_ids(profiles):
    a100 = resolve_gpus(["a100"], profiles)
    assert sorted(p.id for p in a100) == ["a100-pcie-40gb", "a100-pcie-80gb", "a100-sxm4-40gb", "a100-sxm4-80gb"]
    assert [p.id for p in resolve_gpus(["h100-sxm"], profiles)] == ["h100-sxm"]
    assert {p.id for p in resolve_gpus(["h100"], profiles)} == {"h100-pcie", "h100-sxm", "h100-nvl"}
    # An id that names its family too takes the family.
    assert {p.id for p in resolve_gpus(["h200"], profiles)} == {"h200", "h200-nvl"}
    # Order kept, duplicates dropped.
    mixed = resolve_gpus(["t4", "a100", "a100-sxm4-80gb", "t4"], profiles)
    assert [p.id for p in mixed][0] == "t4"
    assert len(mixed) == 5 and len({p.id for p in mixed}) == 5


def test_names_in_any_case_and_comma_separated_lists_resolve(profiles):
    assert [p.id for p in resolve_gpus(["H100-SXM,l4", " B200 "], profiles)] == ["h100-sxm", "l4", "b200"]
    assert {p.id for p in resolve_gpus(["A100"], profiles)} == {p.id for p in resolve_gpus(["a100"], profiles)}


@pytest.mark.parametrize("name", ["a10O", "A10O", "h100sxm"])
def test_resolve_unknown_name_suggests(profiles, name):
    with pytest.raises(ValueError) as info:
        resolve_gpus(["t4", name], profiles)
    message = _one_line(info.value)
    assert repr(name) in message
    assert "did you mean" in message
    suggestions = message.split("did you mean", 1)[1].split("?", 1)[0]
    close = {"a10O": {"a100", "a10"}, "A10O": {"a100", "a10"}, "h100sxm": {"h100-sxm"}}[name]
    assert close & {s.strip() for s in suggestions.split(",")}, message


def test_resolve_far_name_has_no_suggestion(profiles):
    with pytest.raises(ValueError) as info:
        resolve_gpus(["zzzzzzzzzz"], profiles)
    assert "did you mean" not in _one_line(info.value)


# (id, attribute or dtype, expected) typed in from gpu_specs.md §1a/§1b.
SPOT_CHECKS = [
    ("a100-sxm4-80gb", "memory_bytes", 80 * 2**30),
    ("a100-sxm4-80gb", "memory_bandwidth_bytes_s", 2039e9),
    ("a100-sxm4-80gb", "peak:bf16", 312e12),
    ("a100-sxm4-80gb", "peak:tf32", 156e12),
    ("a100-sxm4-80gb", "peak:fp32", 19.5e12),
    ("a100-sxm4-80gb", "peak:int8", 624e12),
    ("a100-sxm4-80gb", "sparse:bf16", 624e12),
    ("a100-sxm4-80gb", "tdp_w", 400),
    ("a100-sxm4-80gb", "sm_count", 108),
    ("a100-sxm4-80gb", "l2_bytes", 40 * 2**20),
    ("a100-pcie-80gb", "memory_bandwidth_bytes_s", 1935e9),
    ("a100-pcie-80gb", "tdp_w", 300),
    ("a100-pcie-40gb", "memory_bandwidth_bytes_s", 1555e9),
    ("a100-pcie-40gb", "memory_bytes", 40 * 2**30),
    ("a100-sxm4-40gb", "peak:bf16", 312e12),
    ("h100-sxm", "peak:bf16", 989.4e12),
    ("h100-sxm", "peak:fp8", 1979e12),
    ("h100-sxm", "memory_bandwidth_bytes_s", 3350e9),
    ("h100-sxm", "sm_count", 132),
    ("h100-pcie", "peak:bf16", 756e12),
    ("h100-pcie", "sm_count", 114),
    ("h100-pcie", "memory_bandwidth_bytes_s", 2000e9),
    ("h100-nvl", "peak:bf16", 835.5e12),
    ("h100-nvl", "peak:fp8", 1671e12),
    ("h100-nvl", "memory_bandwidth_bytes_s", 3900e9),
    ("h100-nvl", "memory_bytes", 94 * 2**30),
    ("h200", "peak:bf16", 989.4e12),
    ("h200", "memory_bandwidth_bytes_s", 4800e9),
    ("h200", "memory_bytes", 141 * 2**30),
    ("h200-nvl", "peak:bf16", 835.5e12),
    ("h200-nvl", "memory_bandwidth_bytes_s", 4800e9),
    ("h200-nvl", "tdp_w", 600),
    ("t4", "peak:fp16", 65e12),
    ("t4", "peak:fp32", 8.1e12),
    ("t4", "peak:int8", 130e12),
    ("t4", "memory_bandwidth_bytes_s", 320e9),
    ("t4", "tdp_w", 70),
    ("a10", "peak:bf16", 125e12),
    ("a10", "sparse:bf16", 250e12),
    ("a10", "memory_bandwidth_bytes_s", 600e9),
    ("l4", "peak:bf16", 121e12),
    ("l4", "peak:fp8", 242.5e12),
    ("l4", "tdp_w", 72),
    ("l40s", "peak:bf16", 362.05e12),
    ("l40s", "memory_bandwidth_bytes_s", 864e9),
    ("l40s", "memory_bytes", 48 * 2**30),
    ("b200", "peak:bf16", 2250e12),
    ("b200", "memory_bytes", 180 * 2**30),
    ("mi300x", "peak:bf16", 1307.4e12),
    ("mi300x", "peak:fp8", 2614.9e12),
    ("mi300x", "memory_bandwidth_bytes_s", 5300e9),
    ("mi300x", "memory_bytes", 192 * 2**30),
    ("mi300x", "sm_count", 304),
    ("mi300x", "gfx_target", "gfx942"),
    ("mi250x", "peak:bf16", 383e12),
    ("mi250x", "memory_bandwidth_bytes_s", 3276.8e9),
    ("mi250x", "devices_per_package", 2),
    ("mi250x", "gfx_target", "gfx90a"),
    ("a100-sxm4-80gb", "compute_capability", "8.0"),
    ("h100-sxm", "compute_capability", "9.0"),
    ("t4", "compute_capability", "7.5"),
    ("l4", "compute_capability", "8.9"),
    ("a10", "compute_capability", "8.6"),
]


@pytest.mark.parametrize(("pid", "what", "expected"), SPOT_CHECKS, ids=[f"{p}-{w}" for p, w, _ in SPOT_CHECKS])
def test_spot_check_against_reference(profiles, pid, what, expected):
    profile = profiles[pid]
    if what.startswith("peak:"):
        value = profile.peak(what[5:])
    elif what.startswith("sparse:"):
        value = profile.sparse_flops.get(what[7:])
    else:
        value = getattr(profile, what)
    if isinstance(expected, str):
        assert value == expected
    elif isinstance(expected, int) and what.endswith("bytes"):
        assert value == expected and isinstance(value, int)
    else:
        assert value == pytest.approx(expected, rel=1e-9)


def test_t4_has_no_bf16(profiles):
    t4 = profiles["t4"]
    assert t4.has("bf16") is False and t4.has("tf32") is False
    assert t4.peak("bf16") is None and t4.peak("tf32") is None
    assert t4.sparse_flops == {}
    assert t4.cc_tuple == (7, 5)


def test_feature_flags(profiles):
    assert profiles["a100-sxm4-80gb"].has("bf16") and not profiles["a100-sxm4-80gb"].has("fp8")
    assert profiles["h100-sxm"].has("fp8") and profiles["h100-sxm"].has("flash_attention")
    assert profiles["l4"].has("fp8")
    assert not profiles["t4"].has("flash_attention")
    assert not profiles["mi250x"].has("fp8") and not profiles["mi250x"].has("tf32")
    assert profiles["h100-sxm"].cc_tuple == (9, 0)
    assert profiles["mi300x"].cc_tuple is None


def test_cpu_profile(profiles):
    cpu = profiles["cpu"]
    assert cpu.vendor == "cpu" and cpu.family == "cpu"
    assert all(cpu.peak(d) is None for d in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8"))
    assert cpu.usd_per_hour is None
    # Memory is this machine's RAM: compare with /proc/meminfo (an independent reading) where there is one.
    assert isinstance(cpu.memory_bytes, int) and cpu.memory_bytes > 2**28
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read_text(), re.M).group(1))
        assert abs(cpu.memory_bytes - kib * 1024) <= 64 * 2**20
    assert "memory_gib" in cpu.sources


def test_every_present_figure_has_a_source(profiles):
    for pid, raw in RAW.items():
        runtime = set(raw.get("measured_at_runtime", []))
        sources = raw.get("sources", {})
        for figure in FIGURES:
            if figure in raw and figure not in runtime:
                assert isinstance(sources.get(figure), str) and sources[figure].strip(), f"{pid}: {figure}"
        if "price" in raw:
            assert raw["price"]["source"].strip() and raw["price"]["date"].strip(), pid
        # And the loaded profile carries them, including runtime-measured memory.
        profile = profiles[pid]
        if profile.memory_bytes is not None:
            assert profile.sources.get("memory_gib"), pid
        if profile.memory_bandwidth_bytes_s is not None:
            assert profile.sources.get("memory_bandwidth_gb_s"), pid
        if profile.peak_flops:
            assert profile.sources.get("peak_tflops"), pid
        if profile.usd_per_hour is not None:
            assert profile.price_source and profile.price_date, pid


def test_unverified_fields_name_real_fields(profiles):
    known = set(FIGURES) | {"price", "devices_per_package", "gfx_target", "architecture"}
    for profile in profiles.values():
        assert set(profile.unverified) <= known, (profile.id, profile.unverified)


def test_detect_local_is_cpu_without_cuda(profiles, monkeypatch):
    import torch

    monkeypatch.delenv(LOCAL_DEVICE_ENV)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert detect_local(profiles) is profiles["cpu"]


def test_detect_local_matches_exact_device_name(profiles, monkeypatch):
    import torch

    monkeypatch.delenv(LOCAL_DEVICE_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-80GB")
    assert detect_local(profiles).id == "a100-sxm4-80gb"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert detect_local(profiles).id == "h100-sxm"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-80GB MIG 1g.10gb")
    with pytest.raises(ProfileError) as info:
        detect_local(profiles)
    assert "NVIDIA A100-SXM4-80GB MIG 1g.10gb" in _one_line(info.value)


def test_the_host_cpu_can_be_forced_on_a_gpu_machine(profiles, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv(LOCAL_DEVICE_ENV, "cpu")
    assert detect_local(profiles) is profiles["cpu"]
    monkeypatch.setenv(LOCAL_DEVICE_ENV, "h100-sxm")
    with pytest.raises(ProfileError) as info:
        detect_local(profiles)
    assert "only 'cpu'" in _one_line(info.value)


def test_all_names_every_gpu_profile_and_no_cpu():
    profiles = load_profiles()
    chosen = resolve_gpus(["all"], profiles)
    assert {p.id for p in chosen} == {pid for pid, p in profiles.items() if p.vendor != "cpu"} and len(chosen) >= 15
