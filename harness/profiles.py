"""GPU profiles: load and validate `gpu_profiles/*.toml`, and find the one that matches this machine.

A profile is the datasheet of one GPU variant (memory, bandwidth, dense peak per dtype, features,
price) with a source for every figure. Unknown figures are absent, never guessed, so anything derived
from them (MFU, cost) is empty rather than wrong. Users add a GPU by dropping one more TOML into a
folder named by `--profiles DIR` or `HEADROOM_PROFILES`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from harness.gpu_profile import DTYPES, FEATURES, PRICE_BASIS, SAFE_ID, VENDORS, GpuProfile, ProfileError, price_day

BUILTIN_PROFILES_DIR = Path(__file__).resolve().parent.parent / "gpu_profiles"
PROFILES_ENV = "HEADROOM_PROFILES"


# field name -> (expected python types, description for the error message)
_TOP_LEVEL: dict[str, tuple[tuple[type, ...], str]] = {
    "id": ((str,), "a non-empty string"),
    "family": ((str,), "a non-empty string"),
    "name": ((str,), "a non-empty string"),
    "vendor": ((str,), "one of " + ", ".join(VENDORS)),
    "match": ((list,), "a list of exact device-name strings"),
    "architecture": ((str,), "a string"),
    "compute_capability": ((str,), 'a string like "8.0"'),
    "gfx_target": ((str,), 'a string like "gfx942"'),
    "memory_gib": ((int, float), "a positive number of GiB"),
    "visible_memory_mib": ((int, float), "a positive number of MiB (nvidia-smi memory.total)"),
    "memory_bandwidth_gb_s": ((int, float), "a positive number of GB/s"),
    "tdp_w": ((int, float), "a positive number of watts"),
    "sm_count": ((int,), "a positive integer"),
    "l2_mib": ((int, float), "a positive number of MiB"),
    "devices_per_package": ((int,), "a positive integer"),
    "peak_tflops": ((dict,), "a table of dtype = TFLOP/s"),
    "sparse_tflops": ((dict,), "a table of dtype = TFLOP/s"),
    "achievable_tflops": ((dict,), "a table of dtype = measured best dense matmul TFLOP/s"),
    "achievable_bandwidth_gb_s": ((int, float), "a positive number of GB/s (measured streaming copy)"),
    "features": ((dict,), "a table of feature = true/false"),
    "interconnect": ((dict,), "a table"),
    "price": ((dict,), "a table with usd_per_hour, date, source"),
    "sources": ((dict,), "a table of figure = source text"),
    "unverified": ((dict,), "a table with fields (list) and notes"),
    "measured_at_runtime": ((list,), "a list of field names"),
}
_REQUIRED = ("id", "family", "name", "vendor", "match", "features")
# Figures that must cite a source when present.
_SOURCED = ("memory_gib", "visible_memory_mib", "memory_bandwidth_gb_s", "tdp_w", "sm_count", "l2_mib",
            "compute_capability",
            "peak_tflops", "sparse_tflops", "achievable_tflops", "achievable_bandwidth_gb_s", "interconnect")
# node_gpus: GPUs one server (node) holds, linked by gpu_link; node_network_gb_s: the node's network to
# other nodes, one direction, all its NICs together (what GPUs in different nodes share); gpu_links: where the
# GPUs of a node are a full mesh of direct links (AMD Infinity Fabric), each GPU's links, gpu_link_gb_s their sum.
_INTERCONNECT = {"gpu_link": str, "gpu_link_gb_s": (int, float), "host_link": str, "host_link_gb_s": (int, float),
                 "node_gpus": int, "node_network_gb_s": (int, float), "gpu_links": int}


def _fail(path: Path, field_name: str, expected: str) -> ProfileError:
    # repr() keeps the message on one line whatever the TOML key holds.
    return ProfileError(f"{path}: field {field_name!r}: expected {expected}")


# Upper bounds far above any device (a million TFLOP/s, GiB, GB/s...): a larger figure is a typo or
# hostile, and one like 1e308 would overflow to inf once scaled to FLOP/s or bytes (MFU 0, cost 0).
MAX_FIGURE = 1e6
MIN_FIGURE = 1e-6
MAX_PROFILE_BYTES = 1 << 20  # a profile is a page of TOML; anything larger is not one


def _positive(path: Path, name: str, value: Any, expected: str, upper: float = MAX_FIGURE) -> float:
    # At least MIN_FIGURE too: 1e-261 GiB is positive but rounds to 0 bytes once scaled.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_FIGURE <= value <= upper:
        raise _fail(path, name, f"{expected} (from {MIN_FIGURE:g} to {upper:g}), got {value!r}")
    return value


def parse_profile(data: dict[str, Any], path: Path) -> GpuProfile:
    """Validate one parsed TOML document and build its profile; ProfileError on the first problem."""
    for key in data:
        if key not in _TOP_LEVEL:
            raise _fail(path, key, "no such field; valid fields: " + ", ".join(_TOP_LEVEL))
    for key in _REQUIRED:
        if key not in data:
            raise _fail(path, key, f"{_TOP_LEVEL[key][1]} (the field is missing)")
    for key, value in data.items():
        types, expected = _TOP_LEVEL[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise _fail(path, key, f"{expected}, got {value!r}")
        if isinstance(value, str) and not value.strip():
            raise _fail(path, key, f"{expected}, got an empty string")
    _refuse_control_characters(path, data)
    if data["id"] != path.stem:
        raise _fail(path, "id", f"the file name's stem {path.stem!r}, got {data['id']!r}")
    for key in ("id", "family"):
        # Ids name result files and nox sessions: two that differ only in characters a file name cannot
        # hold (`a b`, `a_b`) would share a results file.
        if not SAFE_ID.fullmatch(data[key]):
            raise _fail(path, key, f"lower-case letters, digits, '.', '_' and '-', starting with a letter or digit, "
                                   f"got {data[key]!r}")
    if data["vendor"] not in VENDORS:
        raise _fail(path, "vendor", f"one of {', '.join(VENDORS)}, got {data['vendor']!r}")
    if not all(isinstance(m, str) and m for m in data["match"]):
        raise _fail(path, "match", "a list of non-empty strings")
    cc = data.get("compute_capability")
    if cc is not None and not _is_cc(cc):
        raise _fail(path, "compute_capability", f'"MAJOR.MINOR" such as "8.0", got {cc!r}')
    for key in ("memory_gib", "visible_memory_mib", "memory_bandwidth_gb_s", "tdp_w", "sm_count", "l2_mib",
                "devices_per_package", "achievable_bandwidth_gb_s"):
        if key in data:
            upper = 1e9 if key == "visible_memory_mib" else MAX_FIGURE  # MiB: a million GiB is 1e9
            _positive(path, key, data[key], _TOP_LEVEL[key][1], upper=upper)

    peak = _flops_table(path, "peak_tflops", data.get("peak_tflops", {}))
    sparse = _flops_table(path, "sparse_tflops", data.get("sparse_tflops", {}))
    achievable = _flops_table(path, "achievable_tflops", data.get("achievable_tflops", {}))
    features = data["features"]
    for name in FEATURES:
        if not isinstance(features.get(name), bool):
            raise _fail(path, f"features.{name}", f"true or false, got {features.get(name)!r}")
    for name in features:
        if name not in FEATURES:
            raise _fail(path, f"features.{name}", "no such feature; valid: " + ", ".join(FEATURES))
    interconnect = data.get("interconnect", {})
    for name, value in interconnect.items():
        expected = _INTERCONNECT.get(name)
        if expected is None:
            raise _fail(path, f"interconnect.{name}", "no such field; valid: " + ", ".join(_INTERCONNECT))
        if isinstance(value, bool) or not isinstance(value, expected):
            raise _fail(path, f"interconnect.{name}", f"a {'string' if expected is str else 'number'}")

    price = data.get("price", {})
    if price:
        _positive(path, "price.usd_per_hour", price.get("usd_per_hour"), "a positive number of USD per hour")
        for name in ("date", "source"):
            if not isinstance(price.get(name), str) or not price[name].strip():
                raise _fail(path, f"price.{name}", "a non-empty string (prices are dated and sourced)")
        if price_day(price["date"]) is None:
            raise _fail(path, "price.date", f"a date YYYY, YYYY-MM or YYYY-MM-DD, got {price['date']!r}")
        if price.get("basis") != PRICE_BASIS:
            raise _fail(path, "price.basis", f"{PRICE_BASIS!r} (every profile is priced on one basis so costs "
                                             "compare; keep other offers in the source)")
        extra = set(price) - {"usd_per_hour", "date", "source", "basis"}
        if extra:
            raise _fail(path, f"price.{sorted(extra)[0]}", "no such field; valid: usd_per_hour, date, source, basis")

    sources = data.get("sources", {})
    runtime_fields = data.get("measured_at_runtime", [])
    if not all(isinstance(f, str) and f in _TOP_LEVEL for f in runtime_fields):
        raise _fail(path, "measured_at_runtime", "a list of field names of this file")
    runtime = set(runtime_fields)
    for key in _SOURCED:
        if key in data and key not in runtime and not isinstance(sources.get(key), str):
            raise _fail(path, f"sources.{key}", f"a source for '{key}' (every figure cites where it came from)")
    unverified = data.get("unverified", {})
    fields = unverified.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise _fail(path, "unverified.fields", "a list of field names")

    def scaled(key: str, factor: float) -> float | None:
        return data[key] * factor if key in data else None

    return GpuProfile(
        id=data["id"], family=data["family"], name=data["name"], vendor=data["vendor"],
        match=tuple(data["match"]), path=path, architecture=data.get("architecture"),
        compute_capability=cc, gfx_target=data.get("gfx_target"),
        memory_bytes=int(data["memory_gib"] * 2**30) if "memory_gib" in data else None,
        visible_memory_bytes=int(data["visible_memory_mib"] * 2**20) if "visible_memory_mib" in data else None,
        memory_bandwidth_bytes_s=scaled("memory_bandwidth_gb_s", 1e9),
        tdp_w=data.get("tdp_w"), sm_count=data.get("sm_count"),
        l2_bytes=int(data["l2_mib"] * 2**20) if "l2_mib" in data else None,
        devices_per_package=data.get("devices_per_package", 1),
        peak_flops={k: v * 1e12 for k, v in peak.items()},
        sparse_flops={k: v * 1e12 for k, v in sparse.items()},
        achievable_flops={k: v * 1e12 for k, v in achievable.items()},
        achievable_bandwidth_bytes_s=scaled("achievable_bandwidth_gb_s", 1e9),
        features=dict(features), interconnect=dict(interconnect),
        usd_per_hour=price.get("usd_per_hour"), price_date=price.get("date"), price_source=price.get("source"),
        sources=dict(sources), unverified=tuple(fields),
    )


def _at_least(path: Path, name: str, value: float, lowest: float, unit: str) -> None:
    if value < lowest:
        raise _fail(path, name, f"a measured figure of at least {lowest:g} {unit}, got {value!r}")


def _refuse_control_characters(path: Path, data: dict) -> None:
    """Names are printed to terminals: an escape sequence in one would redraw the user's screen."""
    for key, value in _strings(data):
        if any(ord(char) < 32 or 127 <= ord(char) < 160 for char in value):
            raise _fail(path, key, f"text without control characters, got {value!r}")


def _strings(data: dict, prefix: str = ""):
    """(dotted key, text) for every string in a parsed TOML document, nested tables and lists included."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        if isinstance(value, str):
            yield name, value
        for inner_key, inner in items:
            if isinstance(inner, str):
                yield f"{name}.{inner_key}", inner
            elif isinstance(inner, dict):
                yield from _strings(inner, f"{name}.{inner_key}.")


def _is_cc(value: str) -> bool:
    return re.fullmatch(r"[0-9]+\.[0-9]+", value) is not None


def _flops_table(path: Path, section: str, table: dict[str, Any]) -> dict[str, float]:
    for dtype, value in table.items():
        if dtype not in DTYPES:
            raise _fail(path, f"{section}.{dtype}", "a dtype among " + ", ".join(DTYPES))
        _positive(path, f"{section}.{dtype}", value, "a positive number of TFLOP/s")
    return dict(table)


def read_toml(path: Path) -> dict[str, Any]:
    """A small TOML file's document; ProfileError naming the file for anything that is not one (a FIFO or
    a device, which would block or never end; an oversized file; invalid UTF-8; nesting too deep)."""
    try:
        if not path.is_file():
            raise ProfileError(f"{path}: not a regular file (a FIFO, a device or a folder); give a TOML file")
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise ProfileError(f"{path}: {path.stat().st_size:,} bytes, more than a profile's "
                               f"{MAX_PROFILE_BYTES:,}; is it the right file?")
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except RecursionError:
        raise ProfileError(f"{path}: nested too deeply to be a profile") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None


def load_profile(path: Path) -> GpuProfile:
    """Read and validate one TOML file."""
    data = read_toml(path)
    profile = parse_profile(data, path)
    if "memory_gib" in data.get("measured_at_runtime", []):
        profile = _with_host_memory(profile)
    return profile


def _with_host_memory(profile: GpuProfile) -> GpuProfile:
    """The `cpu` profile's memory is this machine's RAM, read when loaded (not a datasheet figure)."""
    from dataclasses import replace

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sources = dict(profile.sources, memory_gib="measured: os.sysconf(SC_PHYS_PAGES) on this machine")
    return replace(profile, memory_bytes=total, sources=sources)


def profile_dirs(extra: str | os.PathLike | None = None) -> list[Path]:
    """The built-in folder, then HEADROOM_PROFILES, then `--profiles DIR` (later folders may add ids)."""
    dirs = [BUILTIN_PROFILES_DIR]
    for candidate in (os.environ.get(PROFILES_ENV), extra):
        if candidate:
            path = Path(candidate)
            if not path.is_dir():
                what = "is a file; give the folder that holds it" if path.exists() else "does not exist"
                raise ProfileError(f"{path}: profiles folder {what} (from --profiles or {PROFILES_ENV})")
            dirs.append(path)
    return dirs


OVERLAY_SUFFIX = ".overlay.toml"  # written by `headroom calibrate`: measured figures for an existing profile


def load_profiles(extra: str | os.PathLike | None = None) -> dict[str, GpuProfile]:
    """Every profile, keyed by id, with the calibration overlays of the folders applied; a duplicate id
    across folders is an error naming both files."""
    profiles: dict[str, GpuProfile] = {}
    overlays: list[Path] = []
    for folder in profile_dirs(extra):
        for path in sorted(folder.glob("*.toml")):
            if path.name.endswith(OVERLAY_SUFFIX):
                overlays.append(path)
                continue
            profile = load_profile(path)
            if profile.id in profiles:
                raise ProfileError(f"{path}: field 'id': a unique id, but {profile.id!r} is also defined "
                                   f"in {profiles[profile.id].path}")
            profiles[profile.id] = profile
    for path in overlays:
        profile = apply_overlay(profiles, path)
        profiles[profile.id] = profile
    return profiles


def apply_overlay(profiles: dict[str, GpuProfile], path: Path) -> GpuProfile:
    """The profile an overlay names, with its measured figures in place of derated datasheet ones."""
    data = read_toml(path)
    target = data.get("profile")
    if not isinstance(target, str) or target not in profiles:
        raise _fail(path, "profile", f"the id of a loaded profile, got {target!r}")
    _refuse_control_characters(path, data)
    provenance, figures = data.get("calibration"), data.get("figures")
    if not isinstance(provenance, dict) or not all(isinstance(provenance.get(k), str) for k in ("device", "date")):
        raise _fail(path, "calibration", "a table with the device and date it was measured on")
    if not isinstance(figures, dict):
        raise _fail(path, "figures", "a table of measured figures")
    unknown = set(figures) - {"achievable_tflops", "achievable_bandwidth_gb_s", "issue_us", "kernel_us"}
    if unknown:
        raise _fail(path, f"figures.{sorted(unknown)[0]}", "no such figure; valid: achievable_tflops, "
                                                          "achievable_bandwidth_gb_s, issue_us, kernel_us")
    if not isinstance(figures.get("achievable_tflops", {}), dict):
        raise _fail(path, "figures.achievable_tflops", "a table of dtype = TFLOP/s")
    rates = _flops_table(path, "figures.achievable_tflops", figures.get("achievable_tflops", {}))
    # Lower bounds too: a measured figure of 1e-300 would make every step take forever, status ok.
    for dtype, rate in rates.items():
        _at_least(path, f"figures.achievable_tflops.{dtype}", rate, 1e-4, "TFLOP/s")
    for key, lowest, unit in (("achievable_bandwidth_gb_s", 0.1, "GB/s"), ("issue_us", 0.01, "us"),
                              ("kernel_us", 0.01, "us")):
        if key in figures:
            _positive(path, f"figures.{key}", figures[key], f"a positive number of {unit}")
            _at_least(path, f"figures.{key}", figures[key], lowest, unit)
    if profiles[target].calibration:
        raise _fail(path, "profile", f"one overlay per profile, but {target!r} is calibrated by "
                                     f"{profiles[target].calibration.get('file')} too")
    profile = profiles[target]
    said = f"calibrated on {provenance['device']} ({provenance['date']}, {path.name})"
    return dataclasses.replace(
        profile, achievable_flops=profile.achievable_flops | {k: v * 1e12 for k, v in rates.items()},
        achievable_bandwidth_bytes_s=figures["achievable_bandwidth_gb_s"] * 1e9
        if "achievable_bandwidth_gb_s" in figures else profile.achievable_bandwidth_bytes_s,
        issue_s=figures["issue_us"] / 1e6 if "issue_us" in figures else profile.issue_s,
        kernel_s=figures["kernel_us"] / 1e6 if "kernel_us" in figures else profile.kernel_s,
        calibration={k: str(v) for k, v in provenance.items()} | {"file": str(path)},
        sources=profile.sources | {"achievable_tflops": said, "achievable_bandwidth_gb_s": said})


def families(profiles: dict[str, GpuProfile]) -> dict[str, list[GpuProfile]]:
    """Family name -> its variants, in id order."""
    out: dict[str, list[GpuProfile]] = {}
    for profile in profiles.values():
        out.setdefault(profile.family, []).append(profile)
    return out


def resolve_gpus(names: list[str], profiles: dict[str, GpuProfile]) -> list[GpuProfile]:
    """Expand ids and family names into profiles (order kept, duplicates dropped); ValueError otherwise.

    A family name takes every variant, also where one variant's id is the family's name (`h200` is
    the SXM's id and the family of the SXM and the NVL), so `bench-h200` covers both; `all` is every GPU."""
    fams = families(profiles)
    chosen: dict[str, GpuProfile] = {}
    known = set(profiles) | set(fams) | {"all"}
    for name in _split_names(names, known):
        if name == "all" and "all" not in profiles:  # every GPU profile (the CPU is not one to buy)
            for profile in profiles.values():
                if profile.vendor != "cpu":
                    chosen.setdefault(profile.id, profile)
        elif name in fams:
            for profile in fams[name]:
                chosen.setdefault(profile.id, profile)
        elif name in profiles:
            chosen.setdefault(name, profiles[name])
        else:
            raise ValueError(unknown_name("GPU", name, sorted(set(profiles) | set(fams)) + ["all"]))
    return list(chosen.values())


def _split_names(names: list[str], known: set[str]) -> list[str]:
    """Names as given on a command line: comma-separated lists (`h100-sxm,l4`) split, and a known name in
    any letter case (`H100-SXM`) as its id."""
    parts = [part.strip() for name in names for part in name.split(",") if part.strip()]
    return [part.lower() if part.lower() in known else part for part in parts]


def unknown_name(what: str, name: str, valid: list[str]) -> str:
    """One line: the unknown name, the closest valid ones, and where to see them all."""
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {what} {name!r}{hint} (valid: {', '.join(valid)})"


LOCAL_DEVICE_ENV = "HEADROOM_LOCAL_DEVICE"


def detect_local(profiles: dict[str, GpuProfile]) -> GpuProfile:
    """The profile of the device this process would measure on: the CUDA device by exact name, else `cpu`.

    A CUDA device whose name matches no profile raises, naming the device, instead of silently
    borrowing a neighbour's figures. HEADROOM_LOCAL_DEVICE=cpu measures on the host CPU of a GPU
    machine (the test suite does, so it behaves the same everywhere).
    """
    import torch

    forced = os.environ.get(LOCAL_DEVICE_ENV)
    if forced:
        if forced != "cpu":
            raise ProfileError(f"{LOCAL_DEVICE_ENV}={forced!r}: only 'cpu' can be forced (a GPU is detected by "
                               "its name); unset it to measure on the GPU")
        return profiles["cpu"]
    if torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
        for profile in profiles.values():
            if device_name in profile.match:
                return profile
        raise ProfileError(f"no profile matches the local GPU {device_name!r}: add a TOML with "
                           f'match = ["{device_name}"] to a folder given by --profiles')
    return profiles["cpu"]
