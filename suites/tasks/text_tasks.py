"""Byte-level tasks on the standard library's docstrings (suites/tasks/stdlib_text.py).

GPT models the next byte (bits per byte on the test split, scored as served: the first half of each
test window is prefilled into the KV cache, the rest fed one byte at a time, each prediction made from
the cache); BERT fills in masked bytes (accuracy over the masked positions, 15% of each window, with
a 257th symbol as the mask).
"""

from __future__ import annotations

import sys

import torch

from suites.tasks import stdlib_text
from suites.tasks.base import ACCURACY, BITS_PER_BYTE, Budget, Task
from suites.workloads.base import Batch, SizeSpec
from suites.workloads.bert import IGNORE, MASK_PROB

BYTES = 256
MASK_ID = BYTES  # BERT's vocabulary is the 256 bytes plus this mask symbol
EVAL_BATCH = 256
TEST_MASK_SEED = 1234  # the test windows' masked positions: fixed, so every model is scored on the same ones

# Two blocks, so cross-layer sharing has something to share. Windows are short because a CPU trains these in
# seconds: the decoder reaches well under the bytes' unigram entropy (about 4.6 bits) in 400 steps of 64-byte
# windows; the post-LN encoder predicts only the most common byte (15% masked-byte accuracy) until attention
# learns to read its neighbours, which took about 1,400 steps on 64-byte windows and about 450 on 16-byte ones
# (measured on this task, 2 CPU cores).
GPT_SIZE = SizeSpec(name="bytes-2x128", scale="any", batch_size=32, seq_len=64,
                    config=dict(n_layer=2, n_embd=128, n_head=4, vocab_size=BYTES, block_size=64))
BERT_SIZE = SizeSpec(name="bytes-2x128", scale="any", batch_size=128, seq_len=16,
                     config=dict(n_layer=2, n_embd=128, n_head=4, vocab_size=BYTES + 1))


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def _random_windows(length: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """[B, length] windows of the training split at random offsets."""
    train = _as_tensor(stdlib_text.load().train)
    starts = torch.randint(0, len(train) - length, (batch_size, 1), generator=generator)
    return train[starts + torch.arange(length)]


def _test_windows(length: int, count: int) -> torch.Tensor:
    """[count, length] windows spread evenly over the whole test split (not its first documents only)."""
    test = _as_tensor(stdlib_text.load().test)
    count = max(1, min(count, len(test) // length))
    starts = torch.linspace(0, len(test) - length, count).long().unsqueeze(1)
    return test[starts + torch.arange(length)]


def _lm_batch(windows: torch.Tensor) -> Batch:
    return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


def _mlm_batch(windows: torch.Tensor, generator: torch.Generator) -> Batch:
    """BERT's masking rule (suites/workloads/bert.py): the same number of masked positions per window."""
    batch, seq = windows.shape
    targets = max(1, round(MASK_PROB * seq))
    chosen = torch.rand(batch, seq, generator=generator).topk(targets, dim=1).indices
    masked = torch.zeros(batch, seq, dtype=torch.bool).scatter_(1, chosen, True)
    return {"input_ids": torch.where(masked, MASK_ID, windows),
            "token_type_ids": torch.zeros(batch, seq, dtype=torch.long),
            "labels": torch.where(masked, windows, IGNORE)}


def lm_sample(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    return _lm_batch(_random_windows(size.seq_len + 1, batch_size, generator))


def lm_test_batches(size: SizeSpec, samples: int) -> list[Batch]:
    windows = _test_windows(size.seq_len + 1, samples)
    return [_lm_batch(windows[i:i + EVAL_BATCH]) for i in range(0, len(windows), EVAL_BATCH)]


def mlm_sample(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    return _mlm_batch(_random_windows(size.seq_len, batch_size, generator), generator)


def mlm_test_batches(size: SizeSpec, samples: int) -> list[Batch]:
    windows = _test_windows(size.seq_len, samples)
    generator = torch.Generator().manual_seed(TEST_MASK_SEED)
    return [_mlm_batch(windows[i:i + EVAL_BATCH], generator) for i in range(0, len(windows), EVAL_BATCH)]


def describe() -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"Python {python} stdlib docstrings as UTF-8 bytes: {stdlib_text.load().describe()}"


BYTE_LM = Task(
    name="stdlib-bytes-lm", workload="gpt", metric="bits-per-byte", kind=BITS_PER_BYTE, size=GPT_SIZE,
    budgets={"smoke": Budget(steps=400, batch_size=32, lr=3e-3, eval_samples=512),
             "standard": Budget(steps=2000, batch_size=32, lr=3e-3, eval_samples=1024)},
    describe=describe, sample=lm_sample, test_batches=lm_test_batches, served=True)

BYTE_MLM = Task(
    name="stdlib-bytes-mlm", workload="bert", metric="masked-byte-accuracy", kind=ACCURACY, size=BERT_SIZE,
    budgets={"smoke": Budget(steps=800, batch_size=128, lr=1e-3, eval_samples=2048),
             "standard": Budget(steps=3000, batch_size=128, lr=1e-3, eval_samples=4096)},
    describe=describe, sample=mlm_sample, test_batches=mlm_test_batches)
