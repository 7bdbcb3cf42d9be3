"""Projection of parallel stacks to N GPUs (3D: data x tensor x pipeline), from the trace of one rank's part.

One rank runs the single-device stack on its part of the model and its slice of the batch (the layout and
that cell: harness/project/layout.py), so the projection traces that (the same trace and allocator model as
any cell) and then moves what the parallel techniques move:
- tensor parallelism over t ranks: the rank's part of each attention and MLP module, and its rows of the
  vocabulary-parallel embedding and head (their logits sharded for loss parallelism, gathered whole only
  under a pipeline), is what is traced
  (harness/project/tensor_parallel.py), so its parameters, activations and matmuls are 1/t where sharded;
- pipeline parallelism over p stages: one stage of depth L/p is traced at the micro-batch size, and the
  first stage holds the activations of every micro-batch in flight (all m under GPipe, p under 1F1B);
- data parallelism and sharding over d ranks (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054):
  `data-parallel` (DDP) keeps a full replica and adds flat gradient buckets the size of the gradients
  (DDP's default `gradient_as_bucket_view=False`, PyTorch DDP notes); `zero1` keeps 1/d of the optimizer
  state; `fsdp` (ZeRO-3) keeps 1/d of parameters, gradients and optimizer state, plus the blocks gathered
  at a time (the running block and the prefetched next one, with one block's unsharded gradients);
  `fsdp-zero2` keeps the parameters gathered from forward to backward; `cpu-offload` holds FSDP's shards
  in host memory (host_bytes) and only gathered blocks on the device.
- expert parallelism over e ranks: the rank's E / e experts are traced on every rank's tokens for them
  (harness/project/expert_parallel.py), the rest replicated or sharded by a data-parallel technique; with
  a pipeline, each stage's data-parallel ranks are its expert-parallel ones.
The step adds the communication the schedule cannot hide and the pipeline's bubble
(harness/project/parallel_step.py, over communication.py's links and volumes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import ResolvedCell
from harness.outcome import MemoryFigures, Outcome, failure
from harness.project.communication import (
    SHARDED,
    collective_bytes,
    data_parallel_collectives,
    node_gpus,
    norm_gradient_bytes_sent,
    pipeline_bytes,
    tensor_parallel_bytes,
    tensor_parallel_collectives,
    vocabulary_parallel_bytes,
)
from harness.project.expert_parallel import all_to_all_bytes, expert_figures
from harness.project.layout import Layout, base_name, layout_of, local_cell
from harness.project.parallel_step import parallel_step
from harness.project.tensor_parallel import sharded_model_figures
from harness.project.trace import BACKWARD_PHASES
from suites.techniques import Stack, Unsupported
from suites.techniques.expert import moe_layers
from suites.techniques.parallel import GATHER_DTYPES
from suites.techniques.tensor_parallel import norm_gradient_bytes

# Blocks whose parameters FSDP2 holds unsharded at once: the one computing and the one prefetched.
GATHERED_BLOCKS = 2
# Bytes per element of what a layer outputs (autocast's dtype, else the weights'): the row-parallel outputs
# tensor parallelism all-reduces, the experts' outputs expert parallelism sends back.
ACTIVATION_BYTES = {"bf16-mixed": 2, "fp16-mixed": 2, "fp8-mixed": 2, "bf16": 2, "fp16": 2}
# ... and of the residual stream, which stays in the weights' dtype under autocast (fp32 embeddings plus
# 16-bit block outputs): what a pipeline stage sends on, and the gradients of the norms' fp32 outputs that
# tensor parallelism all-reduces backward.
STREAM_BYTES = {"bf16": 2, "fp16": 2}
# FSDP2's MixedPrecisionPolicy: blocks gathered in a 16-bit dtype (GATHER_DTYPES) over fp32 master shards.
MASTER_BYTES = 4
STATES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class RankMemory:
    """Per-rank bytes of a sharded stack: its model states, its peak, and what it keeps in host memory."""

    params: int
    grads: int
    optimizer: int
    peak: int  # live bytes at the step's peak, as the trace counts them (before workspaces)
    host: int | None = None
    phase: str = ""  # the trace's phase in which the rank peaks
    temporaries: int = 0  # ... and the temporaries live there, as the rank holds them (the optimizer's sharded)


def rank_memory(technique: str | None, dp: int, phase_at_peak: dict[str, dict[str, int]],
                states: tuple[int, int, int], block_params: int, block_grads: int, in_flight: int = 0,
                unsharded: tuple[int, int, int] = (0, 0, 0), gathered_share: float = 1.0,
                scheduled: tuple[str, ...] = (), buffers: int = 0, root_params: int = 0,
                root_grads: int = 0) -> RankMemory:
    """Per-rank memory under the data-parallel `technique` (None: none) on `dp` ranks, from one rank's
    unsharded trace: each phase's peak with its parameters, gradients and optimizer state kept as the
    technique keeps them, what it adds (DDP's buckets, FSDP's gathered blocks), the optimizer step's
    temporaries shrunk with its shard, and `in_flight` bytes of other micro-batches' activations held
    through the forward and backward (a pipeline's first stage). `unsharded` are the parameter, gradient
    and optimizer bytes no data-parallel rank shares (an expert-parallel rank's own experts), kept whole.
    `gathered_share`: the gathered parameters' bytes per byte of the stored ones (1/2 for bf16 gathers of fp32
    shards), which is what `fsdp-zero2` keeps whole from the forward to the backward, beside its shard.

    `scheduled`: the phases in which the rank, a stage of a pipeline schedule over several micro-batches,
    runs after a micro-batch's backward (every backward but the first; under 1F1B with more micro-batches
    than in flight, the steady state's forwards too). Its gradients then exist whole (accumulated over the
    micro-batches, reduced after the last), and torch.distributed.pipelining keeps FSDP's parameters gathered
    beside their shard and its gradients unsharded until then (`backward_maybe_with_nosync`:
    reshard_after_backward and gradient sync off). `buffers`: the stage's receive buffers, allocated for
    every micro-batch when the schedule starts and kept (pipelining's `_prepare_forward/backward_infra`).

    The backward comes in phases (trace.BACKWARD_PHASES): the loss and the head, then the repeated blocks'.
    FSDP2 keeps the root module's parameters (`root_params` gathered bytes: embeddings, final norm, head)
    gathered from the forward to the end of the backward (`fully_shard(model, reshard_after_forward=False)`,
    its default for the root) and their gradients (`root_grads`) whole until the backward ends; its first
    backward hook prefetches the last block, and each block's backward gathers the next one."""
    params, grads, optimizer = states
    own = dict(zip(("params", "grads", "optimizer"), unsharded, strict=True))

    def shard(size: int, category: str = "") -> int:
        mine = own.get(category, 0)
        return -(-(size - mine) // dp) + mine

    # Between steps (the row's params/grads/optimizer columns, as FSDP2's sharded storage holds them).
    sharded = (shard(params, "params"), shard(grads, "grads"), shard(optimizer, "optimizer"))
    kept = {None: (params, grads, optimizer), "data-parallel": (params, grads, optimizer),
            "zero1": (params, grads, sharded[2]), "fsdp-zero2": sharded, "fsdp": sharded,
            "cpu-offload": (0, 0, 0)}[technique]
    buckets = grads if technique in ("data-parallel", "zero1") else 0  # DDP's flat gradient buckets
    blocks_backward = BACKWARD_PHASES[1:]  # a block's backward running: the first, the middle or the last one
    gathered = {"forward": GATHERED_BLOCKS * block_params + root_params,
                "backward": (GATHERED_BLOCKS - 1) * block_params + root_params,
                **dict.fromkeys(blocks_backward, GATHERED_BLOCKS * block_params + block_grads + root_params)}
    if technique in (None, "data-parallel", "zero1"):
        gathered = {}  # replicas: nothing to gather
    elif technique == "fsdp-zero2":
        # Parameters gathered in the forward stay whole until the backward is done: by the forward's end
        # every block's are (counted as the whole parameters below); a block's gradients before scattering.
        gathered = dict.fromkeys(blocks_backward, block_grads)
    sharded_step = technique not in (None, "data-parallel")
    sharded_whole = technique in ("fsdp", "fsdp-zero2", "cpu-offload")
    if sharded_whole:
        # Gathered once and kept: counted as whole parameters below.
        gathered = {phase: size for phase, size in gathered.items() if _kind(phase) not in scheduled}

    def scaled(at: dict[str, int], category: str, whole: int, keep: int) -> float:
        return at.get(category, 0) * (keep / whole if whole else 1.0)

    # Parameters kept gathered (in the gathered dtype) beside their shard: ZeRO-2 from the forward's end
    # through the backward, a pipeline stage from its first backward on.
    peaks = []
    for phase, at in phase_at_peak.items():
        kind = _kind(phase)
        whole = technique == "fsdp-zero2" and kind in ("forward", "backward") or sharded_whole and kind in scheduled
        if whole:
            kept_params = round(params * gathered_share) + kept[0]
        else:
            kept_params = kept[0]
        temporaries = at.get("temporaries", 0)
        if phase == "optimizer" and sharded_step:
            temporaries = 0 if technique == "cpu-offload" else shard(temporaries)  # the step runs on the shard
        held = in_flight if kind in ("forward", "backward") else 0
        if kind in scheduled:
            grads_now = grads  # unsharded till the end
        elif sharded_whole and kind == "backward":
            # The root's gradients (the first the backward makes) stay whole, in the gathered dtype, until it ends.
            root = min(root_grads, at.get("grads", 0))
            grads_now = root * gathered_share + (at.get("grads", 0) - root) * (kept[1] / grads if grads else 1.0)
        else:
            grads_now = scaled(at, "grads", grads, kept[1])
        peaks.append((scaled(at, "params", params, kept_params) + grads_now
                      + scaled(at, "optimizer", optimizer, kept[2]) + at.get("activations", 0) + held + temporaries
                      + buckets + gathered.get(phase, 0) + buffers, phase, temporaries))
    host = sum(sharded) if technique == "cpu-offload" else None
    peak, phase, temporaries = max(peaks)
    return RankMemory(*kept, peak=round(peak), host=host, phase=phase, temporaries=round(temporaries))


def _cast_cache_note(layout: Layout, trace, params: int) -> str:
    """Under autocast, FSDP2 gathering fp32 blocks leaves autocast a 16-bit cast of every gathered weight to
    cache until the forward ends (its cache keeps casts of leaf parameters that require grad), so each rank
    holds up to the whole model in 16 bits; `mp=bf16` gathers in bf16 and autocast has nothing to cast."""
    if layout.data_technique not in ("fsdp", "fsdp-zero2", "cpu-offload") or layout.gather_dtype \
            or trace.precision not in ("bf16-mixed", "fp16-mixed"):
        return ""
    return (f"; autocast caches its 16-bit cast of every gathered fp32 weight until the forward ends (up to "
            f"{params / 2 / 2**30:,.1f} GiB per rank by the forward's end): {layout.data_technique}:mp=bf16 gathers "
            "in bf16 and caches none")


def _kind(phase: str) -> str:
    """A trace's memory phase as a step phase: both backward phases are the backward."""
    return "backward" if phase in BACKWARD_PHASES else phase


def scheduled_phases(layout: Layout) -> tuple[str, ...]:
    """The phases a pipeline stage runs after some micro-batch's backward (see `rank_memory`): none without a
    pipeline of several micro-batches; the backward; and the forward too where 1F1B's steady state
    interleaves forwards with backwards (more micro-batches than the first stage holds in flight)."""
    if layout.pp == 1 or layout.micro_batches == 1:
        return ()
    steady = layout.schedule == "1f1b" and layout.micro_batches > layout.in_flight
    return ("forward", "backward") if steady else ("backward",)


def _largest_block(model, workload, bytes_per_param: float, own_experts: bool) -> int:
    """Bytes of the largest repeated block's parameters (as the rank holds them) for FSDP to gather. With
    `own_experts` (expert parallelism) its experts are not gathered: each rank holds its own."""
    blocks = workload.blocks(model)
    if not blocks:
        raise Unsupported(f"{workload.name} exposes no repeated blocks for FSDP to shard one by one")
    experts = {id(p) for layer in moe_layers(model) for p in layer.expert_parameters()} if own_experts else set()
    return round(max(sum(p.numel() for p in block.parameters() if id(p) not in experts) for block in blocks)
                 * bytes_per_param)


def _root_bytes(model, workload, bytes_per_param: float) -> int:
    """Bytes of the parameters outside the repeated blocks (embeddings, final norm, head) as the rank holds
    them: FSDP's root module, gathered as one."""
    inside = {id(p) for block in workload.blocks(model) for p in block.parameters()}
    return round(sum(p.numel() for p in model.parameters() if id(p) not in inside) * bytes_per_param)


def _tied_bytes(model, workload, layout: Layout, grad_bytes_per_param: float) -> int:
    """Gradient bytes of what the first and last pipeline stages both hold (Pipelining's tied_parameters, named
    by a one-stage cut of `model`, which is both), sharded over the data-parallel ranks by a sharding
    technique."""
    if layout.pp == 1 or workload.pipelining is None:
        return 0
    stage = workload.pipelining.stage(model, 0, 1)
    count = sum(p.numel() for p in getattr(stage, "tied_parameters", list)())
    sharded = layout.dp if layout.data_technique in SHARDED else 1
    return round(count * grad_bytes_per_param / sharded)


def _activations_per_block(local: ResolvedCell) -> int:
    """The activations one micro-batch leaves per block at the forward's end (what a pipeline stage holds
    per micro-batch in flight), from traces of the rank's part at two depths."""
    from harness.project.trace import traced

    low, high = (traced(local.with_spec(local.workload.with_depth(local.spec, depth))) for depth in (2, 3))
    return max(0, high.activations_bytes - low.activations_bytes)


def _sequence_sharded(local: ResolvedCell, layout: Layout, layers: int, gathered: int = 0) -> tuple[int, int]:
    """(one micro-batch's activations per block as the rank holds them, the bytes sequence parallelism takes
    off the traced forward). Tensor parallelism alone leaves the norms' inputs, dropout and the residual
    stream whole on every rank; sequence parallelism shards them too (Korthikanti et al. 2022, table 2:
    34/t + 5as/(ht) against 10 + 24/t + 5as/(ht)), except that PyTorch's column-parallel layers keep the
    all-gathered input they multiply for their backward: `gathered` bytes per block stay whole."""
    if not (layout.pp > 1 or layout.sequence_parallel):
        return 0, 0
    per_block = _activations_per_block(local)
    if not layout.sequence_parallel or layout.tp == 1:
        return per_block, 0
    whole = Stack(tuple(t for t in local.stack.techniques if not t.id.startswith("tensor-parallel-rank")))
    unsharded = _activations_per_block(dataclasses.replace(local, stack=whole))
    sharded = (unsharded - gathered) // layout.tp + gathered
    return sharded, max(0, layers * (per_block - sharded))


def project_parallel(cell: ResolvedCell) -> Outcome:
    """The projected outcome of a parallel stack on `cell.cell.world_size` GPUs: one rank's memory (peaks
    are per rank, never summed) and the step with its pipeline bubble and exposed communication."""
    from harness.project import oom_reason, project  # the package builds on this module

    if cell.unsupported:
        return failure("unsupported", cell.unsupported)
    layout = layout_of(cell)
    local = local_cell(cell, layout)
    if local.unsupported:
        return failure("unsupported", local.unsupported)
    projection = project(local)
    memory, trace = projection.memory, projection.trace
    if not trace.phase_at_peak:
        raise Unsupported("the rank's trace kept no per-phase breakdown to shard")
    technique = layout.data_technique
    part = sharded_model_figures(local.workload, local.spec, layout.tp)
    model, sharded, width = part.model, part.sharded, part.width
    per_param = memory.params / max(1, trace.param_count)
    gathers = technique in ("fsdp", "fsdp-zero2", "cpu-offload")
    block = _largest_block(model, local.workload, per_param, own_experts=layout.ep > 1) if gathers else 0
    block_grads = round(block * memory.grads / memory.params) if memory.params else 0
    root = _root_bytes(model, local.workload, per_param) if gathers else 0
    # Under FSDP2's MixedPrecisionPolicy the rank computed in the gathered dtype (as traced) but keeps fp32
    # shards, gradients and optimizer state, and casts a block's gradients to fp32 to reduce-scatter them.
    master = MASTER_BYTES / GATHER_DTYPES[layout.gather_dtype].itemsize if layout.gather_dtype else 1.0
    if layout.gather_dtype:
        block_grads += round(block_grads * master)
    # The optimizer step's scratch (foreach AdamW's parameter-sized temporary) is fp32 too.
    phase_at_peak = {phase: {k: round(v * master) if k in STATES or (phase, k) == ("optimizer", "temporaries")
                             else v for k, v in at.items()} for phase, at in trace.phase_at_peak.items()}
    reduced_grads = round(memory.grads * master)  # what the gradients' reduce-scatter carries
    layers = local.workload.depth(local.spec) or 0
    recomputed = any(base_name(t).startswith("checkpointing") for t in cell.stack.techniques)
    # Each sharded module's input, all-gathered along the sequence, in the dtype its matmul saves it in; a
    # checkpointed block keeps only its (sharded) input.
    gathered = sharded // max(1, layers) * local.batch_size * (local.spec.seq_len or 0) * width \
        * ACTIVATION_BYTES.get(trace.precision, 4) if layout.sequence_parallel and not recomputed else 0
    per_block, saved = _sequence_sharded(local, layout, layers, gathered)
    in_flight = (layout.in_flight - 1) * layers * per_block if layout.pp > 1 else 0
    in_flight -= saved  # negative: what sequence parallelism takes off each forward's activations
    states = tuple(round(size * master) for size in (trace.params_bytes, trace.grads_bytes, trace.optimizer_bytes))
    replicated, own = trace.param_count, (0, 0, 0)
    if layout.ep > 1:
        tokens = local.batch_size * (local.spec.seq_len or 1)
        moe, buffer, replicated = expert_figures(local.workload, local.spec, layout.ep, tokens)  # the stage's
        mine = max(0, trace.param_count - replicated) / max(1, trace.param_count)  # this rank's experts' share
        own = tuple(round(size * mine) for size in states)
    element, stream = ACTIVATION_BYTES.get(trace.precision, 4), STREAM_BYTES.get(trace.precision, 4)
    elements = local.batch_size * (local.spec.seq_len or 0) * width
    # What crosses a stage boundary per micro-batch: under sequence parallelism a tensor-parallel rank's part
    # of the sequence (the blocks' output is sharded along it), else the whole.
    stage_elements = elements // (layout.tp if layout.sequence_parallel else 1)
    # A stage receives each micro-batch's input (all but the first stage) and its output's gradient (all but
    # the last): a middle stage both, in buffers for every micro-batch.
    directions = 1 if layout.pp == 2 else 2
    buffers = layout.micro_batches * stage_elements * stream * directions if layout.pp > 1 else 0
    rank = rank_memory(technique, layout.dp, phase_at_peak, states, block, block_grads, in_flight, own,
                       gathered_share=1 / master, scheduled=scheduled_phases(layout), buffers=buffers,
                       root_params=root, root_grads=round(root * master * memory.grads / memory.params)
                       if memory.params else 0)
    # What the allocator model adds to the trace's live bytes (workspaces), and its reserve, carry over.
    peak = memory.peak_allocated - trace.peak_bytes + rank.peak
    reserved = (memory.chosen_reserved or memory.peak_allocated) - memory.peak_allocated + peak
    fits = None if memory.capacity is None else reserved + memory.overhead <= memory.capacity
    notes = [f"{layout.describe()} on {layout.world} GPUs: one rank traced at micro-batch {local.batch_size} of "
             f"global batch {cell.batch_size}"
             + (f", {layers} of {cell.workload.depth(cell.spec)} blocks (a stage with both the embeddings and the "
                f"head: the first and last stages' extras together)" if layout.pp > 1 else "")
             + (f"; {layout.in_flight} micro-batches' activations held by the first stage" if layout.pp > 1 else "")
             + (f", its gradients whole{' and parameters gathered' if block else ''} in the "
                f"{' and '.join(scheduled_phases(layout))} after the first micro-batch's backward"
                if scheduled_phases(layout) else "")
             + (f", {buffers / 2**20:,.1f} MiB of receive buffers for its {layout.micro_batches} micro-batches"
                if buffers else "")
             + (f"; sequence parallelism takes {saved / 2**20:,.0f} MiB off the forward's activations" if saved
                else "")
             + (f"; model states moved as {technique} shards them (largest block {block / 2**20:,.0f} MiB)"
                if block else "")
             + f"; the rank peaks in the {rank.phase.replace('_', ' ')}"
             + _cast_cache_note(layout, trace, memory.params),
             *_tensor_across_nodes(layout, cell.profile), *memory.notes]
    figures = MemoryFigures(
        peak_allocated=peak, peak_reserved=reserved, device_overhead=memory.overhead,
        library_workspaces=memory.workspaces, params=rank.params, grads=rank.grads, optimizer=rank.optimizer,
        activations=memory.activations + in_flight, temporaries=rank.temporaries, param_count=trace.param_count,
        host=rank.host)
    # FSDP2 gathers and scatters for every forward/backward pass: a pipeline's micro-batches, or the
    # passes grad-accumulation makes (DDP syncs once per step: Step runs the others under no_sync).
    passes = layout.micro_batches * trace.micro_batches
    # ZeRO-1 broadcasts only the parameters its optimizer steps (suites/techniques/parallel.py counts them so), and
    # a trained parameter's bytes are its gradient's: under adapters, theirs, not the frozen base's.
    stepped = min(memory.params, reduced_grads) if technique == "zero1" else memory.params
    sent = collective_bytes(technique, layout.dp, stepped, reduced_grads, passes, root, pipelined=layout.pp > 1)
    units = len(local.workload.blocks(model)) if gathers else 0
    collectives = data_parallel_collectives(technique, reduced_grads, units, _trained_tensors(model, False), passes,
                                            pipelined=layout.pp > 1)
    tied = _tied_bytes(model, local.workload, layout, reduced_grads / max(1, trace.param_count))
    sent_stream = stage_elements * stream
    pipeline, tied_sent = pipeline_bytes(layout.pp, sent_stream, layout.micro_batches, tied)
    # The ends of the cut sequence on the stage costed: both without a pipeline, one on an end stage, none on a
    # middle one (the stage that sends most where pipeline_bytes chose it).
    middle = layout.pp > 2 and pipeline == 2.0 * sent_stream
    ends = (2 if layout.pp == 1 else 0 if middle else 1) if layout.sequence_parallel else 0
    # A recomputed block's last row-parallel output is skipped where it only feeds the residual add: both the
    # attention and the MLP sharded (the MLP's output last), and no dropout mask to recompute it for.
    skipped = layers if sharded >= 2 * layers and not local.spec.config.get("dropout") else 0
    # The traced stage holds the embedding and the head (a pipeline's first and last stages' together); the
    # logits are gathered under a pipeline, kept sharded for loss parallelism without one.
    gathered_logits = local.batch_size * (local.spec.seq_len or 0) * part.logits_rows if layout.pp > 1 else 0
    # Of the vocabulary-parallel layers, the stage costed sends the head's (without a pipeline, the embedding's
    # too): a pipeline's last stage, whose head sends at least what the first stage's embedding does, or a
    # middle stage, which has neither.
    vocabulary = vocabulary_parallel_bytes(layout.tp, elements, stream, part.embedding and layout.pp == 1,
                                           part.logits_rows > 0 and not middle, gathered_logits, element,
                                           local.batch_size * (local.spec.seq_len or 0))
    # The stage's norms (its blocks', and the final one's, traced with the end stages) reduce their gradients.
    norms = norm_gradient_bytes_sent(layout.tp, norm_gradient_bytes(model)) if layout.sequence_parallel else 0.0
    per_micro = {"tensor": tensor_parallel_bytes(layout.tp, sharded, elements, element, stream, recomputed,
                                                 skipped, ends, layout.sequence_parallel) + vocabulary + norms,
                 "pipeline": pipeline, "expert": 0.0}
    tensor_collectives = tensor_parallel_collectives(
        layout.tp, sharded, recomputed, skipped, ends, embedding=part.embedding and layout.pp == 1,
        head=part.logits_rows > 0 and not middle, gathered_logits=gathered_logits > 0,
        sequence_parallel=layout.sequence_parallel)
    if layout.ep > 1:
        per_micro["expert"] = all_to_all_bytes(layout.ep, moe, buffer, element) * (1 + 0.5 * recomputed)
        # What is not an expert trains data-parallel (all-reduced as DDP would) or sharded over the same ranks.
        share = replicated / max(1, trace.param_count)
        sent = collective_bytes(technique or "data-parallel", layout.ep, round(memory.params * share),
                                round(reduced_grads * share), passes, root, pipelined=layout.pp > 1)
        tensors = _trained_tensors(model, True)
        collectives = data_parallel_collectives(technique or "data-parallel", reduced_grads * share, units, tensors,
                                                passes, pipelined=layout.pp > 1)
        if technique is None:
            # expert-parallel's own averaging: every backward's gradients all-reduced one parameter at a time,
            # synchronously (suites/techniques/expert.py), after each micro-batch: nothing hides it.
            sent = {"optimizer": passes * sum(sent.values())}
            collectives = {"optimizer": (passes * tensors, "all_reduce")}
    comm_bytes = sum(sent.values()) + layout.micro_batches * sum(per_micro.values()) + tied_sent
    speed = None
    if fits is not False and projection.time is not None:
        speed = parallel_step(cell, layout, projection, sent, per_micro, rank, notes, master, tied_sent,
                              tensor_collectives, collectives)
    status, reason = "ok", ""
    if fits is False:
        status = "oom"
        reason = oom_reason(dataclasses.replace(memory, peak_allocated=peak,
                                                reserved={memory.allocator: reserved}), cell.profile.id)
        reason += f" (per rank, {layout.describe()})"
    basis = next((note for note in notes if note.startswith("step time: ")), None) if speed else None
    return Outcome(status=status, reason=reason, precision=trace.precision, memory=figures, speed=speed, fits=fits,
                   device_name=cell.profile.name, notes=notes, comm_bytes_per_step=round(comm_bytes),
                   interval_basis=basis)


def _trained_tensors(model, own_experts: bool) -> int:
    """The trained parameter tensors a data-parallel technique synchronises (ZeRO-1 broadcasts each; expert
    parallelism's own averaging all-reduces each): with `own_experts`, those outside the experts."""
    experts = {id(p) for layer in moe_layers(model) for p in layer.expert_parameters()} if own_experts else set()
    return sum(1 for p in model.parameters() if p.requires_grad and id(p) not in experts)


def _tensor_across_nodes(layout: Layout, profile) -> list[str]:
    """A warning where the tensor-parallel group is larger than a node."""
    node = node_gpus(profile)
    if layout.tp <= node:
        return []
    return [f"warning: {layout.tp}-way tensor parallelism spans nodes of {node} GPUs: its collectives, several per "
            "layer on the critical path, cross the network (costed at NCCL's network latency and a GPU's share of the "
            "network); tensor-parallel groups "
            f"of at most {node} keep them inside a node"]
