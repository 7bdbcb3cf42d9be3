"""Collectives at NCCL's cost model (harness/project/collective_cost.py): the protocol NCCL would pick for a
message's size, the steps that leave a node, its tree for all-reduces across many nodes; and, from communication.py,
the link a group uses and how many collectives a tensor-parallel micro-batch or a data-parallel step runs."""

from __future__ import annotations

import pytest

from harness.profiles import load_profiles
from harness.project.collective_cost import collective_s, ring_collective_s, ring_latency_s, tree_latency_s
from harness.project.communication import (
    data_parallel_collectives,
    ddp_buckets,
    intra_node_link,
    link_bytes_s,
    tensor_parallel_collectives,
)
from tests.test_parallel_projection import _projected

PROFILES = load_profiles()
H100 = PROFILES["h100-sxm"].per_device()


def test_a_decode_steps_kilobytes_go_by_ll_and_a_training_steps_megabytes_by_ll128_or_simple():
    link, _ = link_bytes_s(H100, 8)
    # LL: NCCL's low-latency protocol, its 14 NVLink steps at 0.6 us and half the link (4 data bytes in 8).
    assert ring_collective_s(H100, 8, "all_reduce", 24e3, link) == pytest.approx(
        (6.6 + 14 * 0.6) * 1e-6 + 24e3 / (link / 2))
    # LL128 over NVLink: 14 us base, 1.9 us a step, 0.92 of the link; fastest for tens of megabytes.
    assert ring_collective_s(H100, 8, "all_reduce", 32e6, link) == pytest.approx(
        (14.0 + 14 * 1.9) * 1e-6 + 32e6 / (0.92 * link))
    # Simple: 8.4 us base, 3.4 us a step, the whole link; fastest for a gigabyte.
    assert ring_collective_s(H100, 8, "all_reduce", 1e9, link) == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + 1e9 / link)
    # Over PCIe there is no LL128: Simple, with 5.7 us a step.
    l4 = PROFILES["l4"].per_device()
    pcie, _ = link_bytes_s(l4, 4)
    assert ring_collective_s(l4, 4, "all_reduce", 32e6, pcie) == pytest.approx((8.4 + 6 * 5.7) * 1e-6 + 32e6 / pcie)


def test_amd_rings_take_rccls_latencies_over_infinity_fabric():
    # RCCL's per-step latencies over xGMI (its NVLink link type): LL 0.8 us, Simple 3.6 us.
    mi300x = PROFILES["mi300x"].per_device()
    link, _ = link_bytes_s(mi300x, 2)
    assert ring_collective_s(mi300x, 2, "all_reduce", 8e3, link) == pytest.approx(
        (12.0 + 2 * 0.8) * 1e-6 + 8e3 / (link / 2))
    assert ring_collective_s(mi300x, 2, "all_reduce", 1e9, link) == pytest.approx((17.0 + 2 * 3.6) * 1e-6 + 1e9 / link)


def test_a_full_mesh_gives_a_collective_one_link_per_other_member_and_a_send_one_link():
    # MI300X: 7 Infinity Fabric links of 128 GB/s both ways, one to each other GPU of the node.
    mi300x = PROFILES["mi300x"].per_device()
    assert link_bytes_s(mi300x, 2)[0] == pytest.approx(64e9)
    assert link_bytes_s(mi300x, 4)[0] == pytest.approx(3 * 64e9)
    assert link_bytes_s(mi300x, 8)[0] == pytest.approx(7 * 64e9)
    # A pipeline stage's send to the next uses the one link between them, however wide the span.
    assert link_bytes_s(mi300x, 8, point_to_point=True)[0] == pytest.approx(64e9)
    # A data-parallel group strided 2 apart (2-way tensor parallelism) has 4 members in the node: 3 links.
    assert link_bytes_s(mi300x, 8, ring_stride=2)[0] == pytest.approx(3 * 64e9)
    # An NVSwitch node gives every group the whole NVLink, whatever its size.
    assert link_bytes_s(H100, 2)[0] == link_bytes_s(H100, 8)[0] == link_bytes_s(H100, 8, point_to_point=True)[0]


def test_a_ring_across_two_nodes_pays_the_networks_latency_on_the_steps_that_leave_a_node():
    # 16 GPUs on 2 nodes of 8: an all-reduce's 30 steps, 2 of them over the network (2.7 us each in LL); the rest
    # over NVLink at 0.6 us, but at least the network's 1 us per-step overhead (3 us in Simple).
    assert ring_latency_s(H100, 16, "all_reduce") * 1e6 == pytest.approx(6.6 + 28 * 1.0 + 2 * 2.7)
    assert ring_latency_s(H100, 16, "all_gather", "Simple") * 1e6 == pytest.approx(8.4 + 14 * 3.4 + 1 * 14.0)
    # A bridged pair's group past a node: PCIe inside each node.
    h100_pcie = PROFILES["h100-pcie"].per_device()
    assert intra_node_link(h100_pcie, 16) == "pci"


@pytest.mark.parametrize("gpu,ranks,link", [("h100-sxm", 8, "nvlink"), ("h100-pcie", 2, "nvlink"),
                                            ("h100-pcie", 4, "pci"), ("l4", 2, "pci"), ("mi300x", 8, "nvlink")])
def test_the_latency_and_the_bandwidth_of_a_group_come_from_one_classing_of_its_link(gpu, ranks, link):
    profile = PROFILES[gpu].per_device()
    assert intra_node_link(profile, ranks) == link
    described = link_bytes_s(profile, ranks)[1]
    assert ("NVLink" in described or "Infinity Fabric" in described) == (link == "nvlink")


def test_a_tensor_parallel_micro_batch_runs_two_collectives_per_sharded_module_and_the_vocabularys():
    # 12 blocks, attention and MLP sharded: forward and backward all-reduces, the embedding's, and the head's input
    # gradient with the parallel cross-entropy's three, or with the gather of its logits under a pipeline.
    assert tensor_parallel_collectives(4, 24, embedding=True, head=True) == (48 + 1 + 4, "all_reduce")
    assert tensor_parallel_collectives(4, 24, head=True, gathered_logits=True) == (48 + 2, "all_reduce")
    # Checkpointing all-reduces the row-parallel outputs again, but the 12 blocks' last ones.
    assert tensor_parallel_collectives(4, 24, recomputed=True, skipped_outputs=12) == (48 + 12, "all_reduce")
    # Sequence parallelism: a gather and a scatter per module each way, the ends of the cut, the norms' all-reduce;
    # a pipeline's middle stage holds no end of the cut but gathers and scatters all the same.
    assert tensor_parallel_collectives(4, 24, sequence_ends=2, sequence_parallel=True) == (96 + 2 + 1, "all_gather")
    assert tensor_parallel_collectives(4, 24, sequence_parallel=True) == (96 + 1, "all_gather")
    assert tensor_parallel_collectives(1, 24) == (0, "all_reduce")


def test_a_tensor_parallel_training_step_waits_on_each_collectives_latency_not_only_its_bytes():
    outcome = _projected("tensor-parallel:t=4+amp-bf16", 4, size="gpt2-124m", batch=8)
    assert outcome.status == "ok", outcome.reason
    note = next(note for note in outcome.notes if note.startswith("tensor parallel sends"))
    assert "in 53 all-reduces over NVLink4" in note
    sent_mib, on_path_ms = (float(note.split(" MiB")[0].split()[-1].replace(",", "")),
                            float(note.split("critical path: ")[1].split(" ms")[0]))
    link = link_bytes_s(H100, 4)[0]
    # Each of the 53 at NCCL's model, the bytes split evenly: above the bytes alone by 53 latencies.
    assert on_path_ms == pytest.approx(53 * ring_collective_s(H100, 4, "all_reduce", sent_mib * 2**20 / 53, link) * 1e3,
                                       rel=0.01)


def test_a_tree_all_reduce_climbs_log2_of_the_nodes_where_a_ring_walks_every_rank():
    # 64 GPUs on 8 nodes, LL: up and down a chain of 7 NVLink hops and a tree 3 deep, against the ring's 126 steps
    # (14 of them over the network, the rest at least the network's 1 us overhead).
    assert tree_latency_s(H100, 64) * 1e6 == pytest.approx(6.8 + 2 * (7 * 0.6 + 3 * 5.0))
    assert ring_latency_s(H100, 64, "all_reduce") * 1e6 == pytest.approx(6.6 + 112 * 1.0 + 14 * 2.7)
    # A simple ring all-reduce across nodes pays NCCL's "plateau" factor: 1.4 from Ampere on, 1.9 before.
    assert ring_latency_s(H100, 16, "all_reduce", "Simple") * 1e6 == pytest.approx(1.4 * (8.4 + 28 * 3.4 + 2 * 14.0))
    v100 = PROFILES["v100-sxm2-32gb"].per_device()
    assert ring_latency_s(v100, 16, "all_reduce", "Simple") == pytest.approx(
        1.9 / 1.4 * ring_latency_s(H100, 16, "all_reduce", "Simple"))


def test_nccl_runs_a_small_all_reduce_over_many_nodes_as_a_tree_and_a_large_one_in_a_node_as_a_ring():
    link = link_bytes_s(H100, 1024)[0]
    sent = 2 * 1023 / 1024 * 1e6  # a 1 MB buffer over 1,024 GPUs on 128 nodes
    assert collective_s(H100, 1024, "all_reduce", sent, link) < 0.1 * ring_collective_s(
        H100, 1024, "all_reduce", sent, link)
    assert collective_s(H100, 1024, "all_reduce", sent, link) > tree_latency_s(H100, 1024)
    # Inside a node a tree is a chain that sends twice the buffer at 0.92 of the link: the ring wins a gigabyte.
    nvlink = link_bytes_s(H100, 8)[0]
    assert collective_s(H100, 8, "all_reduce", 1e9, nvlink) == ring_collective_s(H100, 8, "all_reduce", 1e9, nvlink)
    # All-gathers and reduce-scatters have no tree.
    assert collective_s(H100, 1024, "all_gather", 1e6, link) == ring_collective_s(H100, 1024, "all_gather", 1e6, link)


def test_a_data_parallel_group_under_node_wide_tensor_parallelism_has_one_member_per_node():
    # d = 4 ranks 8 GPUs apart (t = 8): every ring step leaves a node, at the tree's network latency (NCCL: "with
    # ppn=1 latencies are fully exposed"), and a tree has no chain inside a node.
    assert ring_latency_s(H100, 4, "all_reduce", stride=8) * 1e6 == pytest.approx(6.6 + 6 * 5.0)
    assert tree_latency_s(H100, 4, stride=8) * 1e6 == pytest.approx(6.8 + 2 * 2 * 5.0)
    # 2-way tensor parallelism leaves 4 members in a node of 8.
    assert ring_latency_s(H100, 8, "all_gather", stride=2) * 1e6 == pytest.approx(6.6 + 6 * 1.0 + 1 * 2.7)


def test_a_data_parallel_step_counts_ddps_buckets_and_fsdps_gathers_and_scatters():
    # DDP: a first bucket of 1 MiB, then 25 MiB ones; ZeRO-1 broadcasts each trained tensor too.
    assert ddp_buckets(2**20) == 1
    assert ddp_buckets(500 * 2**20) == 1 + 20
    assert data_parallel_collectives("zero1", 500 * 2**20, 0, 148) == {"backward": (21, "all_reduce"),
                                                                       "optimizer": (148, "all_gather")}
    # FSDP2 over 12 blocks and the root, 2 accumulated passes: each pass gathers the 13 units forward, the 12 blocks
    # again backward, and scatters the 13 gradients; ZeRO-2 keeps the blocks gathered for the backward.
    assert data_parallel_collectives("fsdp", 1.0, 12, 148, micro_batches=2) == {
        "forward": (26, "all_gather"), "backward": (50, "all_gather")}
    assert data_parallel_collectives("fsdp-zero2", 1.0, 12, 148) == {"forward": (13, "all_gather"),
                                                                      "backward": (13, "all_gather")}
    # In a pipeline stage of 4 micro-batches: the root once, the blocks m + 1 times, the gradients scattered once.
    assert data_parallel_collectives("fsdp", 1.0, 12, 148, micro_batches=4, pipelined=True) == {
        "forward": (1 + 48, "all_gather"), "backward": (12 + 13, "all_gather")}


def test_a_small_model_sharded_over_a_thousand_gpus_waits_on_its_collectives_latency():
    # gpt2-124m under FSDP, 4 samples per GPU: 8 GPUs hide their gathers under compute; on 1,024 each of the 38
    # gathers and scatters per step walks a ring of 1,023 steps, milliseconds of latency the step cannot hide.
    small, large = (_projected("fsdp+amp-bf16", world, size="gpt2-124m", batch=4 * world) for world in (8, 1024))
    assert small.status == large.status == "ok", (small.reason, large.reason)
    assert large.speed.step_time_ms_p50 > 1.5 * small.speed.step_time_ms_p50
    note = next(note for note in large.notes if note.startswith("data-parallel communication"))
    assert "in 38 collectives" in note
