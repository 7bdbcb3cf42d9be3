"""The accuracy tasks' data: real, offline, deterministic and disjoint splits, batches shaped as the
workloads take them (suites/tasks)."""

from __future__ import annotations

import torch

from suites.tasks import TASKS, digits, stdlib_text, task_for, text_tasks
from suites.workloads import get_workload
from suites.workloads.bert import IGNORE


def test_every_builtin_workload_has_a_task_whose_metric_its_rows_name():
    for name in ("resnet50", "bert", "gpt"):
        task = task_for(name)
        assert task is not None and task.workload == name
        assert get_workload(name).accuracy_metric == task.metric
    assert task_for("model:pkg.mod:factory") is None
    assert set(TASKS) == {"resnet50", "bert", "gpt"}


def test_digits_splits_are_disjoint_deterministic_and_cover_the_set():
    data = digits.load(32)
    assert len(data.train) + len(data.val) + len(data.test) == 1797  # scikit-learn's digits
    assert data.train.images.shape[1:] == (3, 32, 32)
    parts = digits.split_indices(1797)
    seen = torch.cat(list(parts.values()))
    assert len(set(seen.tolist())) == 1797  # every image in exactly one split
    assert torch.equal(digits.split_indices(1797)["test"], parts["test"])
    again = digits.load.__wrapped__(32)
    assert torch.equal(again.test.labels, data.test.labels)
    assert abs(data.train.images.mean().item()) < 0.05  # normalised on the training split
    assert set(data.test.labels.tolist()) == set(range(10))


def test_digits_batches_draw_from_train_and_score_the_whole_test_split():
    generator = torch.Generator().manual_seed(0)
    batch = digits.sample(digits.SIZE, 16, generator)
    assert batch["images"].shape == (16, 3, 32, 32) and batch["labels"].dtype == torch.int64
    tests = digits.test_batches(digits.SIZE, 10_000)
    assert sum(len(b["labels"]) for b in tests) == len(digits.load(32).test)


def test_stdlib_corpus_splits_docstrings_by_their_hash():
    corpus = stdlib_text.load()
    assert corpus.modules >= 60 and min(corpus.documents) > 100
    assert len(corpus.train) > 5 * len(corpus.test) > 0
    docs = stdlib_text.docstrings("textwrap")
    assert docs and all(len(d) >= stdlib_text.MIN_CHARS for d in docs)
    for doc in docs:
        part = {stdlib_text.TEST_BUCKET: corpus.test, stdlib_text.VAL_BUCKET: corpus.val}.get(
            stdlib_text.bucket(doc), corpus.train)
        assert doc.encode() in part
    assert stdlib_text.docstrings("no_such_module_here") == []
    assert corpus.describe().startswith(f"{sum(corpus.documents):,} docstrings")


def test_byte_lm_batches_predict_the_next_byte():
    size = text_tasks.GPT_SIZE
    batch = text_tasks.lm_sample(size, 4, torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (4, size.seq_len)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["input_ids"].max()) < 256
    first, second = text_tasks.lm_test_batches(size, 100), text_tasks.lm_test_batches(size, 100)
    assert sum(len(b["input_ids"]) for b in first) == 100
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(first, second, strict=True))


def test_byte_mlm_batches_mask_fifteen_percent_with_a_symbol_of_their_own():
    size = text_tasks.BERT_SIZE
    batch = text_tasks.mlm_sample(size, 8, torch.Generator().manual_seed(0))
    masked = batch["labels"] != IGNORE
    assert (masked.sum(dim=1) == round(0.15 * size.seq_len)).all()
    assert (batch["input_ids"][masked] == text_tasks.MASK_ID).all()
    assert (batch["input_ids"][~masked] < 256).all()
    assert size.config["vocab_size"] == 257
    one, two = text_tasks.mlm_test_batches(size, 64), text_tasks.mlm_test_batches(size, 64)
    assert torch.equal(one[0]["labels"], two[0]["labels"])  # the same masked positions for every model
