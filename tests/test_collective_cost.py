"""Ring collectives at NCCL's cost model (harness/project/collective_cost.py): the protocol NCCL would pick for a
message's size, the steps that leave a node; and, from communication.py, the link a group uses and how many
collectives a tensor-parallel micro-batch runs."""

from __future__ import annotations

import pytest

from harness.profiles import load_profiles
from harness.project.collective_cost import ring_collective_s, ring_latency_s
from harness.project.communication import (
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


def test_amd_rings_take_rccls_latencies():
    mi300x = PROFILES["mi300x"].per_device()
    link, _ = link_bytes_s(mi300x, 2)
    assert ring_collective_s(mi300x, 2, "all_reduce", 8e3, link) == pytest.approx(
        (12.0 + 2 * 2.2) * 1e-6 + 8e3 / (link / 2))
    assert ring_collective_s(mi300x, 2, "all_reduce", 1e9, link) == pytest.approx((17.0 + 2 * 5.7) * 1e-6 + 1e9 / link)


def test_a_ring_across_two_nodes_pays_the_networks_latency_on_the_steps_that_leave_a_node():
    # 16 GPUs on 2 nodes of 8: an all-reduce's 30 steps, 2 of them over the network (2.7 us each in LL); the rest
    # over NVLink at 0.6 us, but at least the network's 1 us per-step overhead (3 us in Simple).
    assert ring_latency_s(H100, 16, "all_reduce") * 1e6 == pytest.approx(6.6 + 28 * 1.0 + 2 * 2.7)
    assert ring_latency_s(H100, 16, "all_gather", "Simple") * 1e6 == pytest.approx(8.4 + 14 * 3.4 + 1 * 14.0)
    # A bridged pair's group past a node: PCIe inside each node.
    h100_pcie = PROFILES["h100-pcie"].per_device()
    assert intra_node_link(h100_pcie, 16) == "pci"


@pytest.mark.parametrize("gpu,ranks,link", [("h100-sxm", 8, "nvlink"), ("h100-pcie", 2, "nvlink"),
                                            ("h100-pcie", 4, "pci"), ("l4", 2, "pci"), ("mi300x", 8, "pci")])
def test_the_latency_and_the_bandwidth_of_a_group_come_from_one_classing_of_its_link(gpu, ranks, link):
    profile = PROFILES[gpu].per_device()
    assert intra_node_link(profile, ranks) == link
    described = link_bytes_s(profile, ranks)[1]
    assert ("NVLink" in described) == (link == "nvlink")


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
