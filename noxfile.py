"""Sessions: `nox` (lint + tests), `nox -s bench` (this machine), `nox -s bench-<family>` per GPU family.

The bench-<family> sessions are generated from gpu_profiles/*.toml, so adding a profile with a new
family adds its session.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PYTHON = "3.11"


def _install(session: nox.Session) -> None:
    # Editable, so gpu_profiles/ and the templates are read from the checkout.
    session.install("-e", ".[test]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite, CPU only."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The default suite on the local device: measured rows, results frame and report.html."""
    _install(session)
    session.run("headroom", "run", *session.posargs)


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """Merge results: `nox -s report -- results/RUN1 results/RUN2 --out merged.html`."""
    _install(session)
    if not session.posargs:
        session.error("give results folders and --out FILE.html after --")
    session.run("headroom", "report", *session.posargs)


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
