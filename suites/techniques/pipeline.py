"""Pipeline parallelism (T13): the model's repeated blocks split into `p` consecutive stages, one per
rank, with the global batch cut into `m` micro-batches that flow through the stages. GPipe runs every
micro-batch forward, then every one backward (m micro-batches' activations held); 1F1B alternates once
the pipeline is full, so the first stage holds at most p. Either way the stages idle for (p - 1) of the
(m + p - 1) slots of a step: the bubble (Narayanan et al. 2021, arXiv:2104.04473, section 2.2).

Measured under torchrun with torch.distributed.pipelining (one stage per rank, the workload cut by its
`Pipelining` hook) and projected (harness/project/parallel.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from suites.techniques.base import Phase, Run, Technique, Unsupported

SCHEDULES = ("1f1b", "gpipe")
# Micro-batches per step when not given: 4 per stage keeps the bubble (p - 1) / (m + p - 1) under 1/5
# at any p (7/39 = 18% at p = 8), the regime Narayanan et al. 2021 (figure 13) run GPT models in; fewer
# where the batch does not divide into that many.
MICRO_BATCHES_PER_STAGE = 4


@dataclass(frozen=True)
class PipelineOptions:
    """`pipeline-parallel:p=8:m=32:schedule=1f1b`: stages, micro-batches per step, schedule (None: default)."""

    stages: int | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"

    def micro_batches_for(self, stages: int, batch: int | None = None) -> int:
        """The micro-batches per step: as given, else MICRO_BATCHES_PER_STAGE per stage, or the most up to
        that which divide `batch` evenly."""
        if self.micro_batches:
            return self.micro_batches
        most = MICRO_BATCHES_PER_STAGE * stages
        if batch is None:
            return most
        return max(m for m in range(1, min(most, batch) + 1) if batch % m == 0)

    def in_flight(self, stages: int, batch: int | None = None) -> int:
        """Micro-batches whose activations the first stage holds at once."""
        micro = self.micro_batches_for(stages, batch)
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


class PipelineRunner:
    """One rank's stage and its schedule: a training step is one `schedule.step` over the micro-batches
    (the first stage feeds the inputs, the last computes the loss), then the gradients of what the first
    and last stages both hold are summed."""

    def __init__(self, run: Run, index: int, stages: int, options: PipelineOptions, tied_group, group=None,
                 pipelines: int = 1):
        self.run, self.index, self.stages, self.options = run, index, stages, options
        self.micro_batches = options.micro_batches_for(stages, run.batch_size // pipelines)
        self.tied_group, self.group, self.pipelines = tied_group, group, pipelines
        self.schedule = None

    def _build(self, device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        pipelining, micro = self.run.workload.pipelining, self.micro_batches
        stage = PipelineStage(self.run.model, self.index, self.stages, device, group=self.group)
        kind = ScheduleGPipe if self.options.schedule == "gpipe" else Schedule1F1B
        options = {}
        if "scale_grads" in inspect.signature(kind.__init__).parameters:
            options["scale_grads"] = False  # the loss below is already the mean over micro-batches
        return kind(stage, n_microbatches=micro, loss_fn=lambda out, target: pipelining.loss(out, target) / micro,
                    **options)

    def step(self, batch: dict, device: torch.device, autocast) -> torch.Tensor:
        """One step's forward and backward over every micro-batch; the loss on the last stage, 0 elsewhere."""
        if self.schedule is None:
            self.schedule = self._build(device)
        pipelining, losses = self.run.workload.pipelining, []
        # The last stage would otherwise keep every micro-batch's output to merge them: only losses are used.
        quiet = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters \
            else {}
        with autocast:
            if self.index == 0:
                self.schedule.step(batch[pipelining.inputs], **quiet)
            elif self.index == self.stages - 1:
                self.schedule.step(target=batch[pipelining.target], losses=losses, **quiet)
            else:
                self.schedule.step(**quiet)
        tied = self.run.model.tied_parameters() if hasattr(self.run.model, "tied_parameters") else []
        if self.tied_group is not None and tied:
            import torch.distributed as dist

            for parameter in tied:
                # Sharded by FSDP, each pipeline's first and last stage hold the same shard: sum those.
                grad = parameter.grad
                if hasattr(grad, "placements") and grad.placements != parameter.placements:
                    # A vocabulary-parallel embedding's gradient comes back whole (replicated): its rows only.
                    grad = parameter.grad = grad.redistribute(parameter.device_mesh, parameter.placements)
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.tied_group)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)


def _tensor_parallel(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _apply(run: Run, options: PipelineOptions) -> None:
    from suites.techniques.parallel import distributed, rank_device
    from suites.techniques.tensor_parallel import norm_gradient_bytes

    dist = distributed()
    world, pipelining = dist.get_world_size(), run.workload.pipelining
    # Tensor parallelism, applied first, left a (groups, tp) mesh: each stage is then a tensor-parallel group.
    tensor = run.mesh["tp"].size() if run.mesh is not None and "tp" in (run.mesh.mesh_dim_names or ()) else 1
    stages = options.stages or world // tensor
    if pipelining is None:
        raise Unsupported(f"{run.workload.name} does not say how to cut it into stages (Workload.pipelining)")
    if tensor == 1 and _tensor_parallel(run.model):
        raise Unsupported("tensor-parallel took every rank, leaving none for other stages: give both degrees, "
                          "tensor-parallel:t=T+pipeline-parallel:p=P with T x P the world size")
    if tensor > 1 and stages * tensor > world:
        raise Unsupported(f"{stages} stages of {tensor} tensor-parallel ranks need {stages * tensor} ranks, "
                          f"not {world}")
    if tensor > 1 and world % (stages * tensor):
        raise Unsupported(f"{stages} stages of {tensor} tensor-parallel ranks do not divide {world} ranks into "
                          "pipelines side by side")
    if world % stages:
        raise Unsupported(f"{world} ranks do not split into pipelines of {stages} stages")
    # Side by side, each on its data-parallel slice (a sharding technique splits it); a stage's
    # tensor-parallel ranks all take the pipeline's batch.
    pipelines = world // stages // tensor
    if run.batch_size % pipelines:
        raise Unsupported(f"the global batch {run.batch_size} does not split over {pipelines} pipelines")
    batch = run.batch_size // pipelines
    micro = options.micro_batches_for(stages, batch)
    if batch % micro:
        raise Unsupported(f"a pipeline's batch {batch} does not split into {micro} micro-batches: give a multiple of "
                          f"{micro} or pipeline-parallel:m=N")
    if options.schedule == "1f1b" and micro < stages:
        raise Unsupported(f"1F1B needs at least as many micro-batches as stages ({micro} < {stages}): give a batch of "
                          f"{stages * pipelines} or more, pipeline-parallel:m=N, or schedule=gpipe")
    if run.micro_batches > 1:
        raise Unsupported("the pipeline's micro-batches already accumulate gradients: drop grad-accumulation "
                          "(pipeline-parallel:m=N sets their number)")
    group, line = None, 0
    index = dist.get_rank()
    if tensor > 1:
        # Stage-major over the tensor-parallel ranks: a stage's group is the outer dimension's (`pp` of the
        # 3-D mesh tensor parallelism built for the declared stages; `dp` of its 2-D one, all stages there).
        outer = run.mesh["pp" if run.mesh.ndim == 3 else "dp"]
        group, index = outer.get_group(), outer.get_local_rank()
        line = run.mesh["tp"].get_local_rank() + (run.mesh["dp"].get_local_rank() * tensor if run.mesh.ndim == 3
                                                  else 0)
    elif pipelines > 1:
        from torch.distributed.device_mesh import init_device_mesh

        # Stage-major: the ranks of one stage (one per pipeline) are consecutive, the data-parallel
        # dimension a sharding technique then uses.
        run.mesh = init_device_mesh(rank_device(run).type, (stages, pipelines), mesh_dim_names=("pp", "dp"))
        group, index = run.mesh["pp"].get_group(), run.mesh["pp"].get_local_rank()
        line = run.mesh["dp"].get_local_rank()
    try:
        run.model = pipelining.stage(run.model, index, stages)
        if not run.placed:  # tensor parallelism placed its shards (moving them again would drop their hooks)
            run.model = run.model.to(rank_device(run))
    except ValueError as error:
        raise Unsupported(str(error)) from None
    run.placed = True
    # Each pipeline's first and last stage sum a tied embedding's gradients; every rank calls new_group for
    # every such pair, even those outside it (torch.distributed's rule).
    inner = pipelines * tensor  # the ranks of one stage, consecutive
    tied = [dist.new_group([j, (stages - 1) * inner + j]) for j in range(inner)] if stages > 1 else []
    run.pipeline = PipelineRunner(run, index, stages, options, tied[line] if tied and index in (0, stages - 1)
                                  else None, group, pipelines)
    # Activations go on to the next stage, their gradients back to the previous one (the fp32 residual stream;
    # under sequence parallelism each tensor-parallel rank's part of the sequence).
    sequence = tensor if run.sequence_parallel else 1
    activation = batch * (run.size.seq_len or 0) * run.size.config.get("n_embd", 0) * 4 // sequence
    # Tensor parallelism counted its all-reduces for every block on a 1/stages slice of the batch: a stage
    # holds 1/stages of the blocks on the whole batch, the same bytes.
    # The first and last stages also all-reduce the tied weight's gradient between them (2 (n - 1) / n of it on
    # n = 2 ranks: its bytes), sharded over the pipelines by the data-parallel technique they need.
    tied_bytes = stage_tied_bytes(run.model) if stages > 1 else 0
    # Sequence parallelism's two gathers at the sequence's ends happen on the first stage (the entry's
    # gradient) and the last (the final norm's output) only, on the pipeline's batch; tensor parallelism
    # counted both on a 1/stages slice of it.
    ends = (index == 0) + (index == stages - 1)
    whole = (tensor - 1) / tensor * activation * sequence  # one gather of the pipeline's stream
    moved = whole * (ends - 2 / stages) if run.sequence_parallel and tensor > 1 else 0
    # Its vocabulary-parallel embedding (first stage) and head (last) likewise send on the pipeline's batch what
    # tensor parallelism counted on a 1/stages slice of it at every stage.
    embedding, head = run.vocabulary_comm
    vocabulary = embedding * (stages * (index == 0) - 1) + head * (stages * (index == stages - 1) - 1)
    # Sequence parallelism all-reduced the whole model's norm gradients once per backward: a stage holds its
    # own norms, reduced after each micro-batch's backward.
    norms = int(2 * (tensor - 1) / tensor * norm_gradient_bytes(run.model) * micro) - run.norm_gradient_comm \
        if run.norm_gradient_comm else 0
    run.comm_bytes_per_step = (run.comm_bytes_per_step or 0) + activation * ((index < stages - 1) + (index > 0)) \
        + tied_bytes // pipelines + int(moved) + vocabulary + norms
    run.notes.append(f"stage {index + 1} of {stages} ({options.schedule.upper()}, {micro} micro-batches of "
                     f"{batch // micro}; torch.distributed.pipelining): its blocks"
                     + (", the embeddings" if index == 0 else "") + (", the head" if index == stages - 1 else "")
                     + (f"; {pipelines} pipelines side by side" if pipelines > 1 else "")
                     + (f"; each stage {tensor} tensor-parallel ranks" if tensor > 1 else ""))


def stage_tied_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this stage shares with another (a tied embedding on a pipeline's end stages)."""
    return sum(local.numel() * local.element_size() for local in
               (p.to_local() if hasattr(p, "to_local") else p for p in getattr(model, "tied_parameters", list)()))


def _declare(run: Run, options: PipelineOptions) -> None:
    """Tell the techniques applied before it how many stages it cuts (tensor parallelism then builds a 3-D
    mesh when pipelines of its groups run side by side)."""
    run.pipeline_stages = options.stages
    run.pipelined = True


def _technique(options: PipelineOptions) -> Technique:
    base = Technique(
        id=canonical_name(options), phase=Phase.PARALLEL, changes_numerics=False, guide="T13",
        exclusive="pipeline-parallel", order=1,
        summary="consecutive blocks per rank, micro-batches flowing through the stages (GPipe or 1F1B)",
        check=_check, apply=lambda run: _apply(run, options), declare=lambda run: _declare(run, options))
    return replace(base, configure=lambda given: _technique(parse_options(given)))


def options_of(technique: Technique) -> PipelineOptions:
    """The options a (configured) pipeline-parallel technique carries."""
    given = dict(item.partition("=")[::2] for item in technique.id.split(":")[1:])
    return parse_options(given)


PIPELINE_PARALLEL = _technique(PipelineOptions())

TECHNIQUES = (PIPELINE_PARALLEL,)
