"""ADDING.md's recipes, each done once: a technique, a workload, a GPU profile, and a record column.

If a recipe stops being true (a step missing, a file that must also change), one of these fails."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import fields

import pytest
import torch

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.outcome import MemoryFigures, Outcome, SpeedFigures, to_record
from harness.profiles import BUILTIN_PROFILES_DIR, load_profiles
from harness.project import project, project_outcome, traced
from harness.records import COLUMNS
from suites.techniques import TECHNIQUES, parse_stack
from suites.techniques.base import Phase, Technique, always
from suites.workloads import WORKLOADS
from tests import example_workload

PROFILES = load_profiles()
QUICK = MeasureSettings(warmup=1, steps=10, repeats=1)


def _freeze_embeddings(run) -> None:
    """The example technique: the first layer stops training, so it has no gradient or AdamW state."""
    frozen = 0
    for module in run.model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
            for parameter in module.parameters():
                parameter.requires_grad_(False)
                frozen += parameter.numel()
            break
    run.notes.append(f"{frozen:,} parameters frozen")


FREEZE = Technique(id="freeze-first-layer", phase=Phase.STRUCTURE, changes_numerics=True, check=always,
                   apply=_freeze_embeddings, summary="the first layer is frozen (example for ADDING.md)")


@pytest.fixture
def registered(monkeypatch):
    """The example technique and workload, registered as their recipes say (for this test only)."""
    monkeypatch.setitem(TECHNIQUES, FREEZE.id, FREEZE)
    monkeypatch.setitem(WORKLOADS, example_workload.WORKLOAD.name, example_workload.WORKLOAD)


def _both(cell: Cell, profiles=PROFILES):
    """The cell measured here and projected, as rows."""
    measured = cell.resolve(profiles)
    projected = dataclasses.replace(cell, source="projected").resolve(profiles)
    return (to_record(measured, measure(measured, QUICK), "t"),
            to_record(projected, project_outcome(projected), "t"))


def test_a_new_technique_is_one_object_measured_and_projected(registered):
    stack = parse_stack("amp-bf16+freeze-first-layer")
    assert stack.name == "freeze-first-layer+amp-bf16"  # ordered by its phase among the others
    base = _both(Cell("gpt", "smoke", "train", "baseline", "cpu", 4))
    frozen = _both(Cell("gpt", "smoke", "train", FREEZE.id, "cpu", 4))
    for before, after in zip(base, frozen, strict=True):
        assert after.status == "ok", after.reason
        assert after.grads_bytes < before.grads_bytes and after.optimizer_bytes < before.optimizer_bytes
    assert "parameters frozen" in frozen[0].notes


def test_a_new_workload_is_one_file_and_every_path_takes_it(registered):
    measured, projected = _both(Cell("residual-mlp", "mlp-4", "train", "baseline", "cpu", 16))
    assert measured.status == projected.status == "ok", (measured.reason, projected.reason)
    assert abs(projected.peak_allocated_bytes / measured.peak_allocated_bytes - 1) < 0.05
    # Its traits let the techniques that need them apply: sharing (uniform blocks), pruning (MLP roles).
    for technique in ("param-sharing", "structured-pruning", "checkpointing"):
        measured, _ = _both(Cell("residual-mlp", "mlp-4", "train", technique, "cpu", 16))
        assert measured.status == "ok", f"{technique}: {measured.reason}"
    # Its depth key lets projection trace 2 and 3 layers and extrapolate to 12.
    deep = Cell("residual-mlp", "mlp-12", "train", "baseline", "h100-sxm", 16, "projected").resolve(PROFILES)
    extrapolated = project(deep)
    assert extrapolated.memory.extrapolated_from == (2, 3)
    assert extrapolated.trace.peak_bytes == pytest.approx(traced(deep).peak_bytes, rel=0.005)


def test_a_new_gpu_is_one_toml(tmp_path):
    source = (BUILTIN_PROFILES_DIR / "l4.toml").read_text()
    edits = {'id = "l4"': 'id = "l4-48gb"', 'match = ["NVIDIA L4"]': 'match = ["NVIDIA L4 48GB"]',
             "memory_gib = 24 ": "memory_gib = 48 ", "visible_memory_mib = 23034": "visible_memory_mib = 46068"}
    for old, new in edits.items():
        source = source.replace(old, new)
    (tmp_path / "l4-48gb.toml").write_text(source)
    profiles = load_profiles(tmp_path)
    assert profiles["l4-48gb"].family == "l4" and profiles["l4-48gb"].capacity_bytes == 46068 * 2**20
    rows = {}
    for gpu in ("l4", "l4-48gb"):
        cell = Cell("gpt", "gpt2-1.3b", "train", "amp-bf16", gpu, 1, "projected").resolve(profiles)
        rows[gpu] = to_record(cell, project_outcome(cell), "t")
    assert rows["l4"].status == "oom" and rows["l4-48gb"].status == "ok"
    assert rows["l4-48gb"].usd_per_million_tokens > 0  # its price came with the copied file
    shutil.rmtree(tmp_path)


def test_every_outcome_figure_lands_in_its_own_record_column():
    # A new column: a Record field (records.py), its figure on the Outcome (outcome.py) and its mapping in
    # to_record. A figure added without its mapping, or two mapped to one column, fails here.
    cell = Cell("gpt", "smoke", "train", "baseline", "h100-sxm", 4, "projected").resolve(PROFILES)
    memory = MemoryFigures(**{f.name: (f"setting-{i}" if f.name == "allocator" else 1000 + i)
                              for i, f in enumerate(fields(MemoryFigures))})
    speed = SpeedFigures(**{f.name: (True if f.name == "noisy" else 2000 + i)
                            for i, f in enumerate(fields(SpeedFigures))})
    row = to_record(cell, Outcome(status="ok", memory=memory, speed=speed, precision="fp32"), "t").to_dict()
    for figures in (memory, speed):
        for f in fields(figures):
            value = getattr(figures, f.name)
            holders = [column for column in COLUMNS if type(row[column]) is type(value) and row[column] == value]
            assert len(holders) == 1, f"{type(figures).__name__}.{f.name} -> {holders}"
    assert row["mfu"] is not None and row["usd_per_million_tokens"] is not None  # derived in one place
