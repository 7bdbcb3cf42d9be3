"""Sessions: `nox` (lint + tests), `nox -s bench` (this machine), `nox -s bench-<family>` per GPU family,
`gpu-check` (every GPU check, on a GPU machine), `gpu-check-smoke` (its plumbing on smoke sizes, anywhere),
`tests_on-3.12` (the suite on another Python), `tests_older_torch` (on torch 2.6 and 2.11; not run by default),
`readme-screenshot` (docs/report.png from the newest `nox -s bench` results, through headless Chromium).
Sessions run on the oldest of Python 3.11-3.13 that is installed, and fail where none is.

The bench-<family> sessions are generated from gpu_profiles/*.toml, so adding a profile with a new
family adds its session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
# A session whose Python is missing fails instead of being skipped with exit code 0 (which reads as a pass).
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
SUPPORTED_PYTHONS = ("3.11", "3.12", "3.13")  # pyproject: requires-python >= 3.11


def _runs(version: str) -> bool:
    """Whether `python<version>` is on the PATH and starts (a pyenv shim for a version pyenv is not told
    to use is on the PATH but fails)."""
    executable = shutil.which(f"python{version}")
    return executable is not None and subprocess.run([executable, "-c", ""], capture_output=True).returncode == 0


INSTALLED_PYTHONS = [version for version in SUPPORTED_PYTHONS if _runs(version)]
# The sessions run on the oldest supported Python installed; with none installed, nox fails naming 3.11.
PYTHON = (INSTALLED_PYTHONS or SUPPORTED_PYTHONS)[0]


def _install(session: nox.Session) -> None:
    # Editable, so gpu_profiles/ and the templates are read from the checkout.
    session.install("-e", ".[test]")


def _cgroup_cores() -> int | None:
    """Whole cores a container's CPU quota allows (cgroup v2's cpu.max, else v1's cfs quota), None without one."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            text = (Path("/sys/fs/cgroup") / quota_file).read_text().split()
            quota, period = (text[0], text[1]) if period_file is None else (
                text[0], (Path("/sys/fs/cgroup") / period_file).read_text().strip())
            if quota not in ("max", "-1"):
                return max(1, int(quota) // int(period))
        except (OSError, ValueError, IndexError):
            continue
    return None


def _test_workers() -> int:
    """The cores this process may run on, at most 8: its CPU affinity and a cgroup's CPU quota, which a container
    sets and pytest-xdist's `auto` (psutil's count of the host's cores) does not read."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cores, _cgroup_cores() or cores)


# The suite on every core (pytest-xdist), a test file to a worker so a module's fixtures are built once: on CI's
# two cores it took 21 min instead of 41 (2026-12-07). The tests pin torch to one thread each (conftest), so one
# process leaves the other core idle. `nox -s tests -- -n 0` runs it in one process.
WORKERS = _test_workers()
PARALLEL = (f"--numprocesses={WORKERS if WORKERS > 1 else 0}", "--dist=loadfile")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite, CPU only, on the oldest supported Python installed."""
    _install(session)
    session.run("pytest", *PARALLEL, *session.posargs)


@nox.session(python=list(SUPPORTED_PYTHONS), default=False)
def tests_on(session: nox.Session) -> None:
    """The test suite on one named Python: `nox -s tests_on-3.12` (CI runs it beside `tests`)."""
    _install(session)
    session.run("pytest", *PARALLEL, *session.posargs)


# The oldest torch the code supports (pyproject: torch>=2.6) and the release on the lent GPU machines;
# each install downloads a CUDA build of torch (about 3.5 GB), so these are not in the default run.
OLDER_TORCH = {"2.6.0": "0.21.0", "2.11.0": "0.26.0"}


@nox.session(python=PYTHON, default=False)
@nox.parametrize("torch_version", list(OLDER_TORCH))
def tests_older_torch(session: nox.Session, torch_version: str) -> None:
    """The test suite on an older torch: `nox -s "tests_older_torch(torch_version='2.11.0')"`."""
    session.install(f"torch=={torch_version}", f"torchvision=={OLDER_TORCH[torch_version]}")
    _install(session)
    session.run("pytest", *PARALLEL, *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The default suite on the local device: measured rows, results frame and report.html."""
    _install(session)
    session.run("headroom", "run", *session.posargs)


@nox.session(python=PYTHON, name="gpu-check", default=False)
def gpu_check(session: nox.Session) -> None:
    """Every GPU check in under 8 minutes (benchmarks/gpu_check.sh): measured cells and their projected twins,
    served decoders, allocator settings, the largest batch measured, the tests marked `gpu`; the summary and
    a tarball of the rows land in gpu_check_out/."""
    if shutil.which("nvidia-smi") is None:
        session.error("gpu-check needs an NVIDIA GPU and its driver (no nvidia-smi on this machine)")
    _install(session)
    session.run("bash", "benchmarks/gpu_check.sh", env={"PYTHON": "python"}, external=True)


@nox.session(python=PYTHON, name="gpu-check-smoke", default=False)
def gpu_check_smoke(session: nox.Session) -> None:
    """benchmarks/gpu_check.sh's steps on smoke sizes, on any machine (a few minutes on a CPU): its arguments,
    columns and ledger merge work before GPU time is spent on them. Measures no GPU; fails if a step fails."""
    _install(session)
    session.run("bash", "benchmarks/gpu_check.sh", env={"PYTHON": "python", "SMOKE": "1", "OUT": "gpu_check_smoke_out",
                                                        "WORK": str(Path(session.create_tmp()) / "gpu_check")},
                external=True)


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """Merge results: `nox -s report -- results/RUN1 results/RUN2 --out merged.html`."""
    _install(session)
    if not session.posargs:
        session.error("give results folders and --out FILE.html after --")
    session.run("headroom", "report", *session.posargs)


def _newest_results() -> Path | None:
    """The results/*/ folder whose results.csv or results.parquet was written last; None where there is none."""
    written = {}
    for path in [*(ROOT / "results").glob("*/results.csv"), *(ROOT / "results").glob("*/results.parquet")]:
        written[path.parent] = max(written.get(path.parent, 0.0), path.stat().st_mtime)
    return max(written, key=written.get) if written else None


@nox.session(python=PYTHON, name="readme-screenshot", default=False)
def readme_screenshot(session: nox.Session) -> None:
    """The README's picture, docs/report.png: the report of a `nox -s bench` run as headless Chromium draws it
    at 1600x2400 (reports/browser.py). `nox -s readme-screenshot -- results/RUN`; default: the newest results
    folder. Needs chromium (Debian: apt-get install chromium) or $HEADROOM_CHROMIUM."""
    if len(session.posargs) > 1:
        session.error("give at most one results folder after --")
    folder = Path(session.posargs[0]) if session.posargs else _newest_results()
    if folder is None:
        session.error("no results/*/ folder with results.csv or results.parquet: run `nox -s bench` first")
    if not ((folder / "results.csv").is_file() or (folder / "results.parquet").is_file()):
        session.error(f"{folder} has no results.csv or results.parquet: give a folder `nox -s bench` wrote")
    # A folder is read through its results.parquet (with the serving matrix and timelines beside it); a folder
    # with only results.csv is read through that file.
    results = [str(folder)] if (folder / "results.parquet").is_file() else [str(folder / "results.csv")]
    if not (folder / "results.parquet").is_file() and (folder / "serve_matrix.csv").is_file():
        results += ["--serve-matrix", str(folder / "serve_matrix.csv")]
    _install(session)
    report = Path(session.create_tmp()) / "report.html"
    session.run("headroom", "report", *results, "--out", str(report))
    session.run("python", "-m", "reports.browser", "screenshot", str(report), str(ROOT / "docs" / "report.png"),
                "--width", "1600", "--height", "2400")


def _families() -> list[str]:
    names = set()
    for path in sorted((ROOT / "gpu_profiles").glob("*.toml")):
        with open(path, "rb") as handle:
            family = tomllib.load(handle).get("family")
        if family and family != "cpu":
            names.add(family)
    return sorted(names)


def _bench_family(family: str):
    def session_fn(session: nox.Session) -> None:
        _install(session)
        session.run("headroom", "run", "--gpu", family, *session.posargs)

    session_fn.__doc__ = f"The default suite on the {family} GPU family."
    return session_fn


for _family in _families():
    nox.session(python=PYTHON, name=f"bench-{_family}")(_bench_family(_family))
