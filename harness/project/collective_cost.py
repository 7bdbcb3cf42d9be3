"""What one collective costs, by NCCL's own model of it (RCCL's on AMD GPUs): a latency per collective and
step, then the bytes at the share of the link the protocol leaves for data, in whichever algorithm (a ring, or for
an all-reduce also a tree) and protocol the model finds fastest, as NCCL picks. Written by hand because neither
library exposes its tuning model; the figures are copied from its source, cited below. Which link a group uses
comes from communication.intra_node_link, the same classing that prices its bytes (communication.link_bytes_s).
NCCL's NVLink SHARP (NVLS) and CollNet algorithms, which need NVSwitch or switch-side reduction support and are
chosen by hardware this model does not see, are left out: where NCCL runs them, it finds them faster than these.
"""

from __future__ import annotations

from harness.project.communication import intra_node_link, node_gpus

# NCCL's own cost model of a ring collective, as NVIDIA/nccl v2.23 has it (src/graph/tuning.cc), per protocol: a
# base latency, a latency per ring step over NVLink, PCIe or the network, and the share of the link's bandwidth the
# protocol's data gets (LL sends 4 bytes of data in each 8-byte flag word: half; LL128 120 of 128 bytes: 0.92;
# Simple all of it). NCCL runs each collective in the protocol its model finds fastest (LL128 only over NVLink,
# where it is enabled by default; on Blackwell from v2.26):
# - LL for the kilobytes of a decode step: 7.8 / 10.2 / 15.0 us per all-reduce on 2 / 4 / 8 NVLink GPUs. sglang's
#   CUDA-graph captured 8-GPU H100 all-reduces measure 16.8-17.8 us (sgl-project/sglang#22734), within 20% of 15.
# - LL128 or Simple for a training step's megabytes.
# A ring across nodes pays the network's latency on the steps that leave a node, and on the others at least the
# network's per-step overhead (1 us, tripled for Simple; NCCL's figure for Intel hosts, 2 us on AMD hosts).
# AMD's RCCL keeps the model with its own latencies (ROCm/rccl src/graph/tuning.cc: base Ring LL 12.0 / Simple
# 17.0 us; per step LL 0.8 / Simple 3.6 us over xGMI, 2.2 / 5.7 over PCIe) and no LL128 here; its network
# latencies and bandwidth shares vary by platform in its tables, so NCCL's stand in.
RING_PROTOCOLS = {
    "nccl": {"LL": {"base": 6.6, "nvlink": 0.6, "pci": 1.0, "network": 2.7},
             "LL128": {"base": 14.0, "nvlink": 1.9, "pci": 2.5, "network": 4.0},
             "Simple": {"base": 8.4, "nvlink": 3.4, "pci": 5.7, "network": 14.0}},
    "rccl": {"LL": {"base": 12.0, "nvlink": 0.8, "pci": 2.2, "network": 2.7},
             "Simple": {"base": 17.0, "nvlink": 3.6, "pci": 5.7, "network": 14.0}},
}
BANDWIDTH_SHARE = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
NETWORK_OVERHEAD_US = {"LL": 1.0, "LL128": 1.0, "Simple": 3.0}
# Ring steps of a collective over n ranks, and those that cross the network on k nodes (tuning.cc's nsteps and
# nInterSteps). A reduce-scatter runs as an all-gather does.
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1}
NETWORK_STEPS = {"all_reduce": lambda k: 2 * (k - 1), "all_gather": lambda k: k - 1}


# NCCL's tree, which it runs only for all-reduces: a chain through each node's GPUs and a double binary tree
# between nodes, so its latency grows with the log of the nodes where a ring's grows with the ranks (tuning.cc:
# base + 2 ((ranks per node - 1) intra + log2(nodes) inter); Tree's own per-step latencies below, RCCL's on AMD).
# Each rank sends the whole buffer up and receives it down: twice the buffer, at 0.92 of the link, LL at
# 1 / 3.8 of that and LL128 at 7/9 inside one node, 120/128 across nodes; and NCCL's own correction for medium
# sizes (treeCorrectionFactor, per power of two from 64 B) slows it further; RCCL's own per-architecture correction
# tables are not copied: NCCL's stands in for them, as its network latencies and bandwidth shares do.
TREE_PROTOCOLS = {
    "nccl": {"LL": {"base": 6.8, "nvlink": 0.6, "pci": 1.0, "network": 5.0},
             "LL128": {"base": 14.0, "nvlink": 1.25, "pci": 1.9, "network": 8.5},
             "Simple": {"base": 8.4, "nvlink": 4.0, "pci": 4.0, "network": 14.0}},
    "rccl": {"LL": {"base": 12.0, "nvlink": 0.8, "pci": 2.2, "network": 5.0},
             "Simple": {"base": 17.0, "nvlink": 2.5, "pci": 5.7, "network": 14.0}},
}
TREE_ALL_REDUCE_SHARE = 0.92
TREE_BANDWIDTH_SHARE = {"LL": 1 / 3.8, "LL128": 120 / 128, "Simple": 1.0}
TREE_LL128_ONE_NODE = 7 / 9
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
# A Simple ring all-reduce across nodes pays 1.4x its latency (1.9x before Ampere): NCCL's "plateau effect of ring".
RING_PLATEAU = {"pre-ampere": 1.9, "default": 1.4}
PRE_AMPERE = ("volta", "turing", "pascal")


def _library(profile) -> str:
    """The collective library a profile's GPUs run: RCCL on AMD's, NCCL on the rest."""
    return "rccl" if profile.vendor == "amd" else "nccl"


def _figures(profile) -> dict[str, dict[str, float]]:
    """The ring protocols' figures of the collective library a profile's GPUs run."""
    return RING_PROTOCOLS[_library(profile)]


def _group(profile, ranks: int, stride: int) -> tuple[int, int, str]:
    """(ranks per node, nodes, the link inside a node) of a group of `ranks` GPUs `stride` apart (a data-parallel
    group under `stride`-way tensor parallelism): a node holds node_gpus / stride of them, at least one."""
    node = node_gpus(profile)
    per_node = min(ranks, max(1, node // stride))
    return per_node, -(-ranks // per_node), intra_node_link(profile, min(node, per_node * stride))


def _protocols(profile, link: str, table: dict) -> dict[str, dict[str, float]]:
    """The protocols NCCL (or RCCL) may run in: LL128 only over NVLink, where NCCL enables it by default."""
    return {name: figures for name, figures in table.items() if name != "LL128" or link == "nvlink"}


def ring_latency_s(profile, ranks: int, collective: str, protocol: str = "LL", stride: int = 1) -> float:
    """Seconds a ring `collective` over `ranks` GPUs `stride` apart takes in `protocol` before its bytes count:
    the base latency plus one per ring step, each over the group's link inside a node (`intra_node_link`)
    or, for the steps that leave a node, the network (at the tree's network latency where a node holds one member:
    NCCL's "with ppn=1 latencies are fully exposed")."""
    if ranks <= 1:
        return 0.0
    figures = _figures(profile)[protocol]
    per_node, nodes, link = _group(profile, ranks, stride)
    steps, network = RING_STEPS[collective](ranks), NETWORK_STEPS[collective](nodes)
    intra = figures[link]
    inter = TREE_PROTOCOLS[_library(profile)][protocol]["network"] if per_node == 1 else figures["network"]
    if nodes > 1:
        intra = max(intra, NETWORK_OVERHEAD_US[protocol])
    latency = figures["base"] + (steps - network) * intra + network * inter
    # NCCL applies it where a rank's share of a channel is at least 64 bytes: any message Simple is chosen for.
    # RCCL has no such factor.
    if nodes > 1 and collective == "all_reduce" and protocol == "Simple" and _library(profile) == "nccl":
        latency *= RING_PLATEAU["pre-ampere" if profile.generation in PRE_AMPERE else "default"]
    return latency * 1e-6


def tree_latency_s(profile, ranks: int, protocol: str = "LL", stride: int = 1) -> float:
    """Seconds NCCL's tree all-reduce over `ranks` GPUs `stride` apart takes in `protocol` before its bytes count:
    its base latency, then up and down a chain through each node's members and a tree of depth log2(nodes)."""
    if ranks <= 1:
        return 0.0
    figures = TREE_PROTOCOLS[_library(profile)][protocol]
    per_node, nodes, link = _group(profile, ranks, stride)
    depth = nodes.bit_length() - 1  # NCCL's log2i: the floor of log2
    return (figures["base"] + 2 * ((per_node - 1) * figures[link] + depth * figures["network"])) * 1e-6


def _tree_s(profile, ranks: int, protocol: str, buffer_bytes: float, link_bytes_s: float, stride: int) -> float:
    """Seconds of NCCL's tree all-reduce of a `buffer_bytes` buffer in `protocol`."""
    _, nodes, _ = _group(profile, ranks, stride)
    share = TREE_ALL_REDUCE_SHARE * (TREE_LL128_ONE_NODE if protocol == "LL128" and nodes == 1
                                     else TREE_BANDWIDTH_SHARE[protocol])
    size_class = int(buffer_bytes) >> 6
    correction = TREE_CORRECTION[protocol]
    if 0 < size_class and size_class.bit_length() - 1 < len(correction):
        share *= correction[size_class.bit_length() - 1]
    return tree_latency_s(profile, ranks, protocol, stride) + 2 * buffer_bytes / (link_bytes_s * share)


def ring_collective_s(profile, ranks: int, collective: str, sent_bytes: float, link_bytes_s: float,
                      stride: int = 1) -> float:
    """Seconds of one ring `collective` over `ranks` GPUs `stride` apart in which each rank sends `sent_bytes` over
    a link of `link_bytes_s`: NCCL's model of each protocol (its latency, plus the bytes at its share of the link),
    at the protocol that model finds fastest, as NCCL chooses."""
    if ranks <= 1:
        return 0.0
    link = _group(profile, ranks, stride)[2]
    return min(ring_latency_s(profile, ranks, collective, protocol, stride)
               + sent_bytes / (link_bytes_s * BANDWIDTH_SHARE[protocol])
               for protocol in _protocols(profile, link, _figures(profile)))


def collective_s(profile, ranks: int, collective: str, sent_bytes: float, link_bytes_s: float,
                 stride: int = 1) -> float:
    """Seconds of one `collective` as NCCL runs it: a ring (`ring_collective_s`), or for an all-reduce NCCL's tree
    where its model finds that faster (many nodes, small buffers); `sent_bytes` is what each rank sends in a ring,
    2 (n - 1) / n of an all-reduce's buffer."""
    ring = ring_collective_s(profile, ranks, collective, sent_bytes, link_bytes_s, stride)
    if ranks <= 1 or collective != "all_reduce":
        return ring
    buffer = sent_bytes * ranks / (2 * (ranks - 1))
    link = _group(profile, ranks, stride)[2]
    trees = (_tree_s(profile, ranks, protocol, buffer, link_bytes_s, stride)
             for protocol in _protocols(profile, link, TREE_PROTOCOLS[_library(profile)]))
    return min(ring, *trees)
