"""A served decoder over t GPUs of a node with tensor parallelism (Megatron's layout, as gpt-fast and vLLM serve
a model too large or too slow for one GPU): each rank holds 1/t of every attention and MLP module (whole heads
and neurons, so 1/t of the KV cache too) and of the vocabulary, so a step reads 1/t of the bytes; after each
row-parallel output (the attention's and the MLP's: two per block) and the vocabulary-parallel embedding the
ranks all-reduce a [batch, tokens, d] activation, and the head's logits are all-gathered for sampling.

One rank's part is traced (harness/project/tensor_parallel.rank_part, as for training) and its generation
projected as any served cell's; each phase then adds its collectives, which nothing overlaps (each layer waits
for its all-reduce). A decode step's carry kilobytes, so their time is NCCL's latency, not the link's
bandwidth (harness/project/communication.ring_latency_s). Checked against gpt-fast's published tensor-parallel
decodes, which no constant here was fitted on: benchmarks/tp_decode_validation.py.
"""

from __future__ import annotations

import dataclasses

from harness.cell import ResolvedCell
from harness.project.communication import DEFAULT_NODE_GPUS, link_bytes_s, ring_latency_s
from harness.project.layout import base_name
from harness.project.tensor_parallel import rank_part, sharded_model_figures
from suites.techniques import Stack, Unsupported
from suites.techniques.base import Phase
from suites.techniques.parallel import degree

# Bytes per element of the activations the all-reduces carry and of the gathered logits: the weights' dtype
# (a served decoder computes in it), fp32 otherwise.
ELEMENT_BYTES = {"bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True)
class ServedCollectives:
    """What one rank sends per forward of `tokens` tokens per row, and the seconds it takes."""

    all_reduces: int  # per forward: two per block, one for the vocabulary-parallel embedding
    all_reduce_bytes: int  # each one's buffer
    gathered_bytes: int  # the logits all-gathered (each rank's part)
    seconds: float
    link: str

    @property
    def sent_bytes(self) -> float:
        return self.all_reduces * self.all_reduce_bytes + self.gathered_bytes


def tensor_degree(cell: ResolvedCell) -> int:
    """The served cell's tensor-parallel degree; Unsupported where the stack asks for another parallelism, or
    for a group larger than a node (its per-layer collectives would cross the network)."""
    parallel = [t for t in cell.stack.techniques if t.phase in (Phase.PARALLEL, Phase.DATA_PARALLEL)]
    others = sorted({base_name(t) for t in parallel} - {"tensor-parallel"})
    if others:
        raise Unsupported(f"serving is projected with tensor-parallel alone; {', '.join(others)} split training "
                          "steps (a served model is replicated for more requests, not sharded by them): drop them")
    ranks = degree(parallel[0], "t") or cell.cell.world_size
    if ranks != cell.cell.world_size:
        raise Unsupported(f"tensor-parallel:t={ranks} on {cell.cell.world_size} GPUs: a served model's replica is "
                          "its tensor-parallel group; give --tp N alone (N replicas serve N times the requests)")
    node = (cell.profile.interconnect or {}).get("node_gpus") or DEFAULT_NODE_GPUS
    if ranks > node:
        raise Unsupported(f"{ranks}-way tensor parallelism spans nodes of {node} GPUs: its two all-reduces per "
                          f"layer would cross the network at every token; serve with --tp {node} or fewer")
    return ranks


def local_served_cell(cell: ResolvedCell, ranks: int) -> ResolvedCell:
    """The cell one rank serves: its part of the model (logits gathered whole, as sampling needs them) under
    the stack's other techniques, on one GPU."""
    kept = tuple(t for t in cell.stack.techniques if t.phase not in (Phase.PARALLEL, Phase.DATA_PARALLEL))
    stack = Stack((rank_part(ranks, gathered_logits=True),) + kept)
    return dataclasses.replace(cell, stack=stack, unsupported=Stack(kept).check(cell.profile, cell.workload, "infer"),
                               cell=dataclasses.replace(cell.cell, technique=stack.name, world_size=1))


def search_cell(cell: ResolvedCell) -> ResolvedCell:
    """What a search for the largest batch or prompt projects: a served tensor-parallel group's rank (each
    holds as much as the one traced, so what fits it fits the group), else the cell itself."""
    return local_served_cell(cell, tensor_degree(cell)) if cell.mode == "infer" and cell.stack.parallel else cell


def served_collectives(cell: ResolvedCell, ranks: int, precision: str, tokens: int) -> ServedCollectives | None:
    """One rank's collectives for a forward of `tokens` tokens per row of the batch; None where the profile
    gives no link between its GPUs."""
    part = sharded_model_figures(cell.workload, cell.spec, ranks)
    element = ELEMENT_BYTES.get(precision, 4)
    rows = cell.batch_size * tokens
    buffer = rows * part.width * element
    all_reduces = part.sharded + (1 if part.embedding else 0)
    # The last position's logits are sampled: gpt-fast's and torchao's generate.py gather every position's
    # at the prefill (the model returns them all), one per row at a decode step.
    gathered = rows * -(-part.logits_rows // ranks) * element if part.logits_rows else 0
    profile = cell.profile.per_device()
    link, described = link_bytes_s(profile, ranks)
    if link is None:
        return None
    share = (ranks - 1) / ranks
    seconds = all_reduces * (ring_latency_s(profile, ranks, "all_reduce") + 2 * share * buffer / link)
    if gathered:
        seconds += ring_latency_s(profile, ranks, "all_gather") + share * gathered * ranks / link
    return ServedCollectives(all_reduces, buffer, gathered, seconds, described)


def with_collectives(generation, prefill: ServedCollectives, decode: ServedCollectives):
    """The rank's generation with its collectives added to the prefill and to every decode step."""
    return dataclasses.replace(generation, prefill_s=generation.prefill_s + prefill.seconds,
                               decode_first_s=generation.decode_first_s + decode.seconds,
                               decode_last_s=generation.decode_last_s + decode.seconds)


def project_served(cell: ResolvedCell, outcome_of, started: float):
    """The projected outcome of a served decoder over a tensor-parallel group: one rank's memory (every rank
    holds as much), and the generation's times with the collectives each forward waits on. `outcome_of` is the
    package's outcome assembly (harness/project/__init__.py), passed in as it builds on this module."""
    from harness.project import project  # the package builds on this module

    if cell.spec.gen_len is None:
        raise Unsupported(f"tensor-parallel serving is projected for generating decoders; {cell.workload.name} "
                          "one-pass inference over several GPUs is not (project it on one GPU)")
    ranks = tensor_degree(cell)
    local = local_served_cell(cell, ranks)
    if local.unsupported:
        raise Unsupported(local.unsupported)
    projection = project(local)
    generation, precision = projection.generation, projection.trace.precision
    notes = projection.memory.notes
    if generation is not None:
        prefill = served_collectives(local, ranks, precision, cell.spec.seq_len or 1)
        decode = served_collectives(local, ranks, precision, 1)
        if prefill is None or decode is None:
            notes.append(f"no step time: no link between {cell.profile.id}'s GPUs is known "
                         "(interconnect.gpu_link_gb_s)")
            projection = dataclasses.replace(projection, time=None, generation=None)
        else:
            generation = with_collectives(generation, prefill, decode)
            projection = dataclasses.replace(projection, time=generation.as_step(), generation=generation)
            notes.append(
                f"{ranks}-way tensor-parallel serving: each rank reads 1/{ranks} of the weights and KV cache; every "
                f"forward waits on {decode.all_reduces} all-reduces (two per block, one for the embedding) and the "
                f"logits' all-gather over {decode.link}: {decode.seconds * 1e3:.3f} ms per decode step "
                f"({decode.seconds / generation.decode_mean_s:.0%} of it), {prefill.seconds * 1e3:.3f} ms in the "
                "prefill, at NCCL's latency model (not fitted; benchmarks/tp_decode_validation.py judges it on "
                "gpt-fast's published decodes)")
    outcome = outcome_of(local, projection, started, served_by=(
        "tensor-parallel serving's collectives are costed at NCCL's latency model, never fitted "
        "(benchmarks/tp_decode_validation.py gives its error on published decodes)"))
    if generation is not None and projection.generation is not None:
        per_generation = prefill.sent_bytes + (cell.spec.gen_len - 1) * decode.sent_bytes
        outcome = dataclasses.replace(outcome, comm_bytes_per_step=round(per_generation))
    return outcome
