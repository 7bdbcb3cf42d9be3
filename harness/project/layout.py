"""How a parallel stack's ranks split the work, for the projection: the layout (data x tensor x pipeline,
or expert-parallel ranks inside pipeline stages) read from the stack's degrees and the world size, and the
cell one rank runs: the stack without its parallel techniques, one tensor-parallel rank's part of the model,
one pipeline stage's blocks, one micro-batch of its data-parallel slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import ResolvedCell
from harness.project.expert_parallel import rank_experts
from harness.project.gathered import gathered_in
from harness.project.tensor_parallel import rank_part
from suites.techniques import Stack, Unsupported
from suites.techniques.base import Phase
from suites.techniques.parallel import degree, option_value
from suites.techniques.pipeline import options_of

DATA_PARALLEL = {"data-parallel", "zero1", "fsdp", "fsdp-zero2", "cpu-offload"}
PROJECTED = DATA_PARALLEL | {"tensor-parallel", "sequence-parallel", "pipeline-parallel", "expert-parallel"}
# Techniques whose weights or optimizer state are not the fp32 weights and AdamW moments that the bf16
# gathers' fp32 restoration assumes (frozen 16-bit or 4-bit bases, low-bit or offloaded moments).
NOT_WITH_GATHERS = {"lora", "qlora", "optim-8bit", "optim-4bit", "optim-offload", "bf16-weights", "fp16-weights"}


@dataclass(frozen=True)
class Layout:
    """How the ranks split the work: `tp` tensor-parallel ranks inside each of `dp` data-parallel (or
    sharded) groups, inside each of `pp` pipeline stages; `micro_batches` per step, `in_flight` of them
    held at once by the first stage."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    in_flight: int = 1
    schedule: str = "1f1b"
    data_technique: str | None = None
    gather_dtype: str | None = None  # FSDP2's MixedPrecisionPolicy (`fsdp:mp=bf16`): blocks gathered in it
    sequence_parallel: bool = False
    ep: int = 1  # expert-parallel ranks (the same ranks train the rest data-parallel)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = []
        if self.tp > 1:
            parts.append(f"{self.tp}-way tensor" + (" (sequence parallel)" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"{self.pp}-stage {self.schedule.upper()} pipeline ({self.micro_batches} micro-batches)")
        if self.ep > 1:
            parts.append(f"{self.ep}-way expert")
        if self.data_technique:
            name = self.data_technique + (f" ({self.gather_dtype} gathers)" if self.gather_dtype else "")
            parts.append(f"{self.dp}-way {name}" if self.dp > 1 else f"{name} over 1 rank (nothing to shard)")
        return " x ".join(parts) or "one rank"


def base_name(technique) -> str:
    """A technique's id without its options (`tensor-parallel:t=8` -> `tensor-parallel`)."""
    return technique.id.partition(":")[0]


def layout_of(cell: ResolvedCell) -> Layout:
    """The cell's layout over its world size: degrees the stack names (`tensor-parallel:t=8`,
    `pipeline-parallel:p=4`), the data-parallel degree from the ranks left; a parallel technique without
    a degree takes every rank when it is the stack's only one. Unsupported where they do not add up."""
    parallel = {base_name(t): t for t in cell.stack.techniques if t.phase in (Phase.PARALLEL, Phase.DATA_PARALLEL)}
    unknown = sorted(set(parallel) - PROJECTED)
    if unknown:
        raise Unsupported(f"projecting {', '.join(unknown)} is not implemented yet (data-parallel, sharded, tensor-, "
                          "sequence-, pipeline- and expert-parallel stacks are); measure it with headroom run "
                          "--world-size N")
    world = cell.cell.world_size
    if "expert-parallel" in parallel:
        return _expert_layout(cell, parallel, world)
    data = next((name for name in parallel if name in DATA_PARALLEL), None)
    alone = len(set(parallel) - {"sequence-parallel"}) == 1  # it shards within tensor-parallel groups
    tp = degree(parallel["tensor-parallel"], "t") if "tensor-parallel" in parallel else 1
    pipeline = options_of(parallel["pipeline-parallel"]) if "pipeline-parallel" in parallel else None
    pp = (pipeline.stages if pipeline else 1)
    for name, given, flag in (("tensor-parallel", tp, "--tp"), ("pipeline-parallel", pp, "--pp")):
        if name in parallel and given is None and not alone:
            raise Unsupported(f"{name} combined with other parallelism needs its degree: give {flag} N")
    tp = tp or world
    pp = pp or world
    if world % (tp * pp):
        raise Unsupported(f"{world} GPUs do not split into {tp} tensor-parallel ranks x {pp} pipeline stages")
    dp = world // (tp * pp)
    if dp > 1 and data is None:
        raise Unsupported(f"{world} GPUs leave {dp} data-parallel groups of {tp * pp}, but the stack has no "
                          "data-parallel or sharding technique: add data-parallel, zero1 or fsdp, or give --dp 1")
    micro, in_flight = _schedule(pipeline, pp, dp, cell.batch_size)
    return Layout(dp=dp, tp=tp, pp=pp, micro_batches=micro, in_flight=in_flight,
                  schedule=pipeline.schedule if pipeline else "1f1b", data_technique=data,
                  gather_dtype=option_value(parallel.get(data), "mp"),
                  sequence_parallel="sequence-parallel" in parallel)


def _schedule(pipeline, pp: int, dp: int, batch: int) -> tuple[int, int]:
    """(micro-batches per step, micro-batches the first stage holds in flight) of a `pp`-stage pipeline whose
    batch is split over `dp` data-parallel ranks; (1, 1) without a pipeline."""
    if pipeline is None or pp == 1:
        return 1, 1
    per_pipeline = batch // dp if batch % dp == 0 else None
    micro = pipeline.micro_batches_for(pp, per_pipeline)
    if pipeline.schedule == "1f1b" and micro < pp:
        raise Unsupported(f"1F1B needs at least as many micro-batches as stages ({micro} < {pp}): give a batch of "
                          f"{pp * dp} or more, pipeline-parallel:m=N, or schedule=gpipe")
    return micro, pipeline.in_flight(pp, per_pipeline)


def _expert_layout(cell: ResolvedCell, parallel: dict, world: int) -> Layout:
    """Expert parallelism: e ranks, each with E / e experts, the rest replicated and trained data-parallel
    on each rank's slice of the batch, or sharded over the same ranks by a data-parallel technique
    (`expert-parallel+fsdp`: FSDP shards what is not an expert). With a pipeline, each of its p stages has
    its own e ranks (world = e x p): a stage's MoE layers exchange tokens among the ranks of that stage,
    which are its data-parallel ranks too (as torchtitan's expert parallelism borrows its ranks from data
    parallelism)."""
    others = set(parallel) - {"expert-parallel", "pipeline-parallel"}
    if "tensor-parallel" in others or "sequence-parallel" in others:
        raise Unsupported("expert-parallel combined with tensor-parallel is not projected yet (the experts would "
                          "need tensor parallelism of their own): project expert-parallel with pipeline-parallel "
                          "and a data-parallel technique, or tensor-parallel without expert-parallel")
    if others - DATA_PARALLEL or len(others) > 1:
        raise Unsupported("expert-parallel is projected with pipeline-parallel and one data-parallel or sharding "
                          f"technique over the same ranks; combined with {', '.join(sorted(others))} it is not yet")
    pipeline = options_of(parallel["pipeline-parallel"]) if "pipeline-parallel" in parallel else None
    ep = degree(parallel["expert-parallel"], "e")
    pp = pipeline.stages if pipeline else 1
    if pipeline and (ep is None or pp is None):
        raise Unsupported("expert-parallel combined with pipeline-parallel needs both degrees: give --ep N --pp M")
    ep = ep or world
    if ep * pp != world:
        raise Unsupported(f"expert-parallel:e={ep} on {world} GPUs: the world is the expert-parallel ranks"
                          + (f" of each of the {pp} pipeline stages (give --ep N --pp M for N x M GPUs)" if pipeline
                             else " (give --ep N alone)"))
    data = next(iter(others), None)
    micro, in_flight = _schedule(pipeline, pp, ep, cell.batch_size)
    return Layout(dp=ep, ep=ep, pp=pp, micro_batches=micro, in_flight=in_flight,
                  schedule=pipeline.schedule if pipeline else "1f1b", data_technique=data,
                  gather_dtype=option_value(parallel.get(data), "mp"))


def local_cell(cell: ResolvedCell, layout: Layout) -> ResolvedCell:
    """The cell one rank runs: the stack without its parallel techniques (with one tensor-parallel rank's
    part of the model), one pipeline stage's depth, one micro-batch of its data-parallel slice."""
    if cell.mode != "train":
        raise Unsupported("parallel stacks are projected for training; a served model is projected per GPU")
    slices = layout.dp * layout.micro_batches
    if cell.batch_size % slices:
        raise Unsupported(f"the global batch {cell.batch_size} does not split into {layout.dp} data-parallel ranks x "
                          f"{layout.micro_batches} micro-batches; give a multiple of {slices}")
    kept = tuple(t for t in cell.stack.techniques if t.phase not in (Phase.PARALLEL, Phase.DATA_PARALLEL))
    if layout.gather_dtype:
        blocking = sorted(base_name(t) for t in kept if base_name(t) in NOT_WITH_GATHERS or t.phase == Phase.COMPRESS)
        if blocking:
            raise Unsupported(f"{layout.data_technique}:mp={layout.gather_dtype} is projected over fp32 weights "
                              f"stepped by a full-precision optimizer; with {', '.join(blocking)} it is not yet "
                              f"(measure it, or project {layout.data_technique} without mp)")
    built = tuple(t for t in kept if t.phase <= Phase.COMPRESS)  # the weights as FSDP2 would shard them
    # The logits stay sharded under loss parallelism, as tensor-parallel runs it without a pipeline.
    stack = Stack(((rank_part(layout.tp, gathered_logits=layout.pp > 1),) if layout.tp > 1 else ())
                  + ((rank_experts(layout.ep),) if layout.ep > 1 else ()) + built
                  + ((gathered_in(layout.gather_dtype),) if layout.gather_dtype else ())
                  + tuple(t for t in kept if t not in built))
    spec = cell.spec
    if layout.pp > 1:
        depth = cell.workload.depth(spec)
        if depth is None or depth % layout.pp:
            raise Unsupported(f"{depth} blocks do not split into {layout.pp} equal pipeline stages")
        spec = cell.workload.with_depth(spec, depth // layout.pp)
    local = dataclasses.replace(
        cell, stack=stack, unsupported=Stack(kept).check(cell.profile, cell.workload, cell.mode),
        cell=dataclasses.replace(cell.cell, technique=stack.name, batch_size=cell.batch_size // slices,
                                 world_size=1))
    return local.with_spec(spec)
