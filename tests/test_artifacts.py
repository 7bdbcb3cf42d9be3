"""Artifacts a run keeps beside its rows (harness/measure/artifacts.py): the memory timeline of one step by
category, a profiler trace, TensorBoard scalars; and the report's charts of the timelines."""

from __future__ import annotations

import json

import pytest

from harness.cell import Cell
from harness.measure.artifacts import TIMELINE_CATEGORIES, read_timeline
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.records import records_frame
from reports.build import render
from reports.timelines import timeline_files


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    cell = Cell("gpt", "smoke", "train", "baseline", "cpu", 4).resolve(load_profiles())
    settings = MeasureSettings(warmup=1, steps=10, repeats=1, artifacts_dir=str(folder), memory_timeline=True,
                               profile=True, tensorboard_dir=str(folder / "tensorboard"))
    return folder, to_record(cell, measure(cell, settings), "t")


def test_a_cell_keeps_its_timeline_trace_and_scalars(kept):
    folder, row = kept
    cell_id = "gpt__smoke__train__baseline__cpu__b4"
    assert row.status == "ok"
    assert f"timelines/{cell_id}.json" in row.notes and f"traces/{cell_id}.json" in row.notes
    trace = json.loads((folder / "traces" / f"{cell_id}.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert list((folder / "tensorboard" / cell_id).glob("events.out.tfevents.*"))
    seconds, by_category = read_timeline(folder / "timelines" / f"{cell_id}.json")
    assert set(by_category) == set(TIMELINE_CATEGORIES) and seconds[0] == 0.0
    # A training step holds parameters throughout and gradients and optimizer state by its end.
    assert min(by_category["parameters"]) > 0 and max(by_category["gradients"]) > 0
    assert max(by_category["optimizer state"]) > 0


def test_the_report_draws_the_kept_timelines(kept):
    folder, row = kept
    html = render([records_frame([])], None, timeline_files([folder]))
    assert "Memory over one step (measured)" in html and html.count("<svg") == 1


def test_an_artifact_that_cannot_be_kept_is_a_note_not_a_lost_cell(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cell = Cell("gpt", "smoke", "infer", "baseline", "cpu", 2).resolve(load_profiles())
    settings = MeasureSettings(warmup=1, steps=10, repeats=1, artifacts_dir=str(blocker), profile=True)
    row = to_record(cell, measure(cell, settings), "t")
    assert row.status == "ok" and "profiler trace not kept: " in row.notes


def test_unreadable_timelines_are_skipped(tmp_path):
    (tmp_path / "timelines").mkdir()
    (tmp_path / "timelines" / "bad.json").write_text("{not json")
    assert read_timeline(tmp_path / "timelines" / "bad.json") is None
    assert "Memory over one step" not in render([records_frame([])], None, timeline_files([tmp_path]))
