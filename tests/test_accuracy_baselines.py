"""The default (smoke) budget trains every task's baseline far above chance, so deltas against it mean
something: digits >= 90% top-1, text well under the bytes' unigram entropy (about 4.6 bits per byte),
masked bytes well above the 15% of always guessing a space. One seed each, as the default run trains it."""

from __future__ import annotations

import os

import pytest
import torch

from harness.accuracy import scoring, training
from harness.profiles import detect_local, load_profiles
from suites.tasks import task_for
from suites.tasks.base import metric_value
from suites.workloads import get_workload


@pytest.fixture(autouse=True)
def all_cores():
    """These train for real: on every core (conftest pins one for repeatable timings, which these do not read)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


def _baseline(workload: str) -> float:
    task = task_for(workload)
    budget = task.budget("smoke")
    trainer = training.Trainer(task, task.bind(get_workload(workload)), detect_local(load_profiles(None)),
                               torch.device("cpu"), budget)
    model = trainer.trained((), seed=0)
    return metric_value(task.kind, scoring.score(trainer.deployed(model, training.Roles((), (), ()), 0), task, budget))


@pytest.mark.parametrize(("workload", "check"), [
    ("resnet50", lambda top1: top1 >= 0.90),
    ("gpt", lambda bits: bits < 4.0),
    ("bert", lambda accuracy: accuracy > 0.22),
])
def test_the_smoke_budget_trains_far_above_chance(workload, check):
    figure = _baseline(workload)
    assert check(figure), f"{workload} baseline {figure:.4f}"
