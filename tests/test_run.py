"""The runner: every way a cell can fail becomes a row with its cause, and the run goes on."""

from __future__ import annotations

import dataclasses

import pytest

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.records import ResultsStore
from harness.runner import RunnerOptions, run_isolated, run_plan
from tests.faulty_cell import FAULTY, registered

PROFILES = load_profiles()


def _cell(behaviour: str) -> Cell:
    return Cell(workload=FAULTY.name, size=behaviour, mode="train", technique="baseline", gpu="cpu", batch_size=4)


@pytest.fixture(autouse=True, scope="module")
def faulty_workload():
    with registered():
        yield


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, faulty_workload):
    """One run through the real runner over cells that raise, OOM, crash, exit and hang."""
    store = ResultsStore(tmp_path_factory.mktemp("faulty"))
    store.prepare()
    # Cells that end by themselves get a margin no machine's load reaches (importing torch took over 8 s
    # on a loaded 2-core machine); only the cell that hangs is meant to meet its timeout.
    options = RunnerOptions(run_id="test", cell_timeout_s=600, cell_entry="tests.faulty_cell")
    records = run_plan([_cell(b) for b in ("raise", "oom", "segfault", "exit")], PROFILES, store, options)
    records += run_plan([_cell("hang")], PROFILES, store, dataclasses.replace(options, cell_timeout_s=8))
    return {r.size: r for r in records}, store


@pytest.mark.parametrize("behaviour, status, cause", [
    ("raise", "error", "KeyError: 'injected failure'"),
    ("oom", "oom", "OutOfMemoryError"),
    ("segfault", "error", "SIGSEGV"),
    ("exit", "error", "exited with code 3"),
    ("hang", "timeout", "exceeded --cell-timeout 8 s"),
])
def test_each_failure_becomes_a_row_naming_its_cause(faulty_run, behaviour, status, cause):
    records, _ = faulty_run
    record = records[behaviour]
    assert record.status == status
    assert cause in record.reason
    assert record.source == "measured" and record.peak_allocated_bytes is None


def test_the_run_goes_on_and_every_row_is_stored(faulty_run):
    records, store = faulty_run
    assert len(records) == 5
    frame = store.write_frame()
    assert sorted(frame["size"]) == sorted(records)
    assert (store.root / "results.parquet").exists() and (store.root / "results.csv").exists()


def test_resume_skips_recorded_cells(tmp_path):
    store = ResultsStore(tmp_path)
    store.prepare()
    options = RunnerOptions(run_id="first", cell_timeout_s=30, cell_entry="tests.faulty_cell")
    run_plan([_cell("exit")], PROFILES, store, options)
    seen = []
    again = run_plan([_cell("exit"), _cell("raise")], PROFILES, store, options, resume=True,
                     on_done=lambda i, n, cell, record: seen.append((cell.size, record is None)))
    assert [r.size for r in again] == ["raise"]
    assert seen == [("exit", True), ("raise", False)]
    assert len(store.rows()) == 2


def test_unsupported_cells_are_rows_without_a_process(tmp_path):
    store = ResultsStore(tmp_path)
    store.prepare()
    cell = Cell(workload=FAULTY.name, size="exit", mode="infer", technique="checkpointing", gpu="cpu", batch_size=4)
    # Started, this cell's process would exit with code 3 (an `error` row): unsupported cells start none.
    [record] = run_plan([cell], PROFILES, store, RunnerOptions(run_id="t", cell_entry="tests.faulty_cell"))
    assert record.status == "unsupported" and "training" in record.reason


def _env_cell() -> Cell:
    # `test-env` is registered only in the cell's process, by its entry module (tests/env_cell.py).
    return Cell(workload="gpt", size="smoke", mode="infer", technique="test-env", gpu="cpu", batch_size=2)


def test_a_stack_that_sets_the_environment_restarts_its_cell_with_it(monkeypatch):
    # Allocator settings must be in the environment before `import torch`; the entry module notes what
    # it saw at the very start of the process that measured the cell.
    monkeypatch.delenv("HEADROOM_TEST_ALLOC_SETTING", raising=False)
    record = run_isolated(_env_cell(), RunnerOptions(run_id="t", cell_timeout_s=120, cell_entry="tests.env_cell"))
    assert record.status == "ok", record.reason
    assert "HEADROOM_TEST_ALLOC_SETTING at process start: on" in record.notes


def test_a_cell_restarts_for_its_environment_at_most_once(monkeypatch):
    from harness.measure.process import RESTARTED

    monkeypatch.delenv("HEADROOM_TEST_ALLOC_SETTING", raising=False)
    monkeypatch.setenv(RESTARTED, "1")  # as if this were the restarted process, still without the setting
    record = run_isolated(_env_cell(), RunnerOptions(run_id="t", cell_timeout_s=120, cell_entry="tests.env_cell"))
    assert record.status == "error"
    assert "did not hold after a restart" in record.reason


def test_twin_errors_compare_peak_step_time_and_reserved(tmp_path):
    from harness.records import Record
    from harness.runner import attach_twin_errors

    store = ResultsStore(tmp_path)
    identity = dict(run_id="r", workload="gpt", size="gpt2-124m", mode="train", technique="baseline",
                    gpu="h200", batch_size=8, status="ok")
    store.add(Record(**identity, source="measured", cell_id="m", peak_allocated_bytes=1000,
                     peak_reserved_bytes=1200, step_time_ms_p50=10.0))
    store.add(Record(**identity, source="projected", cell_id="p", peak_allocated_bytes=1100,
                     peak_reserved_bytes=1260, step_time_ms_p50=8.0))
    store.add(Record(**dict(identity, gpu="a100-sxm4-80gb"), source="projected", cell_id="q",
                     peak_allocated_bytes=1, peak_reserved_bytes=1, step_time_ms_p50=1.0))
    attach_twin_errors(store)
    rows = {row["cell_id"]: row for row in store.rows()}
    assert rows["p"]["peak_error_vs_measured"] == pytest.approx(0.10)
    assert rows["p"]["reserved_error_vs_measured"] == pytest.approx(0.05)
    assert rows["p"]["step_time_error_vs_measured"] == pytest.approx(-0.20)
    # A projection for another GPU has no twin here: its errors stay unknown.
    assert rows["q"]["peak_error_vs_measured"] is None and rows["q"]["reserved_error_vs_measured"] is None


@pytest.mark.parametrize("setting, projected", [("native", 1260), ("expandable_segments", 1140),
                                                ("cudaMallocAsync", 1080), (None, 1260)])
def test_reserved_twin_error_uses_the_allocator_setting_the_twin_ran_under(tmp_path, setting, projected):
    from harness.records import Record, read_results
    from harness.runner import attach_twin_errors
    from harness.twins import twin_table

    store = ResultsStore(tmp_path)
    identity = dict(run_id="r", workload="gpt", size="gpt2-124m", mode="train", technique="baseline",
                    gpu="h200", batch_size=8, status="ok")
    store.add(Record(**identity, source="measured", cell_id="m", peak_allocated_bytes=1000,
                     peak_reserved_bytes=1200, step_time_ms_p50=10.0, allocator=setting))
    store.add(Record(**identity, source="projected", cell_id="p", peak_allocated_bytes=1100,
                     peak_reserved_bytes=1260, peak_reserved_expandable_bytes=1140, peak_reserved_async_bytes=1080,
                     step_time_ms_p50=8.0))
    attach_twin_errors(store)
    store.write_frame()
    expected = projected / 1200 - 1
    assert {r["cell_id"]: r for r in store.rows()}["p"]["reserved_error_vs_measured"] == pytest.approx(expected)
    [row] = twin_table(read_results(tmp_path)).to_dict("records")
    assert row["reserved err"] == pytest.approx(expected)


def test_twin_table_pairs_rows_within_their_run(tmp_path):
    # The GPU check measures the same cell once per allocator setting, each in its own run.
    import pandas as pd

    from harness.records import Record, read_results
    from harness.twins import twin_table

    identity = dict(workload="gpt", size="gpt2-124m", mode="train", technique="amp-bf16", gpu="h200",
                    batch_size=8, status="ok")
    frames = []
    for run, setting, measured in (("a", "native", 1200), ("b", "expandable_segments", 1100),
                                   ("c", "cudaMallocAsync", 1050)):
        store = ResultsStore(tmp_path / run)
        store.add(Record(**identity, run_id=run, source="measured", cell_id="m", peak_allocated_bytes=1000,
                         peak_reserved_bytes=measured, allocator=setting))
        store.add(Record(**identity, run_id=run, source="projected", cell_id="p", peak_allocated_bytes=1000,
                         peak_reserved_bytes=1260, peak_reserved_expandable_bytes=1155, peak_reserved_async_bytes=1000))
        store.write_frame()
        frames.append(read_results(tmp_path / run))
    table = twin_table(pd.concat(frames, ignore_index=True))
    errors = dict(zip(table["allocator"], table["reserved err"], strict=True))
    assert errors == pytest.approx({"native": 0.05, "expandable_segments": 0.05, "cudaMallocAsync": 1000 / 1050 - 1})


def test_twins_pair_only_rows_of_the_same_prompt_generation_and_world(tmp_path):
    # A resumed run keeps its run id, and `--seq-len`/`--gen-len` may change between its halves.
    from harness.records import Record, read_results
    from harness.twins import twin_pairs

    identity = dict(workload="gpt", size="gpt2-124m", mode="infer", technique="baseline", gpu="h200", batch_size=1,
                    status="ok", run_id="r", gen_len=16)
    store = ResultsStore(tmp_path)
    store.add(Record(**identity, seq_len=512, source="measured", cell_id="m512", peak_allocated_bytes=900))
    store.add(Record(**identity, seq_len=64, source="projected", cell_id="p64", peak_allocated_bytes=100))
    store.add(Record(**identity, seq_len=512, source="projected", cell_id="p512", peak_allocated_bytes=1000))
    store.write_frame()
    rows = read_results(tmp_path).to_dict("records")  # through the CSV: 512.0 beside 512, NaN for None
    assert [(p["cell_id"], m["cell_id"]) for p, m in twin_pairs(rows)] == [("p512", "m512")]
    resnet = dict(identity, workload="resnet50", size="resnet50", gen_len=None)
    other = ResultsStore(tmp_path / "resnet")
    other.add(Record(**resnet, source="measured", cell_id="m", peak_allocated_bytes=900))
    other.add(Record(**resnet, source="projected", cell_id="p", peak_allocated_bytes=1000))
    other.write_frame()
    assert len(twin_pairs(read_results(tmp_path / "resnet").to_dict("records"))) == 1  # no shape: NaN pairs


@pytest.mark.parametrize("message, status", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom"),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "oom"),
    ("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory", "oom"),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)", "error"),
])
def test_library_allocation_failures_count_as_out_of_memory(message, status):
    from harness.measure.process import failure_status

    assert failure_status(RuntimeError(message)) == status


def test_a_cell_whose_names_do_not_resolve_is_an_error_row_naming_them(tmp_path):
    store = ResultsStore(tmp_path)
    store.prepare()
    cell = Cell(workload="gpt", size="no-such-size", mode="train", technique="baseline", gpu="cpu", batch_size=4)
    [record] = run_plan([cell], PROFILES, store, RunnerOptions(run_id="t"))
    assert record.status == "error" and "unknown size 'no-such-size'" in record.reason
    assert record.cell_id == cell.cell_id


def test_a_resumed_run_keeps_its_run_id_so_twins_made_across_the_resume_pair(tmp_path):
    from harness.records import Record
    from harness.runner import attach_twin_errors

    identity = dict(workload="gpt", size="gpt2-124m", mode="train", technique="baseline", gpu="h200",
                    batch_size=8, status="ok")
    first = ResultsStore(tmp_path)
    assert first.open("first") == "first"
    first.add(Record(**identity, run_id="first", source="measured", cell_id="m", peak_allocated_bytes=1000))
    first._lock_handle.close()  # the first run ends (killed, say), and its lock goes with it
    # Resumed under a new id, the run goes on under the one its folder holds.
    store = ResultsStore(tmp_path)
    run_id = store.open("second", resume=True)
    assert run_id == "first"
    store.add(Record(**identity, run_id=run_id, source="projected", cell_id="p", peak_allocated_bytes=1100))
    attach_twin_errors(store)
    assert {r["cell_id"]: r for r in store.rows()}["p"]["peak_error_vs_measured"] == pytest.approx(0.10)


def test_a_long_workload_name_gets_a_cell_id_that_fits_a_file_name_and_stays_unique(tmp_path):
    from harness.records import Record

    # A Hugging Face config in its cache: a long absolute path, and a size named by a 40-digit hash.
    path = "/home/alice/.cache/huggingface/hub/models--meta-llama--Llama-2-7b-hf/snapshots/" + "01c7" * 10
    cells = [Cell(f"hf:{path}/{n}/config.json", "01c7" * 10, "train", "amp-bf16+checkpointing+grad-accumulation",
                  "h100-sxm", 4, "projected") for n in ("a", "b")]
    ids = [cell.cell_id for cell in cells]
    assert ids[0] != ids[1] and all(len(i) <= 200 for i in ids)
    store = ResultsStore(tmp_path)
    store.prepare()
    for cell in cells:
        store.add(Record(run_id="r", workload=cell.workload, size=cell.size, mode=cell.mode,
                         technique=cell.technique, gpu=cell.gpu, source=cell.source, status="ok",
                         cell_id=cell.cell_id))
    assert store.done() == set(ids)
