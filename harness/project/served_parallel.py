"""A served decoder over t GPUs of a node with tensor parallelism (Megatron's layout, as vLLM serves a model too
large or too slow for one GPU): each rank holds 1/t of every attention and MLP module (whole heads and neurons,
so 1/t of the KV cache too) and of the vocabulary, so a step reads about 1/t of the bytes; after each
row-parallel output (the attention's and the MLP's: two per block) and the vocabulary-parallel embedding the
ranks all-reduce a [batch, tokens, d] activation, and the head's last-position logits are all-gathered for
sampling. gpt-fast keeps the embedding and head whole on every rank instead (`vocabulary=False`): no embedding
all-reduce and no gather, but every rank reads the whole vocabulary's weights.

One rank's part is traced (harness/project/tensor_parallel.rank_part, as for training) and its generation
projected as any served cell's; each phase then adds its collectives, which nothing overlaps (each layer waits
for its all-reduce). A decode step's collectives carry kilobytes, so their time is NCCL's latency, not the link's
bandwidth (harness/project/collective_cost.ring_collective_s). Checked against gpt-fast's published tensor-parallel
decodes, in gpt-fast's layout, which no constant here was fitted on: benchmarks/tp_decode_validation.py.
"""

from __future__ import annotations

import dataclasses

from harness.cell import ResolvedCell
from harness.project.collective_cost import ring_collective_s
from harness.project.communication import link_bytes_s, node_gpus
from harness.project.layout import base_name
from harness.project.tensor_parallel import rank_part, sharded_model_figures
from suites.techniques import Stack, Unsupported
from suites.techniques.base import Phase
from suites.techniques.parallel import degree

# Bytes per element of the activations the all-reduces carry and of the gathered logits: the weights' or
# autocast's 16-bit dtype, fp32 otherwise.
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "bf16-mixed": 2, "fp16-mixed": 2, "fp8-mixed": 2}


@dataclasses.dataclass(frozen=True)
class ServedCollectives:
    """One rank's collectives per forward of `tokens` tokens per row, and the seconds they take."""

    ranks: int
    all_reduces: int  # per forward: two per block, one for a vocabulary-parallel embedding
    all_reduce_bytes: int  # each one's buffer
    gathered_bytes: int  # the logits all-gathered: this rank's part (0: a whole head, nothing gathered)
    seconds: float
    link: str

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends (ring algorithms): 2 (t - 1) / t of each all-reduce's buffer, its part of the
        logits to each of the t - 1 others."""
        share = (self.ranks - 1) / self.ranks
        return self.all_reduces * 2 * share * self.all_reduce_bytes + (self.ranks - 1) * self.gathered_bytes


# The figures of a rank's part per (workload, size entry, ranks, vocabulary layout): building a 70B model on the
# meta device takes about a second, and a projection asks for them at resolve time and again for each phase.
_PARTS: dict[tuple, tuple[int, int, bool, int]] = {}


def rank_part_figures(workload, spec, ranks: int, vocabulary: bool = True) -> tuple[int, int, bool, int]:
    """(modules sharded, activation width, embedding vocabulary-parallel, head vocabulary) of one rank's part
    (harness/project/tensor_parallel.sharded_model_figures, remembered); Unsupported where it does not split."""
    key = (workload.name, repr(spec), ranks, vocabulary)
    if key not in _PARTS:
        part = sharded_model_figures(workload, spec, ranks, vocabulary)
        _PARTS[key] = (part.sharded, part.width, part.embedding, part.logits_rows)
    return _PARTS[key]


def tensor_degree(cell: ResolvedCell) -> int:
    """The served cell's tensor-parallel degree; Unsupported where the stack asks for another parallelism, or
    for a group larger than a node (its per-layer collectives would cross the network)."""
    parallel = [t for t in cell.stack.techniques if t.phase in (Phase.PARALLEL, Phase.DATA_PARALLEL)]
    others = sorted({base_name(t) for t in parallel} - {"tensor-parallel"})
    if "sequence-parallel" in others:
        raise Unsupported("sequence-parallel shards a training step's norms and dropout along the sequence; a served "
                          "decoder's step is one token: drop it (tensor-parallel alone)")
    if others:
        raise Unsupported(f"serving is projected with tensor-parallel alone; {', '.join(others)} split training "
                          "steps (a served model is replicated for more requests, not sharded by them): drop them")
    ranks = degree(parallel[0], "t") or cell.cell.world_size
    if ranks != cell.cell.world_size:
        raise Unsupported(f"tensor-parallel:t={ranks} on {cell.cell.world_size} GPUs: a served model's replica is "
                          "its tensor-parallel group; give --tp N alone (N replicas serve N times the requests)")
    node = node_gpus(cell.profile)
    if ranks > node:
        raise Unsupported(f"{ranks}-way tensor parallelism spans nodes of {node} GPUs: its two all-reduces per "
                          f"layer would cross the network at every token; serve with --tp {node} or fewer")
    return ranks


def local_served_cell(cell: ResolvedCell, ranks: int, vocabulary: bool = True) -> ResolvedCell:
    """The cell one rank serves: its part of the model (logits gathered whole, as sampling needs them; the
    embedding and head whole without `vocabulary`) under the stack's other techniques, on one GPU."""
    kept = tuple(t for t in cell.stack.techniques if t.phase not in (Phase.PARALLEL, Phase.DATA_PARALLEL))
    stack = Stack((rank_part(ranks, gathered_logits=True, vocabulary=vocabulary),) + kept)
    return dataclasses.replace(cell, stack=stack, unsupported=Stack(kept).check(cell.profile, cell.workload, "infer"),
                               cell=dataclasses.replace(cell.cell, technique=stack.name, world_size=1))


def served_verdict(cell: ResolvedCell) -> str | None:
    """Why a served tensor-parallel cell cannot be projected (None: it can): what the rank's stack and the
    group's layout allow, in place of the tensor-parallel technique's own check, which refuses the measured kind
    (not built)."""
    if cell.spec.gen_len is None:
        return (f"tensor-parallel serving is projected for generating decoders; {cell.workload.name}'s one-pass "
                "inference over several GPUs is not (project it on one GPU)")
    if cell.spec.config.get("n_experts"):
        return (f"{cell.spec.name}'s experts are not sharded by tensor-parallel here (each rank would hold every "
                "expert whole); serve it on one GPU with quantised weights")
    try:
        ranks = tensor_degree(cell)
        rank_part_figures(cell.workload, cell.spec, ranks)  # Unsupported where heads or neurons do not split
        return local_served_cell(cell, ranks).unsupported
    except Unsupported as exc:
        return str(exc)


def search_cell(cell: ResolvedCell) -> ResolvedCell:
    """What a search for the largest batch or prompt projects: a served tensor-parallel group's rank (each
    holds as much as the one traced, so what fits it fits the group), else the cell itself."""
    return local_served_cell(cell, tensor_degree(cell)) if cell.mode == "infer" and cell.stack.parallel else cell


def served_collectives(cell: ResolvedCell, ranks: int, precision: str, tokens: int,
                       vocabulary: bool = True) -> ServedCollectives | None:
    """One rank's collectives for a forward of `tokens` tokens per row of the batch (the embedding and head
    whole without `vocabulary`); None where the profile gives no link between its GPUs."""
    sharded, width, embedding, logits_rows = rank_part_figures(cell.workload, cell.spec, ranks, vocabulary)
    element = ELEMENT_BYTES.get(precision, 4)
    buffer = cell.batch_size * tokens * width * element
    all_reduces = sharded + (1 if embedding else 0)
    # Only the last position's logits are computed and sampled (the served forward's last_only), each row's.
    gathered = cell.batch_size * -(-logits_rows // ranks) * element if logits_rows else 0
    profile = cell.profile.per_device()
    link, described = link_bytes_s(profile, ranks)
    if link is None:
        return None
    share = (ranks - 1) / ranks
    seconds = all_reduces * ring_collective_s(profile, ranks, "all_reduce", 2 * share * buffer, link)
    if gathered:
        seconds += ring_collective_s(profile, ranks, "all_gather", share * gathered * ranks, link)
    return ServedCollectives(ranks, all_reduces, buffer, gathered, seconds, described)


def with_collectives(generation, prefill: ServedCollectives, decode: ServedCollectives):
    """The rank's generation with its collectives added to the prefill and to every decode step."""
    return dataclasses.replace(generation, prefill_s=generation.prefill_s + prefill.seconds,
                               decode_first_s=generation.decode_first_s + decode.seconds,
                               decode_last_s=generation.decode_last_s + decode.seconds)


def project_served(cell: ResolvedCell, outcome_of, started: float, vocabulary: bool = True):
    """The projected outcome of a served decoder over a tensor-parallel group: one rank's memory (every rank
    holds as much), and the generation's times with the collectives each forward waits on (the embedding and
    head whole on every rank without `vocabulary`, as gpt-fast serves). `outcome_of` is the package's outcome
    assembly (harness/project/__init__.py), passed in as it builds on this module."""
    from harness.project import project  # the package builds on this module

    verdict = served_verdict(cell)
    if verdict:
        raise Unsupported(verdict)
    ranks = tensor_degree(cell)
    local = local_served_cell(cell, ranks, vocabulary)
    projection = project(local)
    generation, precision = projection.generation, projection.trace.precision
    notes = projection.memory.notes
    if generation is not None:
        prefill = served_collectives(local, ranks, precision, cell.spec.seq_len or 1, vocabulary)
        decode = served_collectives(local, ranks, precision, 1, vocabulary)
        if prefill is None or decode is None:
            notes.append(f"no step time: no link between {cell.profile.id}'s GPUs is known "
                         "(interconnect.gpu_link_gb_s or host_link_gb_s)")
            projection = dataclasses.replace(projection, time=None, generation=None)
        else:
            generation = with_collectives(generation, prefill, decode)
            projection = dataclasses.replace(projection, time=generation.as_step(), generation=generation)
            waits = (f"{decode.all_reduces} all-reduces" + (" and the logits' all-gather" if decode.gathered_bytes
                                                             else ""))
            notes.append(
                f"{ranks}-way tensor-parallel serving: each rank holds 1/{ranks} of the attention and MLP weights"
                + (" and of the vocabulary" if vocabulary else "") + f" and of the KV cache; every forward waits on "
                f"{waits} over {decode.link}: {decode.seconds * 1e3:.3f} ms per decode step "
                f"({decode.seconds / generation.decode_mean_s:.0%} of it), {prefill.seconds * 1e3:.3f} ms in the "
                "prefill, at NCCL's latency model (not fitted; benchmarks/tp_decode_validation.py judges it on "
                "gpt-fast's published decodes)")
            if not projection.trace.compiled:
                notes.append("eager: the host's cost of issuing each collective (and waiting on it) is not counted; "
                             "servers replay a compiled step as CUDA graphs (+compile)")
    outcome = outcome_of(local, projection, started, served_by=(
        "tensor-parallel serving's collectives are costed at NCCL's latency model, never fitted "
        "(benchmarks/tp_decode_validation.py gives its error on published decodes)"))
    if generation is not None and projection.generation is not None:
        per_generation = prefill.sent_bytes + (cell.spec.gen_len - 1) * decode.sent_bytes
        outcome = dataclasses.replace(outcome, comm_bytes_per_step=round(per_generation))
    return outcome
