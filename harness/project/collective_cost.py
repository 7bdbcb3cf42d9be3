"""What one ring collective costs, by NCCL's own model of it (RCCL's on AMD GPUs): a latency per collective and
ring step, then the bytes at the share of the link the protocol leaves for data, in whichever protocol the model
finds fastest, as NCCL picks. Written by hand because neither library exposes its tuning model; the figures are
copied from its source, cited below. Which link a group uses comes from communication.intra_node_link, the same
classing that prices its bytes (communication.link_bytes_s).
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


def _figures(profile) -> dict[str, dict[str, float]]:
    """The protocols' figures of the collective library a profile's GPUs run: RCCL on AMD's, NCCL on the rest."""
    return RING_PROTOCOLS["rccl" if profile.vendor == "amd" else "nccl"]


def _protocols(profile, ranks: int) -> dict[str, dict[str, float]]:
    """The protocols NCCL (or RCCL) may run a ring in: LL128 only over NVLink, where NCCL enables it by default."""
    protocols = _figures(profile)
    if intra_node_link(profile, ranks) != "nvlink":
        protocols = {name: figures for name, figures in protocols.items() if name != "LL128"}
    return protocols


def ring_latency_s(profile, ranks: int, collective: str, protocol: str = "LL") -> float:
    """Seconds a ring `collective` over `ranks` consecutive GPUs takes in `protocol` before its bytes count:
    the base latency plus one per ring step, each over the group's link inside a node (`intra_node_link`)
    or, for the steps that leave a node, the network."""
    if ranks <= 1:
        return 0.0
    figures = _figures(profile)[protocol]
    nodes = -(-ranks // node_gpus(profile))
    steps, network = RING_STEPS[collective](ranks), NETWORK_STEPS[collective](nodes)
    intra = figures[intra_node_link(profile, ranks)]
    if nodes > 1:
        intra = max(intra, NETWORK_OVERHEAD_US[protocol])
    return (figures["base"] + (steps - network) * intra + network * figures["network"]) * 1e-6


def ring_collective_s(profile, ranks: int, collective: str, sent_bytes: float, link_bytes_s: float) -> float:
    """Seconds of one ring `collective` over `ranks` GPUs in which each rank sends `sent_bytes` over a link of
    `link_bytes_s`: NCCL's model of each protocol (its latency, plus the bytes at its share of the link), at
    the protocol that model finds fastest, as NCCL chooses."""
    if ranks <= 1:
        return 0.0
    return min(ring_latency_s(profile, ranks, collective, protocol)
               + sent_bytes / (link_bytes_s * BANDWIDTH_SHARE[protocol]) for protocol in _protocols(profile, ranks))
