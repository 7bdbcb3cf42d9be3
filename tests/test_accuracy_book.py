"""Accuracy of stacks on real data, end to end on tiny budgets (harness/accuracy): roles, seeds, resume,
fidelity, the rows it fills and the command that runs it."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch

from harness.accuracy import training
from harness.accuracy.attach import attach_accuracy
from harness.accuracy.book import AccuracyBook, measure_accuracy
from harness.accuracy.scoring import score
from harness.profiles import detect_local, load_profiles
from suites import tasks
from suites.tasks.base import Budget
from suites.techniques import TECHNIQUES, parse_stack
from suites.workloads import get_workload

TINY = {"resnet50": Budget(steps=3, batch_size=16, lr=2e-3, eval_samples=64),
        "gpt": Budget(steps=3, batch_size=4, lr=3e-3, eval_samples=8),
        "bert": Budget(steps=3, batch_size=8, lr=1e-3, eval_samples=32)}


@pytest.fixture
def tiny_budgets(monkeypatch):
    """Every task trains a few steps: these tests check the plumbing, not the figures."""
    for name, budget in TINY.items():
        monkeypatch.setitem(tasks.TASKS, name, dataclasses.replace(
            tasks.TASKS[name], budgets={"smoke": budget, "standard": budget}))


@pytest.fixture(scope="module")
def local():
    return detect_local(load_profiles(None))


def test_a_stack_splits_into_training_fine_tuned_and_deployed_techniques():
    parts = training.roles(parse_stack("amp-bf16+structured-pruning+group-quant-int4"))
    assert [t.id for t in parts.train] == ["amp-bf16"]
    assert [t.id for t in parts.fine_tuned] == ["structured-pruning"]
    assert [t.id for t in parts.post] == ["group-quant-int4"]
    assert [t.id for t in parts.step_settings] == ["amp-bf16"]
    assert training.roles(parse_stack("param-sharing+checkpointing")).fine_tuned == ()


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    assert training._schedule(0, 10, 100) == pytest.approx(0.1)
    assert training._schedule(9, 10, 100) == pytest.approx(1.0)
    assert training._schedule(100, 10, 100) == pytest.approx(0.1)


def test_a_long_training_run_says_how_far_it_is(monkeypatch, local):
    monkeypatch.setattr(training, "HEARTBEAT_S", 0.0)  # every step is "long enough" since the last word
    workload = get_workload("gpt")
    size = workload.sizes["smoke"]
    run = training.Run(workload=workload, size=size, mode="train", profile=local, model=workload.build(size),
                       batch_size=2)
    beats = []
    training.train(run, torch.device("cpu"), 4, 1e-3, 2, 0, lambda *beat: beats.append(beat))
    assert [(done, total) for done, total, _ in beats] == [(1, 4), (2, 4), (3, 4)]  # the last step reports itself
    assert all(per_step > 0 for _, _, per_step in beats)


def test_rows_per_stack_with_paired_deltas_fidelity_and_resume(tiny_budgets, local, tmp_path):
    book = AccuracyBook(tmp_path)
    lines = []
    measure_accuracy({"resnet50": ["baseline", "ptq-int8", "group-quant-int4"]}, book, local,
                     torch.device("cpu"), seeds=2, progress=lines.append)
    base, ptq, int4 = (book.rows[("resnet50", name)] for name in ("baseline", "ptq-int8", "group-quant-int4"))
    assert base.status == "ok" and base.verdict == "reference" and base.delta == 0.0
    assert len(base.values.split(";")) == 2 and 0.0 <= base.accuracy <= 1.0
    assert ptq.status == "ok" and ptq.baseline == pytest.approx(base.accuracy)
    assert ptq.delta == pytest.approx(ptq.accuracy - base.accuracy)
    assert 0.0 <= ptq.agreement <= 1.0 and ptq.kl >= 0.0 and ptq.verdict
    assert "applied to the trained model" in ptq.notes
    assert int4.status == "unsupported" and "convolutions" in int4.reason
    assert any("seed 1" in line for line in lines)
    # Resume: the file holds the rows, numbers as numbers, and nothing is measured again.
    again = AccuracyBook(tmp_path)
    assert again.rows[("resnet50", "ptq-int8")].accuracy == pytest.approx(ptq.accuracy)
    assert isinstance(again.rows[("resnet50", "ptq-int8")].seeds, int)
    assert again.done("resnet50", "ptq-int8", "smoke", 2) and not again.done("resnet50", "ptq-int8", "smoke", 3)
    lines.clear()
    measure_accuracy({"resnet50": ["ptq-int8"]}, again, local, torch.device("cpu"), seeds=2, progress=lines.append)
    assert lines == []


def test_a_decoder_is_scored_as_served_so_the_int8_cache_counts(tiny_budgets, local, tmp_path):
    book = AccuracyBook(tmp_path)
    measure_accuracy({"gpt": ["kv-int8", "structured-pruning"]}, book, local, torch.device("cpu"), seeds=2,
                     progress=lambda line: None)
    kv = book.rows[("gpt", "kv-int8")]
    assert kv.status == "ok" and kv.metric == "bits-per-byte" and kv.higher_is_better is False
    assert kv.agreement > 0.9 and 0 < kv.kl < 0.05  # the int8 cache changes the outputs, a little
    pruned = book.rows[("gpt", "structured-pruning")]
    assert pruned.status == "ok" and "fine-tuned" in pruned.notes
    assert math.isfinite(pruned.accuracy)


def test_adapters_are_compared_with_full_fine_tuning_of_the_same_model(tiny_budgets, local, tmp_path):
    book = AccuracyBook(tmp_path)
    measure_accuracy({"gpt": ["lora", "qlora"]}, book, local, torch.device("cpu"), seeds=2,
                     progress=lambda line: None)
    base, lora, qlora = (book.rows[("gpt", name)] for name in ("baseline", "lora", "qlora"))
    for row in (lora, qlora):
        assert row.status == "ok" and row.verdict.endswith("vs full fine-tuning")
        assert "compared (baseline column, delta, fidelity) with full fine-tuning" in row.notes
        # The reference is the baseline fine-tuned whole for the same steps, so it moved from the baseline.
        assert row.baseline != pytest.approx(base.accuracy, abs=1e-9)
        assert row.delta == pytest.approx(row.accuracy - row.baseline)
    assert lora.baseline == pytest.approx(qlora.baseline)  # the same full fine-tunes, measured once per seed


def test_served_scoring_matches_a_full_forward_and_reads_the_int8_cache(local):
    task = tasks.TASKS["gpt"]
    budget = dataclasses.replace(TINY["gpt"], eval_samples=4)
    trainer = training.Trainer(task, task.bind(get_workload("gpt")), local, torch.device("cpu"), budget)
    torch.manual_seed(0)
    model = trainer.workload.build(task.size)
    step = trainer.deployed(model, training.Roles((), (), ()), 0)
    served = score(step, task, budget)
    full = score(step, dataclasses.replace(task, served=False), budget)
    prompt = task.size.seq_len // 2
    per_window = full.log_probs.shape[0] // 4
    rows = torch.cat([torch.arange(i * per_window + prompt - 1, (i + 1) * per_window) for i in range(4)])
    torch.testing.assert_close(served.log_probs, full.log_probs[rows], atol=1e-4, rtol=1e-4)
    int8 = score(trainer.deployed(model, training.Roles((), (), (TECHNIQUES["kv-int8"],)), 0), task, budget)
    assert not torch.equal(int8.log_probs, served.log_probs)  # the quantised cache is what the decode steps read
    torch.testing.assert_close(int8.log_probs, served.log_probs, atol=0.05, rtol=0.05)


def test_a_missing_data_package_makes_every_stack_unsupported_with_the_fix(tiny_budgets, local, tmp_path,
                                                                           monkeypatch):

    def missing():
        raise RuntimeError("the digits task needs scikit-learn, which ships the data: pip install scikit-learn")

    monkeypatch.setitem(tasks.TASKS, "resnet50", dataclasses.replace(tasks.TASKS["resnet50"], describe=missing))
    book = AccuracyBook(tmp_path)
    measure_accuracy({"resnet50": ["ptq-int8"]}, book, local, torch.device("cpu"), seeds=2, progress=lambda line: None)
    assert book.rows[("resnet50", "ptq-int8")].status == "unsupported"
    assert "pip install scikit-learn" in book.rows[("resnet50", "baseline")].reason


def test_the_run_fills_the_rows_of_its_stacks_and_the_report_judges_c6_and_c9(tiny_budgets, tmp_path):
    from harness.cli import main

    out = tmp_path / "run"
    code = main(["run", "--gpu", "cpu", "--workload", "bert", "--technique", "baseline,ptq-int8,param-sharing",
                 "--mode", "infer", "--accuracy", "--accuracy-seeds", "2", "--out", str(out), "--steps", "10",
                 "--repeats", "1", "--warmup", "1"])
    assert code == 0
    frame = pd.read_csv(out / "results.csv")
    ok = frame[frame["status"] == "ok"]
    assert ok["accuracy"].notna().all() and (ok["accuracy_metric"] == "masked-byte-accuracy").all()
    assert ok["accuracy_basis"].str.contains("stdlib-bytes-mlm").all()
    assert (ok.loc[ok["technique"] == "baseline", "accuracy_verdict"] == "reference").all()
    verdicts = ok.loc[ok["technique"] != "baseline", "accuracy_verdict"]
    assert verdicts.str.match(r"^(within noise|degrades by \d|improves by \d)").all()
    html = (out / "report.html").read_text()
    assert "Accuracy on real data" in html
    # The claims table judges C6 and C9 on these rows (reports/claims.py): a finding, not "not measured".
    for claim in ("C6", "C9"):
        row = html.split(f'<td class="l">{claim}</td>')[1].split("</tr>")[0]
        assert "not measured in these results" not in row and "accuracy.csv" in row


def test_attach_leaves_unsupported_rows_and_other_stacks_alone(tmp_path):
    from harness.accuracy.book import AccuracyRow
    from harness.records import Record, ResultsStore

    store = ResultsStore(tmp_path)
    store.open("r1")
    common = dict(run_id="r1", workload="gpt", size="smoke", mode="train", gpu="cpu", source="measured",
                  batch_size=4)
    store.add(Record(technique="ptq-int8", status="ok", cell_id="a", **common))
    store.add(Record(technique="ptq-int8", status="unsupported", cell_id="b", **dict(common, mode="infer")))
    store.add(Record(technique="baseline", status="ok", cell_id="c", **common))
    book = AccuracyBook(tmp_path)
    book.rows[("gpt", "ptq-int8")] = AccuracyRow(
        workload="gpt", technique="ptq-int8", status="ok", metric="bits-per-byte", accuracy=3.1, accuracy_std=0.1,
        delta=0.01, delta_ci95=0.02, verdict="within noise", seeds=3, steps=400, task="t", device="cpu")
    assert attach_accuracy(store, book) == 1
    rows = {(r["technique"], r["status"]): r for r in store.rows()}
    assert rows[("ptq-int8", "ok")]["accuracy"] == 3.1 and rows[("ptq-int8", "ok")]["accuracy_seeds"] == 3
    assert rows[("ptq-int8", "unsupported")]["accuracy"] is None
    assert rows[("baseline", "ok")]["accuracy"] is None
