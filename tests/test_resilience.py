"""Nothing lost: a run killed at any moment resumes to every cell exactly once; old results stay readable;
inputs never run code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cell import Cell
from harness.plan import expand
from harness.profiles import load_profiles
from harness.records import SCHEMA_VERSION, read_results
from suites.techniques import TECHNIQUES, parse_stack, technique_names

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_V1 = ROOT / "tests" / "fixtures" / "schema_v1"
PROFILES = load_profiles()


def test_sigkill_then_resume_records_every_cell_exactly_once(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "harness.cli", "run", "--gpu", "cpu", "--workload", "gpt,bert", "--technique",
            "baseline,amp-bf16", "--mode", "train", "--repeats", "1", "--no-report", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    # Kill the runner as soon as some, but not all, cells are recorded: mid-run, a cell in flight.
    while time.monotonic() < deadline and len(list((out / "cells").glob("*.json"))) < 2:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    recorded = {p.stem for p in (out / "cells").glob("*.json")}
    assert 1 <= len(recorded) < 4, "the kill should land mid-run"
    resumed = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-500:]
    assert resumed.stderr.count("already recorded, skipped") == len(recorded)
    frame = pd.read_parquet(out / "results.parquet")
    assert len(frame) == 8 and frame["cell_id"].is_unique  # 4 measured cells and their projected twins
    assert set(frame["status"]) == {"ok"} and (frame["source"] == "measured").sum() == 4


def test_first_schema_results_migrate_and_stay_readable():
    for path in (FIXTURE_V1, FIXTURE_V1 / "results.csv"):
        frame = read_results(path)
        assert len(frame) == 10 and set(frame["schema_version"]) == {SCHEMA_VERSION}
        ok = frame[frame["step_time_cv"].notna()]
        # v2's `noisy` is derived from the coefficient of variation v1 recorded.
        assert (ok["noisy"] == (ok["step_time_cv"] > 0.05)).all()
        assert frame.loc[frame["status"] == "unsupported", "noisy"].isna().all()
        # Columns added after v1 are unknown, not zero.
        assert frame["reserved_error_vs_measured"].isna().all() and frame["fits"].isna().all()


def test_a_results_file_from_a_future_schema_is_refused(tmp_path):
    frame = pd.read_csv(FIXTURE_V1 / "results.csv")
    frame["schema_version"] = SCHEMA_VERSION + 1
    frame.to_csv(tmp_path / "future.csv", index=False)
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1} is not known"):
        read_results(tmp_path / "future.csv")


def test_no_code_runs_from_inputs():
    """No eval/exec, no pickle, and torch.load only with weights_only=True, anywhere in the package."""
    offenders = []
    for path in [*ROOT.glob("harness/**/*.py"), *ROOT.glob("suites/**/*.py"), *ROOT.glob("reports/**/*.py")]:
        text = path.read_text()
        # Builtin eval/exec (not methods such as Module.eval()), pickle of any kind.
        if re.search(r"(?<![.\w])(eval|exec)\(|\bpickle\b|read_pickle|allow_pickle=True", text):
            offenders.append(str(path))
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            if "weights_only=True" not in call:
                offenders.append(f"{path}: {call}")
    assert not offenders


NAMES = st.sampled_from([*technique_names(), "amp-bf17", "check", ""])


@given(st.lists(NAMES, min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_stack_parsing_accepts_exactly_the_valid_stacks(parts):
    text = "+".join(parts)
    valid_ids = [p for p in parts if p in TECHNIQUES]
    groups = [TECHNIQUES[p].exclusive for p in valid_ids if TECHNIQUES[p].exclusive]
    should_parse = (parts == ["baseline"]) or (
        len(valid_ids) == len(parts) and len(set(parts)) == len(parts) and len(set(groups)) == len(groups))
    try:
        stack = parse_stack(text)
    except ValueError as exc:
        assert not should_parse, f"{text!r} rejected: {exc}"
        assert "\n" not in str(exc)
        return
    assert should_parse, f"{text!r} accepted"
    assert parse_stack(stack.name) == stack  # the canonical name parses back to the same stack
    assert sorted(stack.name.split("+")) == sorted(parts)


@given(workloads=st.lists(st.sampled_from(["gpt", "bert", "resnet50"]), min_size=1, max_size=3, unique=True),
       stacks=st.lists(st.sampled_from(["baseline", "amp-bf16", "checkpointing+amp-fp16", "amp-fp16+checkpointing"]),
                       min_size=1, max_size=3),
       modes=st.lists(st.sampled_from(["train", "infer"]), min_size=1, max_size=2, unique=True),
       gpus=st.lists(st.sampled_from(["cpu", "a100", "h100-sxm", "t4"]), min_size=1, max_size=3, unique=True),
       scale=st.sampled_from(["smoke", "standard", "large"]))
@settings(max_examples=60, deadline=None)
def test_plan_expansion_is_the_full_product_without_duplicates(workloads, stacks, modes, gpus, scale):
    from harness.profiles import resolve_gpus
    from suites.workloads import WORKLOADS

    profiles = resolve_gpus(gpus, PROFILES)
    cells = expand(workloads, stacks, profiles, modes, scale=scale)
    distinct_stacks = {parse_stack(s).name for s in stacks}
    sizes = sum(len(WORKLOADS[w].sizes_at(scale)) for w in workloads)
    assert len(cells) == sizes * len(modes) * len(distinct_stacks) * len(profiles)
    assert len({c.cell_id for c in cells}) == len(cells)
    assert all(isinstance(c, Cell) and c.batch_size >= 1 for c in cells)
