"""Accuracy tasks: real, offline data per workload (suites/tasks/base.py has the contract)."""

from __future__ import annotations

from suites.tasks import digits, text_tasks
from suites.tasks.base import Task

TASKS: dict[str, Task] = {task.workload: task for task in (digits.TASK, text_tasks.BYTE_LM, text_tasks.BYTE_MLM)}


def task_for(workload: str) -> Task | None:
    """The accuracy task of a workload, or None (a user's own model has none)."""
    return TASKS.get(workload)
