"""What a parallel step sends and how long the sending takes: ring collectives over the profile's links
(NVLink, or the host link, inside a node of `node_gpus`; the node's network between nodes), overlapped
with the compute they run under as the schedule allows.

Volumes are the ring algorithms' (Patarasuk & Yuan 2009): an all-reduce sends 2 (n - 1) / n of the
buffer from each rank, an all-gather or reduce-scatter (n - 1) / n. Ranks are laid out tensor-parallel
innermost, then data-parallel, then pipeline stages (Megatron-LM's order), so a group of n ranks spans
that many consecutive GPUs. Not yet checked against a measured multi-GPU step.
"""

from __future__ import annotations

# DDP's gradient buckets (25 MiB by default, the first 1 MiB): the last one's all-reduce cannot hide under the
# backward.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
SHARDED = ("fsdp", "fsdp-zero2", "cpu-offload")


# A node's GPUs where a profile does not say: an HGX / DGX baseboard's eight.
DEFAULT_NODE_GPUS = 8


def node_gpus(profile) -> int:
    """The GPUs of one node of `profile` (its interconnect's `node_gpus`, else an HGX baseboard's eight)."""
    return (profile.interconnect or {}).get("node_gpus") or DEFAULT_NODE_GPUS


def intra_node_link(profile, ranks: int) -> str:
    """The link a group of `ranks` consecutive GPUs uses inside a node, as NCCL classes it: `nvlink` where
    every member reaches the next over NVLink (an NVSwitch joins a node's GPUs, a bridge joins a pair) or over
    a full mesh of AMD Infinity Fabric links (RCCL files xGMI under NCCL's NVLink link type: ROCm/rccl
    src/graph/topo.cc prints LINK_NVL as "XGMI" on AMD builds), else `pci` (through the host)."""
    links = profile.interconnect or {}
    gpu_link = links.get("gpu_link", "")
    if not links.get("gpu_link_gb_s"):
        return "pci"
    if _mesh_links(profile):
        return "nvlink"
    if not gpu_link.startswith("NVLink"):
        return "pci"
    if "bridge" in gpu_link:
        return "nvlink" if min(ranks, node_gpus(profile)) <= 2 else "pci"
    return "nvlink"


def _mesh_links(profile) -> int:
    """Each GPU's direct links where a node's GPUs are a full mesh (interconnect.gpu_links), else 0."""
    links = profile.interconnect or {}
    if not links.get("gpu_link_gb_s"):
        return 0
    return links.get("gpu_links") or 0


def _mesh_rate(profile, members: int, point_to_point: bool) -> tuple[float, str]:
    """One direction of what a GPU of a full mesh reaches talking to `members` - 1 others of its node: one
    direct link for a point-to-point send, and for a collective every link to the group's other members, as
    RCCL lays its rings (one per channel) over different links of the mesh. An MI300X's link is rated 64 GB/s a
    direction, of which about 48 (75%) is usable: CRC and protocol overhead (AMD, "Understanding RCCL Bandwidth
    and xGMI Performance on AMD Instinct MI300X", 2025); the datasheet rate is kept, as for NVLink."""
    links = profile.interconnect
    per_link = links["gpu_link_gb_s"] * 1e9 / links["gpu_links"] / 2
    used = 1 if point_to_point else max(1, min(members - 1, links["gpu_links"]))
    return used * per_link, (f"{links['gpu_link']}: {used} of its {links['gpu_links']} links "
                             f"({per_link * 2 / 1e9:g} GB/s both ways each)")


def link_bytes_s(profile, ranks: int, ring_stride: int | None = None,
                 point_to_point: bool = False) -> tuple[float | None, str]:
    """One direction of the slowest link a group spanning `ranks` consecutive GPUs crosses, and which link
    that is: inside a node NVLink (its datasheet figure is both directions), the links of a full mesh the
    group's members share (`point_to_point`: a send between two of them uses one), or, without either, the host
    link; between nodes a GPU's share of the node's network (one NIC per GPU, as DGX/HGX nodes have).

    `ring_stride`: the group runs ring collectives (NCCL all-reduce, all-gather, reduce-scatter) over
    members `ring_stride` GPUs apart (a data-parallel group under t-way tensor parallelism: t). NCCL runs one
    ring per NIC its members sit by, each carrying its share of the bytes across the node boundary, so the
    members' rate between nodes is the NICs of node_gpus / stride GPUs together: on 2 nodes of 8 x 100 Gb/s
    NICs a 16-GPU all-reduce reached 75 of their 100 GB/s bus bandwidth, "roughly matching our expectation"
    (NVIDIA/nccl#495), and NDR NICs give 46-48 GB/s each (NVIDIA/nccl-tests#290). Point-to-point sends
    (pipeline stages, all-to-all) leave through each GPU's own NIC.

    At the datasheet rate, an upper bound: nccl-tests' all-reduce bus bandwidth reaches about 70-92% of
    NVLink's one direction from A100 to B200 (user reports: NVIDIA/nccl-tests#149, #312, NVIDIA/nccl#1807).
    No derating is applied: the sharded runs overlap most communication with compute, and the network of
    the validation's 64-GPU A100 runs is not published; a 0.8 derating of every link moved those two rows of
    benchmarks/parallel_validation.py from -7.5% / -16.8% to -16.2% / -30.1% (2026-12-04)."""
    links = profile.interconnect or {}
    node = node_gpus(profile)
    nvlink, gpu_link = links.get("gpu_link_gb_s"), links.get("gpu_link", "")
    mesh = _mesh_links(profile)
    switched = intra_node_link(profile, node) == "nvlink" and "bridge" not in gpu_link and not mesh
    # The group's members inside one node (a strided group's are node / stride of them).
    members = min(ranks, node) if ring_stride is None else max(1, min(ranks, node) // ring_stride)
    if ranks > node:
        network = links.get("node_network_gb_s")
        if not network:
            return None, f"no inter-node bandwidth known for {profile.id} (interconnect.node_network_gb_s)"
        if ring_stride is None:
            return network * 1e9 / node, f"{network:g} GB/s node network, one of its {node} GPUs' share"
        nics = max(1, node // ring_stride)
        rate = network * 1e9 / node * nics
        if switched:
            rate = min(rate, nvlink * 1e9 / 2)  # the ring's hops inside a node run on NVLink
        elif mesh:
            rate = min(rate, _mesh_rate(profile, members, point_to_point)[0])
        return rate, (f"{network:g} GB/s node network, the rings through {nics} of its {node} NICs "
                      f"({rate / 1e9:,.0f} GB/s)")
    if mesh:
        return _mesh_rate(profile, members, point_to_point)
    if switched:
        return nvlink * 1e9 / 2, f"{gpu_link} ({nvlink:g} GB/s both ways)"
    if intra_node_link(profile, ranks) == "nvlink":
        # An NVLink bridge joins a pair of PCIe cards (H100 NVL, A100 PCIe): two consecutive GPUs talk over it,
        # a group of more crosses PCIe between pairs.
        return nvlink * 1e9 / 2, f"{gpu_link} of a GPU pair ({nvlink:g} GB/s both ways)"
    host = links.get("host_link_gb_s")
    if host:
        return host * 1e9 / 2, f"{links.get('host_link', 'host link')} through the host ({host:g} GB/s both ways)"
    return None, f"no GPU or host link bandwidth known for {profile.id}"


def collective_bytes(technique: str | None, dp: int, params: int, grads: int, micro_batches: int = 1,
                     root: int = 0, pipelined: bool = False) -> dict[str, float]:
    """Bytes each data-parallel rank sends per step, per phase the collective runs under. DDP and ZeRO-1
    all-reduce the gradients once per step (accumulating micro-batches without syncing); FSDP2, as it runs
    by default, gathers the parameters and reduce-scatters the gradients for every micro-batch, its `root`
    (the parameters outside the blocks) once for both passes.

    In a pipeline stage (`pipelined`), torch.distributed.pipelining keeps FSDP2 from resharding after a
    backward and from reduce-scattering before the last one: gradients are scattered once per step, and
    ZeRO-3 gathers a stage's blocks m + 1 times (every warm-up forward, then each backward after a forward
    that resharded them: 1F1B and GPipe alike), its root once. Counted on 4 gloo ranks with
    harness/measure/comm_volume.py: exactly these bytes."""
    if technique is None or dp == 1:
        return {}
    share = (dp - 1) / dp
    if technique == "data-parallel":
        return {"backward": 2 * share * grads}
    if technique == "zero1":
        return {"backward": 2 * share * grads, "optimizer": share * params}  # + the updated shards' broadcast
    if pipelined:
        gathers = 1 if technique == "fsdp-zero2" else micro_batches + 1
        blocks = params - root
        return {"forward": share * (root + min(gathers, micro_batches) * blocks),
                "backward": share * ((gathers - min(gathers, micro_batches)) * blocks + grads)}
    if technique == "fsdp-zero2":
        return {"forward": micro_batches * share * params, "backward": micro_batches * share * grads}
    # ZeRO-3 gathers the blocks again for the backward; the root stays gathered (FSDP2's default for it).
    return {"forward": micro_batches * share * params, "backward": micro_batches * share * (params - root + grads)}


def ddp_buckets(grads: float) -> int:
    """How many buckets DDP all-reduces `grads` bytes of gradients in: a first bucket of 1 MiB (DDP's
    `_DEFAULT_FIRST_BUCKET_BYTES`, so the first all-reduce starts early), then buckets of `bucket_cap_mb` (25 MiB)."""
    if grads <= DDP_FIRST_BUCKET_BYTES:
        return 1
    return 1 + -(-round(grads - DDP_FIRST_BUCKET_BYTES) // DDP_BUCKET_BYTES)


def data_parallel_collectives(technique: str | None, grads: float, blocks: int, tensors: int, micro_batches: int = 1,
                              pipelined: bool = False) -> dict[str, tuple[int, str]]:
    """How many collectives carry each phase's data-parallel bytes (`collective_bytes`), and the ring they run as
    (a reduce-scatter's is an all-gather's). DDP all-reduces its gradient buckets; ZeRO-1 also broadcasts each of
    its `tensors` trained parameters from the rank that stepped it (ZeroRedundancyOptimizer without a bucket view).
    FSDP2 runs one all-gather and one reduce-scatter per sharded unit (the `blocks`, and the root around them) and
    pass: the root's gather once per pass (it stays gathered to the backward), each block's again for the backward
    unless kept (ZeRO-2); in a pipeline stage the counts `collective_bytes` gives its bytes."""
    if technique is None:
        return {}
    if technique in ("data-parallel", "zero1"):
        counts = {"backward": (ddp_buckets(grads), "all_reduce")}
        if technique == "zero1":
            counts["optimizer"] = (tensors, "all_gather")
        return counts
    units = blocks + 1
    if pipelined:
        gathers = 1 if technique == "fsdp-zero2" else micro_batches + 1
        return {"forward": (1 + min(gathers, micro_batches) * blocks, "all_gather"),
                "backward": ((gathers - min(gathers, micro_batches)) * blocks + units, "all_gather")}
    regathered = 0 if technique == "fsdp-zero2" else blocks
    return {"forward": (micro_batches * units, "all_gather"),
            "backward": (micro_batches * (regathered + units), "all_gather")}


def exposed_s(seconds: dict[str, float], windows: dict[str, float], last_bucket_s: float = 0.0) -> float:
    """Communication seconds the step cannot hide, from each phase's collectives' `seconds`: collectives overlap
    the compute window of the phase they run under (FSDP prefetches the next block's gather, DDP all-reduces
    buckets as gradients are ready); whatever outlasts the window shows, and so does DDP's last bucket
    (`last_bucket_s`: its all-reduce starts when the backward ends). ZeRO-1's broadcasts follow the step."""
    total = last_bucket_s
    for phase, phase_s in seconds.items():
        total += phase_s if phase == "optimizer" else max(0.0, phase_s - windows.get(phase, 0.0))
    return total


def data_parallel_windows(technique: str | None, forward_s: float, backward_s: float, micro_batches: int
                          ) -> dict[str, float]:
    """The compute each phase's collectives can hide under: every micro-batch's for FSDP's per-micro-batch
    gathers, the last micro-batch's backward for DDP's once-per-step all-reduce."""
    repeats = micro_batches if technique in SHARDED else 1
    return {"forward": micro_batches * forward_s, "backward": repeats * backward_s}


def tensor_parallel_bytes(tp: int, sharded: int, elements: int, output_bytes: int, stream_bytes: int,
                          recomputed: bool = False, skipped_outputs: int = 0, sequence_ends: int = 0,
                          sequence_parallel: bool = False) -> float:
    """Bytes each tensor-parallel rank sends per micro-batch: every row-parallel output (`elements` of
    `output_bytes`) is all-reduced in the forward and the gradient of every column-parallel input (the
    norm's output, `stream_bytes`) in the backward, with no compute to hide under (Megatron's f and g
    operators, Shoeybi et al. 2019, figure 3). Checkpointing (`recomputed`) all-reduces the row-parallel
    outputs again but `skipped_outputs`: non-reentrant checkpointing stops recomputing once the tensors the
    backward needs are back, so a block's last output, which only feeds the residual add, is not (counted
    on gloo).

    Sequence parallelism (`sequence_parallel`; `sequence_ends`: the ends of the cut sequence this rank holds, 2 for
    the whole model, 1 for a pipeline's end stage, 0 for a middle one) all-gathers each norm's output and
    reduce-scatters each row-parallel output forward, their transposes backward: per module (t - 1) / t of one
    activation each, the same bytes as the all-reduces; a recomputed block gathers every norm's output again and
    scatters its outputs but the skipped; each end of the cut gathers the stream once more (the final norm's output
    forward, the entry's gradient backward)."""
    if tp == 1:
        return 0.0
    share = (tp - 1) / tp * elements
    outputs_again = sharded - skipped_outputs if recomputed else 0  # row-parallel outputs recomputed
    if sequence_parallel or sequence_ends:
        gathers = 2 * sharded + (sharded if recomputed else 0)  # stream: norms' outputs, their gradients
        return share * (gathers * stream_bytes + (2 * sharded + outputs_again) * output_bytes
                        + sequence_ends * stream_bytes)
    return 2 * share * ((sharded + outputs_again) * output_bytes + sharded * stream_bytes)


def tensor_parallel_collectives(tp: int, sharded: int, recomputed: bool = False, skipped_outputs: int = 0,
                                sequence_ends: int = 0, embedding: bool = False, head: bool = False,
                                gathered_logits: bool = False, sequence_parallel: bool = False) -> tuple[int, str]:
    """How many collectives a tensor-parallel rank runs per micro-batch, and which ring they run as: the transfers
    `tensor_parallel_bytes`, `vocabulary_parallel_bytes` and `norm_gradient_bytes_sent` count, one collective
    each. All-reduces without sequence parallelism (each sharded module's forward and backward, the recomputed
    ones, the embedding's, the head's input gradient and its logits' gather, or without the gather the parallel
    cross-entropy's three all-reduces); with it all-gathers and reduce-scatters, which take a ring's n - 1 steps
    (the vocabulary's and the norms' all-reduces counted among them: an undercount of their steps). The caller
    splits the bytes evenly over them, which charges the parallel cross-entropy's three tiny all-reduces the
    average message's protocol (tens of us a micro-batch)."""
    if tp == 1:
        return 0, "all_reduce"
    outputs_again = sharded - skipped_outputs if recomputed else 0
    norms = 1 if sequence_parallel else 0
    vocabulary = (1 if embedding else 0) + ((2 if gathered_logits else 4) if head else 0) + norms
    if sequence_parallel or sequence_ends:
        gathers = 2 * sharded + (sharded if recomputed else 0)
        return gathers + 2 * sharded + outputs_again + sequence_ends + vocabulary, "all_gather"
    return 2 * sharded + outputs_again + vocabulary, "all_reduce"


def vocabulary_parallel_bytes(tp: int, elements: int, stream_bytes: int, embedding: bool, head: bool,
                              gathered_logits: int, logits_bytes: int, tokens: int = 0) -> float:
    """Bytes each tensor-parallel rank sends per micro-batch for a vocabulary-parallel embedding and head
    (Megatron's, Shoeybi et al. 2019, section 3): the embedding's output (`elements` of the residual stream's
    `stream_bytes`) all-reduced in the forward; the head's input gradient all-reduced in the backward, and its
    `gathered_logits` elements all-gathered in the matmul's dtype, or, where none are (loss parallelism),
    three fp32 numbers per token of the micro-batch's `tokens` all-reduced by the parallel cross-entropy (the
    logits' maximum, the sum of their exponentials, the target's log-probability). Neither is recomputed by
    checkpointing."""
    if tp == 1:
        return 0.0
    share = (tp - 1) / tp
    sent = 2 * share * elements * stream_bytes if embedding else 0.0
    if head:
        sent += share * gathered_logits * logits_bytes + 2 * share * elements * stream_bytes
        if not gathered_logits:
            sent += 3 * 2 * share * tokens * 4
    return sent


def norm_gradient_bytes_sent(tp: int, norm_gradients: int) -> float:
    """Bytes each sequence-parallel rank sends per micro-batch to all-reduce its norms' gradients
    (`norm_gradients` bytes): each rank's are partial sums over its part of the sequence."""
    return 2 * (tp - 1) / tp * norm_gradients if tp > 1 else 0.0


def pipeline_bytes(pp: int, activation_bytes: int, micro_batches: int, tied_bytes: int) -> tuple[float, float]:
    """(bytes per micro-batch, bytes once per step) of the stage that sends most: a middle stage sends its
    output forward and its input's gradient backward; the first and the last send one of them per micro-batch
    and all-reduce the gradient of a weight they both hold (a tied embedding: 2 (n - 1) / n of it, n = 2)."""
    if pp == 1:
        return 0.0, 0.0
    if pp > 2 and 2 * activation_bytes * micro_batches > activation_bytes * micro_batches + tied_bytes:
        return 2.0 * activation_bytes, 0.0
    return float(activation_bytes), float(tied_bytes)
