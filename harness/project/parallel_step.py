"""The step time of a parallel stack (harness/project/parallel.py traces its rank and counts what it sends): the
pipeline's (m + p - 1) micro-batch slots of compute and tensor-, pipeline- and expert-parallel sends, the end
stages' tied-weight all-reduce, the optimizer step, the data-parallel communication the schedule cannot hide, and an
offloaded step's host traffic. Collectives are costed at NCCL's own model (collective_cost.py) over the links
communication.py classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.cell import ResolvedCell
from harness.ledger import unfitted_interval
from harness.outcome import SpeedFigures
from harness.project.collective_cost import collective_s, ring_collective_s
from harness.project.communication import (
    DDP_BUCKET_BYTES,
    data_parallel_windows,
    exposed_s,
    link_bytes_s,
)
from harness.project.layout import Layout
from harness.project.roofline import estimate, host_link_bytes_s, offload_s
from suites.techniques.offload import HostTraffic
from suites.techniques.parallel import regathered_note

if TYPE_CHECKING:
    from harness.project.parallel import RankMemory


def _data_parallel_s(profile, layout: Layout, sent: dict[str, float], collectives: dict[str, tuple[int, str]],
                     link: float) -> tuple[dict[str, float], float, int]:
    """(seconds of each phase's data-parallel collectives, of DDP's last bucket, how many collectives in all):
    each phase's bytes taken as equal parts over its collectives (`data_parallel_collectives`), each at NCCL's
    model (collective_cost.collective_s: a ring, or a tree for an all-reduce where that is faster) over the
    data-parallel group, `tp` GPUs apart."""
    seconds, count = {}, 0
    for phase, size in sent.items():
        n, ring = collectives.get(phase, (1, "all_reduce"))
        seconds[phase] = n * collective_s(profile, layout.dp, ring, size / n, link, stride=layout.tp)
        count += n
    last = 0.0
    if layout.data_technique in ("data-parallel", "zero1") and sent.get("backward"):
        bucket = min(sent["backward"], 2 * (layout.dp - 1) / layout.dp * DDP_BUCKET_BYTES)
        last = collective_s(profile, layout.dp, "all_reduce", bucket, link, stride=layout.tp)
    return seconds, last, count


def _tensor_collectives_s(profile, tp: int, sent: float, collectives: tuple[int, str], link: float | None) -> float:
    """Seconds of a micro-batch's tensor-parallel collectives: `sent` bytes in `collectives` (a count and the ring
    they run as), taken as equal parts, each at NCCL's ring model (collective_cost.ring_collective_s)."""
    count, ring = collectives
    if not sent or not link:
        return 0.0
    return count * ring_collective_s(profile, tp, ring, sent / count, link)


def parallel_step(cell: ResolvedCell, layout: Layout, projection, sent: dict[str, float], per_micro: dict[str, float],
          rank: RankMemory, notes: list[str], master: float = 1.0, tied_sent: float = 0.0,
          tensor_collectives: tuple[int, str] = (0, "all_reduce"),
          data_collectives: dict[str, tuple[int, str]] | None = None) -> SpeedFigures | None:
    """The parallel step: (m + p - 1) pipeline slots of one micro-batch's compute and its tensor-, pipeline-
    and expert-parallel sends, then the end stages' all-reduce of a tied weight's gradient (after the last
    backward: nothing hides it), the optimizer step, the data-parallel communication not hidden, and an
    offloaded step's host traffic; None (with a note) where a link's bandwidth is unknown."""
    profile = cell.profile.per_device()
    trace = projection.trace
    links = {"data": link_bytes_s(profile, layout.tp * layout.dp, ring_stride=layout.tp),
             # A tensor-parallel group past a node keeps a GPU's own share of the network, not its NICs together.
             "tensor": link_bytes_s(profile, layout.tp),
             "expert": link_bytes_s(profile, layout.tp * layout.ep),
             "pipeline": link_bytes_s(profile, 2 * layout.tp * layout.dp, point_to_point=True)}
    needed = {"data": bool(sent), **{kind: bool(size) for kind, size in per_micro.items()}}
    host_link = host_link_bytes_s(profile)
    if layout.data_technique == "cpu-offload" and host_link is None:
        notes.append(f"no step time: no host link bandwidth known for {profile.id} (interconnect.host_link_gb_s)")
        return None
    for kind, (bandwidth, described) in links.items():
        if needed[kind] and bandwidth is None:
            notes.append(f"no step time: {described}")
            return None
    phases = {phase: estimate(trace, profile, phases=(phase,)).step_s for phase in ("forward", "backward", "optimizer")}
    micro_s = projection.time.step_s - phases["optimizer"]  # everything but the step, per micro-batch
    sends_s = sum(size / links[kind][0] for kind, size in per_micro.items() if size and kind != "tensor")
    tensor_s = _tensor_collectives_s(profile, layout.tp, per_micro["tensor"], tensor_collectives, links["tensor"][0])
    sends_s += tensor_s
    slots = layout.micro_batches + layout.pp - 1
    # Expert parallelism's replicated rest is all-reduced as DDP would (hooks as gradients are ready).
    collective = layout.data_technique or ("data-parallel" if layout.ep > 1 else None)
    windows = data_parallel_windows(collective, phases["forward"], phases["backward"], layout.micro_batches)
    exposed, dp_count = 0.0, 0
    if sent:
        dp_seconds, last_bucket, dp_count = _data_parallel_s(profile, layout, sent, data_collectives or {},
                                                             links["data"][0])
        exposed = exposed_s(dp_seconds, windows, last_bucket)
    tied_s = tied_sent / links["pipeline"][0] if tied_sent else 0.0
    step = slots * (micro_s + sends_s) + tied_s + phases["optimizer"] + exposed
    if layout.data_technique == "cpu-offload":
        # Each step this rank's gradient shard goes to the host, whose AdamW updates the parameter shard,
        # which comes back for the next step's gathers.
        params_shard = -(-round(trace.params_bytes * master) // layout.dp)  # fp32 shards under a gather dtype
        grads_shard = -(-round(trace.grads_bytes * master) // layout.dp)
        step += offload_s(HostTraffic(rank.host or 0, grads_shard, params_shard, 7 * params_shard), host_link,
                          phases["backward"], notes)
    if layout.pp > 1:
        notes.append(f"pipeline bubble {(layout.pp - 1) / slots:.0%} of the step ((p - 1) / (m + p - 1), "
                     f"{layout.pp - 1} idle slots of {slots})")
    for kind, size in per_micro.items():
        if size and kind == "tensor":
            count, ring = tensor_collectives
            notes.append(f"tensor parallel sends {size / 2**20:,.1f} MiB per micro-batch in {count} "
                         f"{ring.replace('_', '-')}s over {links[kind][1]}, on the critical path: "
                         f"{tensor_s * 1e3:.2f} ms a micro-batch (NCCL's ring model: a latency per collective and "
                         "ring step, then the bytes)")
        elif size:
            notes.append(f"{kind} parallel sends {size / 2**20:,.1f} MiB per micro-batch over {links[kind][1]}, on "
                         f"the critical path: {size / links[kind][0] * 1e3:.2f} ms each")
    if tied_sent:
        notes.append(f"the first and last stages all-reduce the tied weight's gradient, {tied_sent / 2**20:,.0f} MiB "
                     f"over {links['pipeline'][1]} after the last backward: {tied_s * 1e3:.2f} ms")
    if sent:
        notes.append(f"data-parallel communication {sum(sent.values()) / 2**20:,.0f} MiB sent per rank per step in "
                     f"{dp_count:,} collectives over {links['data'][1]} (NCCL's model: a latency per collective and "
                     f"step, a ring or for all-reduces a tree): {exposed * 1e3:.1f} ms not hidden under compute")
        if layout.data_technique == "fsdp" and layout.pp > 1 and layout.micro_batches > 1:
            notes.append(regathered_note(layout.micro_batches))
    # The bytes are checked (counted on gloo ranks, tests/test_parallel.py); their time over NVLink and the
    # network, and the overlap, not yet against a measured multi-GPU step.
    bar = unfitted_interval(step * 1e3, "multi-GPU communication time not yet checked against a measured "
                                        "multi-GPU step (its bytes are: counted on gloo ranks)")
    notes.append(f"step time: {bar.basis}")
    return SpeedFigures(step_time_ms_p50=step * 1e3, step_time_ms_mean=step * 1e3,
                        throughput_samples_s=cell.batch_size / step, step_time_ms_low=bar.low,
                        step_time_ms_high=bar.high, step_time_cells=bar.cells)
