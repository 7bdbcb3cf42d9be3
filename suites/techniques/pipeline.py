"""Pipeline parallelism (T13): the model's repeated blocks split into `p` consecutive stages, one per
rank, with the global batch cut into `m` micro-batches that flow through the stages. GPipe runs every
micro-batch forward, then every one backward (m micro-batches' activations held); 1F1B alternates once
the pipeline is full, so the first stage holds at most p. Either way the stages idle for (p - 1) of the
(m + p - 1) slots of a step: the bubble (Narayanan et al. 2021, arXiv:2104.04473, section 2.2).

Projected (harness/project/parallel.py); measuring it under torchrun (torch.distributed.pipelining
needs each workload split into stage modules) is not built yet, and the row says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from suites.techniques.base import Phase, Technique, Unsupported

SCHEDULES = ("1f1b", "gpipe")
# Micro-batches per step when not given: 4 per stage keeps the bubble (p - 1) / (m + p - 1) under 1/5
# at any p (7/39 = 18% at p = 8), the regime Narayanan et al. 2021 (figure 13) run GPT models in.
MICRO_BATCHES_PER_STAGE = 4


@dataclass(frozen=True)
class PipelineOptions:
    """`pipeline-parallel:p=8:m=32:schedule=1f1b`: stages, micro-batches per step, schedule (None: default)."""

    stages: int | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"

    def micro_batches_for(self, stages: int) -> int:
        return self.micro_batches or MICRO_BATCHES_PER_STAGE * stages

    def in_flight(self, stages: int) -> int:
        """Micro-batches whose activations the first stage holds at once."""
        micro = self.micro_batches_for(stages)
        return micro if self.schedule == "gpipe" else min(stages, micro)


def parse_options(options: dict[str, str]) -> PipelineOptions:
    unknown = set(options) - {"p", "m", "schedule"}
    if unknown:
        raise ValueError(f"pipeline-parallel takes options p (stages), m (micro-batches per step) and schedule "
                         f"({'/'.join(SCHEDULES)}), not {', '.join(sorted(unknown))}")
    numbers = {}
    for key in ("p", "m"):
        if key in options:
            try:
                numbers[key] = int(options[key])
            except ValueError:
                raise ValueError(f"pipeline-parallel: {key} must be a whole number, got {options[key]!r}") from None
            if numbers[key] < 1:
                raise ValueError(f"pipeline-parallel: {key} must be at least 1, got {numbers[key]}")
    schedule = options.get("schedule", "1f1b").lower()
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline-parallel: schedule is one of {', '.join(SCHEDULES)}, got {options['schedule']!r}")
    return PipelineOptions(numbers.get("p"), numbers.get("m"), schedule)


def canonical_name(options: PipelineOptions) -> str:
    parts = ["pipeline-parallel"]
    if options.stages:
        parts.append(f"p={options.stages}")
    if options.micro_batches:
        parts.append(f"m={options.micro_batches}")
    if options.schedule != "1f1b":
        parts.append(f"schedule={options.schedule}")
    return ":".join(parts)


def _check(profile, workload, mode):
    if mode != "train":
        return "pipeline parallelism is set up for training steps here (a served model is projected per GPU)"
    if workload.traits.depth_key is None:
        return f"pipeline-parallel splits a stack of identical blocks into stages; {workload.name} declares none"
    return None


def _apply(run) -> None:
    raise Unsupported("measuring pipeline parallelism is not built yet (torch.distributed.pipelining needs each "
                      "workload split into stage modules); headroom project projects it: --pp N")


def _technique(options: PipelineOptions) -> Technique:
    base = Technique(
        id=canonical_name(options), phase=Phase.PARALLEL, changes_numerics=False, guide="T13",
        exclusive="pipeline-parallel", order=1,
        summary="consecutive blocks per rank, micro-batches flowing through the stages (GPipe or 1F1B)",
        check=_check, apply=_apply)
    return replace(base, configure=lambda given: _technique(parse_options(given)))


def options_of(technique: Technique) -> PipelineOptions:
    """The options a (configured) pipeline-parallel technique carries."""
    given = dict(item.partition("=")[::2] for item in technique.id.split(":")[1:])
    return parse_options(given)


PIPELINE_PARALLEL = _technique(PipelineOptions())

TECHNIQUES = (PIPELINE_PARALLEL,)
