"""Give the results rows of each measured workload and stack the accuracy `accuracy.csv` holds for it.

Accuracy belongs to a stack, not to a GPU or a size: it is measured once per workload and stack on the
task's small model (harness/accuracy/book.py) and copied onto every row of that workload and stack that
ran or ran out of memory, with `accuracy_basis` saying what it was measured on.
"""

from __future__ import annotations

from harness.accuracy.book import AccuracyBook, AccuracyRow
from harness.records import Record, ResultsStore

FILLED_STATUSES = ("ok", "oom")


def accuracy_fields(row: AccuracyRow) -> dict:
    return {"accuracy_metric": row.metric, "accuracy": row.accuracy, "accuracy_noise": row.accuracy_std,
            "accuracy_delta": row.delta, "accuracy_delta_ci95": row.delta_ci95, "accuracy_verdict": row.verdict,
            "accuracy_seeds": row.seeds, "accuracy_agreement": row.agreement, "accuracy_kl": row.kl,
            "accuracy_basis": row.basis}


def attach_accuracy(store: ResultsStore, book: AccuracyBook) -> int:
    """Fill the accuracy columns of the store's rows from `book`; the number of rows filled."""
    filled = 0
    for row in store.rows():
        measured = book.rows.get((row["workload"], row["technique"]))
        if measured is None or measured.status != "ok" or row["status"] not in FILLED_STATUSES:
            continue
        updated = dict(row, **accuracy_fields(measured))
        if updated != row:
            store.add(Record(**updated))
        filled += 1
    return filled
