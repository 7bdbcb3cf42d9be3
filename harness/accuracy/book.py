"""Accuracy of technique stacks on real data: every stack of a workload over the same seeds.

For each workload with a task (suites/tasks), each seed trains the baseline once; each stack is then
trained, fine-tuned or applied as its roles say (training.py), scored on the test split, and compared
with the baseline seed by seed (stats.py). One row per workload and stack lands in `accuracy.csv`
beside the results, written as each stack finishes, so a resumed run goes on where it stopped.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from harness.accuracy import scoring, stats, training
from suites.tasks import task_for
from suites.tasks.base import BITS_PER_BYTE, Scored, Task, metric_value
from suites.techniques import BASELINE, Stack, Unsupported, parse_stack
from suites.workloads import get_workload

FILE_NAME = "accuracy.csv"
DEFAULT_SEEDS = 3
# The default run's accuracy budget, per workload, sized so `nox -s bench` stays under 15 minutes on 2 CPU
# cores: the techniques the guide makes accuracy claims about (C6 sharing and C9 int8, both on BERT) and
# those a buyer of a smaller GPU reaches for (bf16 training, int4 weights and an int8 KV cache to serve a
# decoder, LoRA to fine-tune one; int8 and pruning for a vision model). ResNet's bf16 training is left
# out: CPUs have no native half-precision convolutions, so it takes minutes there. `--accuracy` measures
# any stack.
DEFAULT_STACKS = {
    "resnet50": ("baseline", "ptq-int8", "qat-int8", "structured-pruning"),
    "gpt": ("baseline", "amp-bf16", "ptq-int8", "group-quant-int4", "kv-int8", "structured-pruning", "lora"),
    "bert": ("baseline", "param-sharing", "ptq-int8", "qat-int8"),
}


@dataclass
class AccuracyRow:
    """One workload and stack: its figure per seed, their mean and spread, and the paired comparison."""

    workload: str
    technique: str
    status: str  # ok, unsupported, error
    reason: str = ""
    task: str = ""
    metric: str = ""
    higher_is_better: bool | None = None
    budget: str = ""  # the scale whose budget trained it
    seeds: int = 0
    steps: int = 0
    values: str = ""  # per-seed figures, `;`-separated, in seed order
    accuracy: float | None = None
    accuracy_std: float | None = None
    baseline: float | None = None
    delta: float | None = None
    delta_ci95: float | None = None
    verdict: str = ""
    agreement: float | None = None
    kl: float | None = None
    wall_s: float | None = None
    data: str = ""
    device: str = ""
    notes: str = ""

    @property
    def basis(self) -> str:
        """What the figure was measured on, for the results rows it fills."""
        return (f"measured on {self.task} ({self.data}); {self.seeds} seeds x {self.steps} steps "
                f"({self.budget} budget) on {self.device}; {stats.TEST_NAME}")


Progress = Callable[[str], None]
TEXT_FIELDS = {f.name for f in dataclasses.fields(AccuracyRow) if f.type == "str"}


class AccuracyBook:
    """Rows already in `accuracy.csv` (resume) and the ones this run adds."""

    def __init__(self, root: Path):
        self.path = root / FILE_NAME
        self.rows: dict[tuple[str, str], AccuracyRow] = {}
        if self.path.exists():
            frame = pd.read_csv(self.path, dtype={name: str for name in TEXT_FIELDS})
            known = {f.name for f in dataclasses.fields(AccuracyRow)}
            for record in frame.to_dict("records"):
                values = {k: ("" if k in TEXT_FIELDS else None) if pd.isna(v) else v
                          for k, v in record.items() if k in known}
                row = AccuracyRow(**values)
                row.seeds, row.steps = int(row.seeds), int(row.steps)
                self.rows[(row.workload, row.technique)] = row

    def done(self, workload: str, technique: str, budget: str, seeds: int) -> bool:
        row = self.rows.get((workload, technique))
        return row is not None and row.status != "error" and row.budget == budget and row.seeds == seeds

    def add(self, row: AccuracyRow) -> None:
        from harness.records import atomic_write_text

        self.rows[(row.workload, row.technique)] = row
        frame = pd.DataFrame([dataclasses.asdict(r) for r in self.rows.values()])
        atomic_write_text(self.path, frame.to_csv(index=False))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([dataclasses.asdict(r) for r in self.rows.values()])


def _unit(task: Task) -> str:
    return "bits/byte" if task.kind == BITS_PER_BYTE else "pts"


def measure_accuracy(requests: dict[str, list[str]], book: AccuracyBook, profile, device: torch.device,
                     scale: str = "smoke", seeds: int = DEFAULT_SEEDS, progress: Progress = print) -> None:
    """Fill `book` for every workload -> stack names in `requests` (workloads without a task are skipped
    with a line saying so). The baseline of each workload is always measured: deltas need it."""
    for workload_name, stack_names in requests.items():
        task = task_for(workload_name)
        if task is None:
            progress(f"accuracy: {workload_name} has no accuracy task (built-in workloads only); skipped")
            continue
        stacks = [parse_stack(name) for name in dict.fromkeys([BASELINE, *stack_names])]
        _workload(task, stacks, book, profile, device, scale, seeds, progress)


def _workload(task: Task, stacks: list[Stack], book: AccuracyBook, profile, device, scale: str, seeds: int,
              progress: Progress) -> None:
    budget = task.budget(scale)
    bound = task.bind(get_workload(task.workload))
    trainer = training.Trainer(task, bound, profile, device, budget)
    base = dict(workload=task.workload, task=task.name, metric=task.metric, higher_is_better=task.higher_is_better,
                budget=scale, seeds=seeds, steps=budget.steps, device=profile.name)
    pending = [s for s in stacks if not book.done(task.workload, s.name, scale, seeds)]
    if not pending:
        return
    try:
        data = task.describe()
    except RuntimeError as exc:  # the data's package is missing: every stack says so
        for stack in pending:
            book.add(AccuracyRow(technique=stack.name, status="unsupported", reason=str(exc), **base))
            progress(f"accuracy {task.workload} {stack.name}: unsupported ({exc})")
        return
    baselines: dict[int, tuple[torch.nn.Module, Scored]] = {}

    def baseline(seed: int) -> tuple[torch.nn.Module, Scored]:
        if seed not in baselines:
            model = trainer.trained((), seed)
            baselines[seed] = (model, scoring.score(trainer.deployed(model, training.Roles((), (), ()), seed),
                                                    task, budget))
        return baselines[seed]

    full_fine_tunes: dict[tuple, Scored] = {}

    def full_fine_tune(seed: int, settings: tuple) -> Scored:
        """The seed's trained baseline fine-tuned whole for the fine-tuning budget, with the stack's step
        settings (mixed precision, accumulation...): what adapters compare with."""
        key = (seed, tuple(t.id for t in settings))
        if key not in full_fine_tunes:
            full_fine_tunes[key] = scoring.score(
                trainer.deployed(baseline(seed)[0], training.Roles(settings, (), ()), seed, in_full=True), task,
                budget)
        return full_fine_tunes[key]

    for stack in stacks:  # the baseline first: every other stack compares with it
        if stack not in pending and stack.name != BASELINE:
            continue
        started = time.perf_counter()
        reason = training.check(stack, profile, bound)
        if reason:
            row = AccuracyRow(technique=stack.name, status="unsupported", reason=reason, data=data, **base)
        else:
            try:
                row = _measure(task, stack, trainer, baseline, full_fine_tune, seeds, data, base, progress)
            except Unsupported as exc:  # found while applying (a parallel stack outside torchrun)
                row = AccuracyRow(technique=stack.name, status="unsupported", reason=str(exc), data=data, **base)
            except Exception as exc:  # one stack failing must not lose the others' rows
                row = AccuracyRow(technique=stack.name, status="error", reason=f"{type(exc).__name__}: {exc}"[:500],
                                  data=data, **base)
        row.wall_s = time.perf_counter() - started
        if stack in pending:
            book.add(row)
            progress(f"accuracy {task.workload} {stack.name}: " + (
                f"{task.metric} {row.accuracy:.4f} +- {row.accuracy_std or 0:.4f}, {row.verdict} "
                f"({row.wall_s:.0f} s)" if row.status == "ok" else f"{row.status} ({row.reason})"))


def _measure(task: Task, stack: Stack, trainer: training.Trainer, baseline, full_fine_tune, seeds: int, data: str,
             base: dict, progress: Progress) -> AccuracyRow:
    parts = training.roles(stack)
    values, reference, fidelities = [], [], []
    for seed in range(seeds):
        label = f"accuracy {task.workload} {stack.name} seed {seed}"
        trainer.heartbeat = lambda done, total, per_step, label=label: progress(
            f"{label}: training, step {done}/{total} ({per_step:.1f} s a step)")
        base_model, base_scored = baseline(seed)
        if training.adapts(parts):  # adapters answer "instead of fine-tuning every weight": compare with that
            base_scored = full_fine_tune(seed, parts.step_settings)
        if stack.name == BASELINE:
            scored = base_scored
        else:
            model = trainer.trained(parts.train, seed) if parts.train else base_model
            scored = scoring.score(trainer.deployed(model, parts, seed), task, trainer.budget)
            fidelities.append(scoring.fidelity(base_scored, scored))
        values.append(metric_value(task.kind, scored))
        reference.append(metric_value(task.kind, base_scored))
        progress(f"{label}: {task.metric} {values[-1]:.4f}")
    comparison = (stats.Comparison(0.0, 0.0, "reference") if stack.name == BASELINE
                  else stats.compare(values, reference, task.higher_is_better, _unit(task)))
    if training.adapts(parts):
        comparison = dataclasses.replace(comparison, verdict=f"{comparison.verdict} vs full fine-tuning")
    return AccuracyRow(
        technique=stack.name, status="ok", values=";".join(f"{v:.6g}" for v in values),
        accuracy=statistics.fmean(values), accuracy_std=stats.spread(values), baseline=statistics.fmean(reference),
        delta=comparison.delta, delta_ci95=comparison.ci95, verdict=comparison.verdict,
        agreement=statistics.fmean(f.agreement for f in fidelities) if fidelities else None,
        kl=statistics.fmean(f.kl for f in fidelities) if fidelities else None, data=data,
        notes=_notes(parts, trainer.budget), **base)


def _notes(parts: training.Roles, budget) -> str:
    """How the stack's model was made, where it is not simply trained like the baseline."""
    notes = []
    if training.adapts(parts):
        notes.append(f"{', '.join(t.id for t in parts.fine_tuned)} fine-tuned the trained baseline "
                     f"{budget.fine_tune_steps} steps at {training.ADAPTER_LR_SCALE:g}x the learning rate; compared "
                     f"(baseline column, delta, fidelity) with full fine-tuning of the same model on the same data "
                     f"and steps at {training.FINE_TUNE_LR_SCALE:g}x, under the stack's step settings")
    elif parts.fine_tuned:
        notes.append(f"{', '.join(t.id for t in parts.fine_tuned)} applied to the trained baseline, then fine-tuned "
                     f"{budget.fine_tune_steps} steps at {training.FINE_TUNE_LR_SCALE:g}x the learning rate (the "
                     f"baseline gets no such steps: part of the delta is that extra training)")
    if parts.post:
        notes.append(f"{', '.join(t.id for t in parts.post)} applied to the trained model as deployed")
    return "; ".join(notes)
