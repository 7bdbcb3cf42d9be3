"""Projection of data-parallel and sharded stacks to N GPUs, from the trace of one rank's part.

One rank of a d-way data-parallel stack runs the single-device stack on its slice of the global batch
(global / d), so the projection traces that (the same trace and allocator model as any cell) and then
moves what the parallel technique moves (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054):
- `data-parallel` (DDP) keeps a full replica and adds flat gradient buckets the size of the gradients
  (DDP's default `gradient_as_bucket_view=False`, PyTorch DDP notes);
- `zero1` keeps 1/d of the optimizer state;
- `fsdp` (ZeRO-3) keeps 1/d of parameters, gradients and optimizer state, plus the blocks gathered at a
  time (the running block and the prefetched next one, with one block's unsharded gradients);
- `fsdp-zero2` keeps the parameters gathered from forward to backward: shards gradients and state only;
- `cpu-offload` holds FSDP's shards in host memory (host_bytes) and only gathered blocks on the device.
Communication is costed as ring collectives over the profile's links: NVLink (or the host link) inside a
node of `node_gpus`, the node's network between nodes, overlapped with the phase it runs under as the
schedule allows. Tensor, pipeline and expert parallelism are not projected yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import ResolvedCell
from harness.outcome import MemoryFigures, Outcome, SpeedFigures, failure
from suites.techniques import Stack, Unsupported
from suites.techniques.base import Phase
from suites.techniques.offload import HostTraffic

DATA_PARALLEL = {"data-parallel", "zero1", "fsdp", "fsdp-zero2", "cpu-offload"}
# Blocks whose parameters FSDP2 holds unsharded at once: the one computing and the one prefetched.
GATHERED_BLOCKS = 2
# DDP's gradient buckets (25 MiB by default): the last one's all-reduce cannot hide under the backward.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Layout:
    """How the ranks split the work: `dp` data-parallel (or sharded) ranks."""

    dp: int = 1


@dataclass(frozen=True)
class RankMemory:
    """Per-rank bytes of a sharded stack: its model states, its peak, and what it keeps in host memory."""

    params: int
    grads: int
    optimizer: int
    peak: int  # live bytes at the step's peak, as the trace counts them (before workspaces)
    host: int | None = None


def local_cell(cell: ResolvedCell, layout: Layout) -> tuple[ResolvedCell, str]:
    """The cell one rank runs (the stack without its parallel technique, the rank's slice of the batch) and
    the parallel technique's id; Unsupported for what is not projected yet."""
    parallel = [t for t in cell.stack.techniques if t.phase in (Phase.PARALLEL, Phase.DATA_PARALLEL)]
    if any(t.id not in DATA_PARALLEL for t in parallel):
        names = ", ".join(t.id for t in parallel if t.id not in DATA_PARALLEL)
        raise Unsupported(f"projecting {names} is not implemented yet (data-parallel and sharded stacks are); "
                          "measure it with headroom run --world-size N")
    if len(parallel) != 1:
        raise Unsupported("one data-parallel or sharding technique per stack")
    if cell.mode != "train":
        raise Unsupported("data parallelism and sharding are projected for training; a served model is projected "
                          "per GPU")
    if cell.batch_size % layout.dp:
        raise Unsupported(f"the global batch {cell.batch_size} does not split into {layout.dp} ranks; give a "
                          f"multiple of {layout.dp}")
    stack = Stack(tuple(t for t in cell.stack.techniques if t not in parallel))
    local = dataclasses.replace(
        cell, stack=stack, unsupported=stack.check(cell.profile, cell.workload, cell.mode),
        cell=dataclasses.replace(cell.cell, technique=stack.name, batch_size=cell.batch_size // layout.dp,
                                 world_size=1))
    return local, parallel[0].id


def rank_memory(technique: str, dp: int, phase_at_peak: dict[str, dict[str, int]], states: tuple[int, int, int],
                block_params: int, block_grads: int) -> RankMemory:
    """Per-rank memory under `technique` on `dp` ranks, from one rank's unsharded trace: each phase's peak
    with its parameters, gradients and optimizer state kept as the technique keeps them, what it adds
    (DDP's buckets, FSDP's gathered blocks), and the optimizer step's temporaries shrunk with its shard."""
    params, grads, optimizer = states

    def shard(size: int) -> int:
        return -(-size // dp)

    # Between steps (the row's params/grads/optimizer columns, as FSDP2's sharded storage holds them).
    kept = {"data-parallel": (params, grads, optimizer), "zero1": (params, grads, shard(optimizer)),
            "fsdp-zero2": (shard(params), shard(grads), shard(optimizer)),
            "fsdp": (shard(params), shard(grads), shard(optimizer)), "cpu-offload": (0, 0, 0)}[technique]
    buckets = grads if technique in ("data-parallel", "zero1") else 0  # DDP's flat gradient buckets
    gathered = {"forward": GATHERED_BLOCKS * block_params, "backward": GATHERED_BLOCKS * block_params + block_grads}
    if technique in ("data-parallel", "zero1"):
        gathered = {}  # replicas: nothing to gather
    elif technique == "fsdp-zero2":
        # Parameters gathered in the forward stay whole until the backward is done: by the forward's end
        # every block's are (counted as the whole parameters below); a block's gradients before scattering.
        gathered = {"backward": block_grads}
    sharded_step = technique != "data-parallel"
    peaks = []
    def scaled(at: dict[str, int], category: str, whole: int, keep: int) -> float:
        return at.get(category, 0) * (keep / whole if whole else 1.0)

    for phase, at in phase_at_peak.items():
        if technique == "fsdp-zero2" and phase in ("forward", "backward"):
            kept_params = params  # whole, at the forward's end and through the backward
        else:
            kept_params = kept[0]
        temporaries = at.get("temporaries", 0)
        if phase == "optimizer" and sharded_step:
            temporaries = 0 if technique == "cpu-offload" else shard(temporaries)  # the step runs on the shard
        peaks.append(scaled(at, "params", params, kept_params) + scaled(at, "grads", grads, kept[1])
                     + scaled(at, "optimizer", optimizer, kept[2]) + at.get("activations", 0) + temporaries
                     + buckets + gathered.get(phase, 0))
    host = shard(params) + shard(grads) + shard(optimizer) if technique == "cpu-offload" else None
    return RankMemory(*kept, peak=round(max(peaks)), host=host)


def link_bytes_s(profile, ranks: int) -> tuple[float | None, str]:
    """One direction of the slowest link a ring over `ranks` GPUs crosses, and which link that is: inside a
    node NVLink (its datasheet figure is both directions) or, without one, the host link; between nodes
    the node's network shared by its GPUs."""
    links = profile.interconnect or {}
    node = links.get("node_gpus") or 8
    if ranks > node:
        network = links.get("node_network_gb_s")
        if not network:
            return None, f"no inter-node bandwidth known for {profile.id} (interconnect.node_network_gb_s)"
        return network * 1e9 / node, f"{network:g} GB/s node network shared by {node} GPUs"
    nvlink = links.get("gpu_link_gb_s")
    if nvlink and links.get("gpu_link", "").startswith("NVLink") and "bridge" not in links.get("gpu_link", ""):
        return nvlink * 1e9 / 2, f"{links.get('gpu_link', 'GPU link')} ({nvlink:g} GB/s both ways)"
    host = links.get("host_link_gb_s")
    if host:
        return host * 1e9 / 2, f"{links.get('host_link', 'host link')} through the host ({host:g} GB/s both ways)"
    return None, f"no GPU or host link bandwidth known for {profile.id}"


def collective_bytes(technique: str, dp: int, params: int, grads: int) -> dict[str, float]:
    """Bytes each rank sends per step, per phase the collective runs under (ring algorithms: an all-reduce
    sends 2 (d - 1) / d of the buffer, an all-gather or reduce-scatter (d - 1) / d; Patarasuk & Yuan 2009)."""
    share = (dp - 1) / dp
    if technique == "data-parallel":
        return {"backward": 2 * share * grads}
    if technique == "zero1":
        return {"backward": 2 * share * grads, "optimizer": share * params}  # + the updated shards' broadcast
    if technique == "fsdp-zero2":
        return {"forward": share * params, "backward": share * grads}
    return {"forward": share * params, "backward": share * (params + grads)}  # ZeRO-3 gathers again for backward


def exposed_s(sent: dict[str, float], phases: dict[str, float], link: float, technique: str) -> float:
    """Communication seconds the step cannot hide: collectives overlap the phase they run under (FSDP
    prefetches the next block's gather, DDP all-reduces buckets as gradients are ready); whatever outlasts
    the phase shows, and DDP's last bucket always does. ZeRO-1's broadcast follows the step."""
    total = 0.0
    for phase, size in sent.items():
        seconds = size / link
        if phase == "optimizer":
            total += seconds
        else:
            total += max(0.0, seconds - phases.get(phase, 0.0))
    if technique in ("data-parallel", "zero1") and sent.get("backward"):
        total += min(DDP_BUCKET_BYTES, sent["backward"]) / link
    return total


def block_bytes(cell: ResolvedCell, bytes_per_param: float) -> int:
    """Bytes of the largest repeated block's parameters, from the model built on the meta device."""
    import torch

    with torch.device("meta"):
        model = cell.workload.build(cell.spec)
    blocks = [block for container in cell.workload.block_lists(model) for block in container]
    if not blocks:
        raise Unsupported(f"{cell.workload.name} exposes no repeated blocks for FSDP to shard one by one")
    return round(max(sum(p.numel() for p in block.parameters()) for block in blocks) * bytes_per_param)


def project_parallel(cell: ResolvedCell) -> Outcome:
    """The projected outcome of a data-parallel or sharded stack on `cell.cell.world_size` GPUs: one rank's
    memory (peaks are per rank, never summed) and the step with its exposed communication."""
    from harness.ledger import unfitted_interval
    from harness.project import oom_reason, project
    from harness.project.roofline import estimate, host_link_bytes_s, offload_s

    if cell.unsupported:
        return failure("unsupported", cell.unsupported)
    layout = Layout(dp=cell.cell.world_size)
    local, technique = local_cell(cell, layout)
    if local.unsupported:
        return failure("unsupported", local.unsupported)
    projection = project(local)
    memory, trace = projection.memory, projection.trace
    per_param = memory.params / max(1, trace.param_count)
    block = block_bytes(local, per_param)
    block_grads = round(block * memory.grads / memory.params) if memory.params else 0
    if not trace.phase_at_peak:
        raise Unsupported("the rank's trace kept no per-phase breakdown to shard")
    rank = rank_memory(technique, layout.dp, trace.phase_at_peak, (trace.params_bytes, trace.grads_bytes,
                                                                    trace.optimizer_bytes), block, block_grads)
    # What the allocator model adds to the trace's live bytes (workspaces), and its reserve, carry over.
    peak = memory.peak_allocated - trace.peak_bytes + rank.peak
    reserved = (memory.chosen_reserved or memory.peak_allocated) - memory.peak_allocated + peak
    fits = None if memory.capacity is None else reserved + memory.overhead <= memory.capacity
    notes = [f"{layout.dp}-way {technique}: one rank traced at batch {local.batch_size} of {cell.batch_size}; "
             f"model states moved as the technique shards them (largest block {block / 2**20:,.0f} MiB)",
             *memory.notes]
    sent = collective_bytes(technique, layout.dp, memory.params, memory.grads)
    figures = MemoryFigures(
        peak_allocated=peak, peak_reserved=reserved, device_overhead=memory.overhead,
        library_workspaces=memory.workspaces, params=rank.params, grads=rank.grads, optimizer=rank.optimizer,
        activations=memory.activations, temporaries=memory.temporaries, param_count=trace.param_count,
        host=rank.host)
    speed = None
    if fits is not False and projection.time is not None:
        profile = cell.profile.per_device()
        link, described = link_bytes_s(profile, layout.dp)
        host_link = host_link_bytes_s(profile)
        if technique == "cpu-offload" and host_link is None:
            link, described = None, f"no host link bandwidth known for {profile.id} (interconnect.host_link_gb_s)"
        if link is None:
            notes.append(f"no step time: {described}")
        else:
            phases = {phase: estimate(trace, profile, phases=(phase,)).step_s for phase in ("forward", "backward")}
            exposed = exposed_s(sent, phases, link, technique)
            step = projection.time.step_s + exposed
            if technique == "cpu-offload":
                # Each step this rank's gradient shard goes to the host, whose AdamW updates the parameter
                # shard, which comes back for the next step's gathers.
                params_shard = -(-trace.params_bytes // layout.dp)
                grads_shard = -(-trace.grads_bytes // layout.dp)
                step += offload_s(HostTraffic(rank.host or 0, grads_shard, params_shard, 7 * params_shard),
                                  host_link, phases["backward"], notes)
            notes.append(f"communication {sum(sent.values()) / 2**20:,.0f} MiB sent per rank per step over "
                         f"{described}: {exposed * 1e3:.1f} ms not hidden under compute")
            bar = unfitted_interval(step * 1e3, "multi-GPU communication not yet checked against a measured "
                                                "multi-GPU step")
            notes.append(f"step time: {bar.basis}")
            speed = SpeedFigures(step_time_ms_p50=step * 1e3, step_time_ms_mean=step * 1e3,
                                 throughput_samples_s=cell.batch_size / step, step_time_ms_low=bar.low,
                                 step_time_ms_high=bar.high, step_time_cells=bar.cells)
    status, reason = "ok", ""
    if fits is False:
        status = "oom"
        reason = oom_reason(dataclasses.replace(memory, peak_allocated=peak,
                                                reserved={memory.allocator: reserved}), cell.profile.id)
        reason += f" (per rank, {layout.dp}-way {technique})"
    return Outcome(status=status, reason=reason, precision=trace.precision, memory=figures, speed=speed, fits=fits,
                   device_name=cell.profile.name, notes=notes, comm_bytes_per_step=round(sum(sent.values())))
