"""Parallel stacks projected to N GPUs (harness/project/parallel.py): what each rank keeps under data,
tensor and pipeline parallelism, the links its sends cross, and the questions a buyer asks (`--dp`,
`--tp`, `--pp`, `--min-gpus`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project_outcome
from harness.project.communication import collective_bytes, link_bytes_s, pipeline_bytes
from harness.project.parallel import _root_bytes, rank_memory
from harness.project.query import ProjectRequest, projected_rows
from suites.techniques import Unsupported
from suites.workloads import WORKLOADS

PROFILES = load_profiles()
GIB = 2**30
# One rank's unsharded figures at each phase's peak (a toy trace): 100 bytes of parameters, as many of
# gradients, 200 of optimizer state; the optimizer step's temporaries are a parameter-sized 100. The backward
# peaks first at the loss and head (only the root's 20 bytes of gradients made yet), then in the blocks.
AT_PEAK = {"forward": {"params": 100, "activations": 50},
           "backward": {"params": 100, "grads": 20, "optimizer": 200, "activations": 60},
           "backward_blocks": {"params": 100, "grads": 100, "optimizer": 200, "activations": 50},
           "optimizer": {"params": 100, "grads": 100, "optimizer": 200, "temporaries": 100}}


def _rank(technique: str, dp: int = 4):
    return rank_memory(technique, dp, AT_PEAK, (100, 100, 200), block_params=10, block_grads=10, root_params=20,
                       root_grads=20)


def test_each_technique_keeps_the_model_states_zero_says_it_does():
    ddp, zero1, zero2, fsdp, offload = (_rank(t) for t in ("data-parallel", "zero1", "fsdp-zero2", "fsdp",
                                                           "cpu-offload"))
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.peak) == (100, 100, 200, 500 + 100)  # + its grad buckets
    # State / 4; its peak is now the backward's (the optimizer step's scratch shrank to 25 with its shard).
    assert (zero1.optimizer, zero1.peak) == (50, 100 + 100 + 50 + 50 + 100)
    assert (zero2.params, zero2.grads, zero2.optimizer) == (25, 25, 50)
    # Its parameters stay whole (beside their shard) from the forward's end through the backward, and the
    # root's gradients whole until the backward ends: its peak is in the blocks' backward.
    assert zero2.peak == 100 + 25 + (20 + 80 // 4) + 50 + 50 + 10
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (25, 25, 50)
    # The root (20) stays gathered through forward and backward; the head's backward has the last block
    # prefetched, the blocks' backward two blocks gathered and one block's gradients before scattering.
    assert fsdp.peak == max(25 + 50 + 2 * 10 + 20, 25 + 20 + 50 + 60 + 10 + 20,
                            25 + (20 + 80 // 4) + 50 + 50 + 2 * 10 + 10 + 20, 25 + 25 + 50 + 25)
    assert offload.peak == 20 + 50 + 2 * 10 + 10 + 20 and offload.host == 25 + 25 + 50  # shards in host memory


def test_a_rank_says_in_which_phase_it_peaks_and_what_temporaries_it_holds_there():
    # The row's temporaries are the rank's at its own peak: DDP's whole optimizer-step scratch, nothing where a
    # sharded rank peaks in the backward (the unsharded trace's peak, the optimizer step's, is not the rank's).
    ddp, fsdp = _rank("data-parallel"), _rank("fsdp")
    assert (ddp.phase, ddp.temporaries) == ("optimizer", 100)
    assert (fsdp.phase, fsdp.temporaries) == ("backward_blocks", 0)
    lean = rank_memory("fsdp", 4, {"optimizer": AT_PEAK["optimizer"]}, (100, 100, 200), block_params=10,
                       block_grads=10)
    assert (lean.phase, lean.temporaries) == ("optimizer", 25)  # the step's scratch, sharded with its parameters


def test_a_pipeline_stage_holds_its_gradients_whole_and_fsdp_its_parameters_gathered_through_the_schedule():
    # torch.distributed.pipelining accumulates over the micro-batches with FSDP's resharding and gradient sync
    # off until the last backward: from the second micro-batch on, the stage holds every gradient unsharded,
    # and every parameter gathered beside its shard; its receive buffers are kept throughout.
    def stage(technique, scheduled=("forward", "backward")):
        return rank_memory(technique, 4, AT_PEAK, (100, 100, 200), block_params=10, block_grads=10,
                           scheduled=scheduled, buffers=7)

    plain, fsdp, ddp = stage(None), stage("fsdp"), stage("data-parallel")
    assert plain.peak == max(100 + 100 + 50, 100 + 100 + 200 + 60, 100 + 100 + 200 + 100) + 7
    assert fsdp.peak == max(100 + 25 + 100 + 50, 100 + 25 + 100 + 50 + 60, 25 + 25 + 50 + 25) + 7
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (25, 25, 50)  # between steps: sharded as ever
    assert ddp.peak == plain.peak + 100  # its buckets
    assert _rank("fsdp").peak < fsdp.peak
    # GPipe runs every forward before any backward: its forwards gather blocks one at a time, no gradients yet.
    gpipe = rank_memory("fsdp", 4, {"forward": AT_PEAK["forward"]}, (100, 100, 200), block_params=10,
                        block_grads=10, scheduled=("backward",), buffers=7)
    assert gpipe.peak == 25 + 50 + 20 + 7


def test_fsdp_gathers_a_moe_blocks_experts_unless_each_rank_holds_its_own():
    from harness.project.parallel import _largest_block
    from suites.techniques.expert import moe_layers
    from suites.workloads import WORKLOADS

    workload = WORKLOADS["gpt"]
    model = workload.build(workload.sizes["moe-smoke"])
    experts = sum(p.numel() for p in moe_layers(model)[0].expert_parameters())
    whole = _largest_block(model, workload, 4, own_experts=False)
    assert whole - _largest_block(model, workload, 4, own_experts=True) == 4 * experts > 0


def test_the_trace_splits_the_backward_where_the_first_gradient_reaches_a_block():
    # FSDP gathers blocks only once their backward starts: before that (the loss and the head) the trace's
    # gradients are the root's alone; from there on the blocks' are added.
    from harness.project.trace import traced

    cell = Cell("gpt", "smoke", "train", "baseline", "h100-sxm", 4, "projected").resolve(PROFILES)
    trace = traced(cell)
    assert set(trace.phase_peaks) == {"forward", "backward", "backward_blocks", "backward_last_block", "optimizer"}
    workload = WORKLOADS["gpt"]
    model = workload.build(workload.sizes["smoke"])
    root = _root_bytes(model, workload, 4)  # fp32: embeddings, final norm, head
    assert trace.phase_at_peak["backward"].get("grads", 0) <= root < trace.grads_bytes
    assert trace.phase_at_peak["backward_blocks"]["grads"] > trace.phase_at_peak["backward"].get("grads", 0)


def test_collectives_are_ring_volumes_and_cross_the_slowest_link():
    assert collective_bytes("data-parallel", 4, 100, 100) == {"backward": 150.0}  # 2 (d - 1) / d
    assert collective_bytes("fsdp", 4, 100, 100) == {"forward": 75.0, "backward": 150.0}  # gathered twice
    # FSDP2's root (20 of the 100 bytes) stays gathered from forward to backward: gathered once.
    assert collective_bytes("fsdp", 4, 100, 100, root=20) == {"forward": 75.0, "backward": 135.0}
    # In a pipeline stage of 4 micro-batches: the blocks gathered 4 + 1 times, the root once, gradients
    # scattered once (not 4 times, as plain micro-batches would).
    assert collective_bytes("fsdp", 4, 100, 100, micro_batches=4, root=20, pipelined=True) == \
        {"forward": 0.75 * (20 + 4 * 80), "backward": 0.75 * (80 + 100)}
    assert collective_bytes("fsdp-zero2", 4, 100, 100, micro_batches=4, pipelined=True) == \
        {"forward": 75.0, "backward": 75.0}
    assert collective_bytes("fsdp-zero2", 4, 100, 100, micro_batches=4) == {"forward": 300.0, "backward": 300.0}
    h100 = PROFILES["h100-sxm"]
    assert link_bytes_s(h100, 8)[0] == 450e9  # NVLink4: 900 GB/s both ways
    bandwidth, why = link_bytes_s(h100, 16)
    assert bandwidth == pytest.approx(400e9 / 8) and "node network" in why  # 8 x 400 Gb/s per DGX H100 node
    # A ring collective crosses nodes through the NICs of its members in each node (NCCL: a ring per NIC):
    # a data-parallel group of every GPU uses all 8, one under 8-way tensor parallelism only its own.
    assert link_bytes_s(h100, 16, ring_stride=1)[0] == pytest.approx(400e9)
    assert link_bytes_s(h100, 64, ring_stride=2)[0] == pytest.approx(200e9)
    assert link_bytes_s(h100, 64, ring_stride=8)[0] == pytest.approx(50e9)
    assert link_bytes_s(h100, 8, ring_stride=1)[0] == 450e9  # inside a node: NVLink, as before
    assert link_bytes_s(PROFILES["a100-sxm4-80gb"], 16, ring_stride=1)[0] == pytest.approx(200e9)
    assert link_bytes_s(PROFILES["l4"], 4)[1].startswith("PCIe Gen4 x16 through the host")
    # H100 NVL: a bridged pair talks over its NVLink bridge (600 GB/s both ways); four GPUs cross PCIe.
    assert link_bytes_s(PROFILES["h100-nvl"], 2)[0] == pytest.approx(300e9)
    assert "through the host" in link_bytes_s(PROFILES["h100-nvl"], 4)[1]
    assert link_bytes_s(PROFILES["t4"], 16)[0] is None  # no node network known: no step time, said why


def test_the_stage_that_sends_most_is_a_middle_one_or_an_end_with_the_tied_weight():
    # Two stages: each sends one direction per micro-batch, and the tied embedding's gradient once.
    assert pipeline_bytes(2, 10, micro_batches=4, tied_bytes=100) == (10.0, 100.0)
    # More stages: a middle stage sends both directions, unless the ends' tied weight outweighs that.
    assert pipeline_bytes(4, 10, micro_batches=4, tied_bytes=10) == (20.0, 0.0)
    assert pipeline_bytes(4, 10, micro_batches=4, tied_bytes=100) == (10.0, 100.0)
    assert pipeline_bytes(1, 10, micro_batches=4, tied_bytes=100) == (0.0, 0.0)


def test_a_7b_full_fine_tune_needs_sharding_on_eight_h100s():
    def projected(stack, dp=8):
        cell = Cell("gpt", "gpt-7b", "train", stack, "h100-sxm", dp, source="projected", world_size=dp)
        return project_outcome(cell.resolve(PROFILES))

    ddp, fsdp = projected("data-parallel+amp-bf16+checkpointing"), projected("fsdp+amp-bf16+checkpointing")
    assert ddp.status == "oom" and "per rank, 8-way data-parallel" in ddp.reason
    assert fsdp.status == "ok" and fsdp.memory.params * 8 == pytest.approx(ddp.memory.params, rel=1e-6)
    assert fsdp.memory.peak_allocated < ddp.memory.peak_allocated / 4
    assert fsdp.speed.step_time_ms_p50 > 0 and fsdp.comm_bytes_per_step > 0


def test_fsdp_gathering_in_bf16_keeps_fp32_states_sends_less_and_drops_autocasts_weight_copies():
    def projected(stack):
        cell = Cell("gpt", "gpt-7b", "train", stack, "h100-sxm", 8, source="projected", world_size=8)
        return project_outcome(cell.resolve(PROFILES))

    cast, gathered = projected("fsdp+amp-bf16"), projected("fsdp:mp=bf16+amp-bf16")
    for state in ("params", "grads", "optimizer"):  # fp32 shards either way
        assert getattr(gathered.memory, state) == pytest.approx(getattr(cast.memory, state), rel=1e-4)
    # Gathers the blocks twice and the root (embeddings, head: a share `root` of the parameters) once, in 2
    # bytes, and reduce-scatters in 4, against 4 + 4.
    workload = WORKLOADS["gpt"]
    with torch.device("meta"):
        model = workload.build(workload.sizes["gpt-7b"])
    root = _root_bytes(model, workload, 1) / cast.memory.param_count
    assert gathered.comm_bytes_per_step == pytest.approx(
        cast.comm_bytes_per_step * (2 * (2 - root) + 4) / (4 * (2 - root) + 4), rel=1e-3)
    # Autocast caches a bf16 copy of every fp32 weight until the forward ends; bf16 gathers need none.
    dropped = cast.memory.activations - gathered.memory.activations
    assert dropped == pytest.approx(2 * cast.memory.param_count, rel=0.1)
    assert gathered.speed.step_time_ms_p50 < cast.speed.step_time_ms_p50  # no cast kernels per op
    assert "bf16 gathers" in gathered.notes[0]
    assert "autocast caches its 16-bit cast" in cast.notes[0] and "autocast caches" not in gathered.notes[0]
    # ZeRO-2 keeps the gathered bf16 copy whole from forward to backward (beside its fp32 shard), not fp32.
    zero2_cast, zero2 = projected("fsdp-zero2+amp-bf16"), projected("fsdp-zero2:mp=bf16+amp-bf16")
    n = cast.memory.param_count
    whole_fp32_and_shard, whole_bf16_and_shard = 4 * n + 4 * n / 8, 2 * n + 4 * n / 8
    assert zero2_cast.memory.peak_allocated - zero2.memory.peak_allocated == pytest.approx(
        whole_fp32_and_shard - whole_bf16_and_shard + dropped, rel=0.05)
    assert projected("fsdp:mp=bf16").precision == "bf16"  # without autocast every op runs in bf16
    refused = projected("fsdp:mp=bf16+lora+amp-bf16")  # its restored fp32 states would be wrong
    assert refused.status == "unsupported" and "with lora it is not yet" in refused.reason


def test_cpu_offload_without_a_known_host_link_has_no_step_time_and_says_why():
    cell = Cell("gpt", "gpt2-124m", "train", "cpu-offload+amp-bf16", "b200", 8, source="projected", world_size=8)
    outcome = project_outcome(cell.resolve(PROFILES))
    assert outcome.status == "ok" and outcome.speed is None and outcome.memory.host > 0
    assert any("no host link bandwidth known for b200" in note for note in outcome.notes)


def test_min_gpus_answers_the_fewest_that_hold_the_stack():
    request = ProjectRequest(gpu="h100-sxm", workload="gpt", size="gpt-7b", technique="fsdp+amp-bf16+checkpointing",
                             min_gpus=True)
    row = projected_rows(request, PROFILES)[0]
    assert row.status == "ok" and row.world_size >= 2 and f"fits on {row.world_size} GPUs" in row.notes
    fewer = Cell("gpt", "gpt-7b", "train", "fsdp+amp-bf16+checkpointing", "h100-sxm", row.world_size // 2,
                 source="projected", world_size=row.world_size // 2).resolve(PROFILES)
    assert project_outcome(fewer).status == "oom"


def test_min_gpus_stops_where_the_unsharded_rest_alone_outgrows_the_gpu():
    from harness.project.query import _cannot_fit
    from harness.records import Record

    def row(world, allocated):
        return Record(run_id="r", workload="gpt", size="s", mode="train", technique="fsdp", gpu="h100-sxm",
                      source="projected", status="oom", batch_size=world, world_size=world,
                      peak_allocated_bytes=allocated * GIB, device_overhead_bytes=GIB // 2)

    capacity = 80 * GIB
    # 300 -> 200 GiB: the next doublings take at most 100 more off, so 100 GiB is the least it reaches.
    assert "and more cannot fit" in _cannot_fit(row(2, 300), row(4, 200), capacity)
    assert _cannot_fit(row(2, 300), row(4, 170), capacity) is None  # 130 off could reach 40 GiB: go on
    assert _cannot_fit(None, row(1, 500), capacity) is None
    # gpt-70b with fsdp in fp32 under autocast: the cast copies of every weight are not sharded.
    request = ProjectRequest(gpu="h100-sxm", workload="gpt", size="gpt-70b", technique="fsdp+amp-bf16+checkpointing",
                             min_gpus=True)
    answer = projected_rows(request, PROFILES)[0]
    assert answer.status == "oom" and answer.world_size < 64 and "and more cannot fit" in answer.notes


def _projected(stack: str, world: int, size: str = "gpt3-175b", gpu: str = "h100-sxm", batch: int = 256):
    cell = Cell("gpt", size, "train", stack, gpu, batch, source="projected", world_size=world)
    return project_outcome(cell.resolve(PROFILES))


def test_fsdp_past_one_node_gathers_through_every_nic_of_the_node():
    # Weak scaling, one sample per GPU: 16 GPUs on 2 nodes gather and scatter at the node's 400 GB/s (8 NICs),
    # hidden under compute as 8 on one node's NVLink are; at one NIC's 50 GB/s it was twice the step.
    one_node, two_nodes = (_projected("fsdp+amp-bf16+checkpointing", world, size="gpt-7b", batch=world)
                           for world in (8, 16))
    assert two_nodes.speed.step_time_ms_p50 < 1.1 * one_node.speed.step_time_ms_p50
    assert any("the rings through 8 of its 8 NICs" in note for note in two_nodes.notes)


def test_tensor_parallelism_past_a_node_is_warned_about():
    across = _projected("tensor-parallel:t=16+amp-bf16", 16, size="gpt-7b", batch=16)
    within = _projected("tensor-parallel:t=8+amp-bf16", 8, size="gpt-7b", batch=8)
    assert any(note.startswith("warning: 16-way tensor parallelism spans nodes of 8 GPUs") for note in across.notes)
    assert not any(note.startswith("warning:") for note in within.notes)


def test_expert_parallel_ranks_hold_their_experts_and_exchange_every_moe_layers_tokens():
    from harness.project.expert_parallel import all_to_all_bytes, expert_figures
    from suites.workloads import get_workload

    spread = _projected("expert-parallel+amp-bf16+checkpointing", 8, size="mixtral-8x7b", gpu="b200", batch=8)
    assert spread.status == "ok" and spread.speed.step_time_ms_p50 > 0
    workload = get_workload("gpt")
    layers, buffer, replicated = expert_figures(workload, workload.size("mixtral-8x7b"), 8, 4096)
    # Mixtral: 32 MoE layers, 8 experts of 3 x 4096 x 14336, capacity 1.25 x 2 x 4096 / 8 = 1280 tokens each.
    assert (layers, buffer) == (32, 8 * 1280 * 4096)
    experts = 32 * 8 * 3 * 4096 * 14336
    assert replicated == 46_702_792_704 - experts  # Mixtral-8x7B's parameters (Mistral AI, model card: 46.7B)
    assert spread.memory.params == 4 * (replicated + experts // 8)  # fp32 weights: the rest whole, 1/8 of experts
    # Per micro-batch: out (fp32) and back (bf16), forward and backward, 7/8 of the buffer leaving.
    assert all_to_all_bytes(8, 32, buffer, 2) == pytest.approx(2 * 32 * 7 / 8 * buffer * 6)
    assert "8-way expert" in "; ".join(spread.notes) and spread.comm_bytes_per_step > 0
    # FSDP over the same ranks shards what is not an expert; each rank's experts stay its own.
    sharded = _projected("expert-parallel+fsdp+amp-bf16+checkpointing", 8, size="mixtral-8x7b", gpu="b200", batch=8)
    assert sharded.memory.params == pytest.approx(4 * (replicated / 8 + experts / 8), rel=1e-6)
    assert sharded.memory.peak_allocated < spread.memory.peak_allocated


def test_the_projected_exchange_allocates_what_the_all_to_all_does_forward_and_backward():
    """torch.distributed.nn's all_to_all_single receives into a fresh buffer both ways (the gradient too),
    so the projection's stand-in does: a plain clone would hand the gradient back through in place."""
    from suites.workloads.moe import ExpertExchange

    parts = torch.randn(2, 3, 4, requires_grad=True)
    arrived = []
    parts.register_hook(arrived.append)
    received = ExpertExchange(2, communicate=False)._all_to_all(parts)
    grad = torch.randn_like(received)
    received.backward(grad)
    assert received.data_ptr() != parts.data_ptr() and torch.equal(received, parts)
    assert arrived[0].data_ptr() != grad.data_ptr() and torch.equal(arrived[0], grad)


def test_expert_parallel_stages_of_a_pipeline_hold_their_stages_experts_and_exchange_their_layers_tokens():
    from harness.project.expert_parallel import all_to_all_bytes, expert_figures
    from suites.workloads import get_workload

    stack = "expert-parallel:e=8+pipeline-parallel:p=4+fsdp+amp-bf16+checkpointing"
    staged = _projected(stack, 32, size="mixtral-8x7b", batch=32)
    alone = _projected("expert-parallel:e=8+fsdp+amp-bf16+checkpointing", 8, size="mixtral-8x7b", batch=8)
    assert staged.status == "ok" and staged.speed.step_time_ms_p50 > 0
    workload = get_workload("gpt")
    full = workload.size("mixtral-8x7b")
    stage = workload.with_depth(full, 8)  # 8 of 32 blocks, traced with the embeddings and the head
    _, _, replicated = expert_figures(workload, stage, 8, 4096)
    experts = 8 * 8 * 3 * 4096 * 14336  # the stage's 8 MoE layers' 8 experts
    # FSDP over the stage's 8 ranks shards what is not an expert; each rank keeps 1 of the 8 experts per layer.
    assert staged.memory.params == pytest.approx(4 * (replicated / 8 + experts / 8), rel=1e-6)
    assert 0.25 < staged.memory.params / alone.memory.params < 0.3
    # The stage's 8 MoE layers exchange one micro-batch's tokens (1 x 4096), half again for the recompute.
    layers, buffer, _ = expert_figures(workload, stage, 8, 4096)
    per_micro = all_to_all_bytes(8, layers, buffer, 2) * 1.5
    assert layers == 8 and f"expert parallel sends {per_micro / 2**20:,.1f} MiB per micro-batch" in "; ".join(
        staged.notes)
    assert "4-stage 1F1B pipeline (4 micro-batches) x 8-way expert x 8-way fsdp on 32 GPUs" in staged.notes[0]


def test_expert_parallelism_on_a_model_it_cannot_spread_says_why():
    dense = _projected("expert-parallel+amp-bf16", 2, size="gpt-7b", batch=2)
    assert dense.status == "unsupported" and "no mixture-of-experts layers" in dense.reason
    uneven = _projected("expert-parallel+amp-bf16", 3, size="mixtral-8x7b", batch=3)
    assert uneven.status == "unsupported" and "8 experts do not spread evenly over 3 ranks" in uneven.reason


def test_a_pipeline_holds_its_micro_batches_in_flight_and_pays_its_bubble():
    stack = "pipeline-parallel:p=4:m={m}{schedule}+amp-bf16"
    one_f_one_b, gpipe = (_projected(stack.format(m=16, schedule=s), 4, size="gpt2-1.3b", batch=16)
                          for s in ("", ":schedule=gpipe"))
    # GPipe holds all 16 micro-batches' activations, 1F1B at most the 4 stages': 16/4 as many beyond the first.
    assert gpipe.memory.activations > 2 * one_f_one_b.memory.activations
    steps = {m: _projected(stack.format(m=m, schedule=""), 4, size="gpt2-1.3b", batch=m) for m in (4, 8, 16)}
    ms = {m: outcome.speed.step_time_ms_p50 for m, outcome in steps.items()}
    # (m + p - 1) slots of one micro-batch, then the optimizer step once: linear in m, slope one slot (while
    # the end stages, one send per micro-batch and the tied embedding's all-reduce, send most; from m = 32 on
    # a middle stage's two sends per micro-batch outweigh it).
    slot = (ms[16] - ms[8]) / 8
    assert (ms[8] - ms[4]) / 4 == pytest.approx(slot, rel=1e-9)
    assert ms[4] > 7 * slot  # 4 micro-batches fill 7 slots, 3 of them idle: the bubble, plus the step
    assert "pipeline bubble 43%" in "; ".join(steps[4].notes)  # (p - 1) / (m + p - 1) = 3 / 7


@pytest.mark.parametrize("stack, world, message", [
    ("tensor-parallel:t=8+fsdp", 12, "do not split into 8 tensor-parallel ranks"),
    ("tensor-parallel:t=2+amp-bf16", 8, "no data-parallel or sharding technique"),
    ("tensor-parallel+pipeline-parallel:p=2+fsdp", 8, "give --tp N"),
    ("pipeline-parallel:p=5+amp-bf16", 5, "96 blocks do not split into 5"),
    ("expert-parallel+tensor-parallel:t=2", 8, "combined with tensor-parallel is not projected yet"),
    ("expert-parallel+pipeline-parallel:p=4+fsdp", 32, "needs both degrees: give --ep N --pp M"),
    ("expert-parallel:e=8+pipeline-parallel:p=2+fsdp", 32, "of each of the 2 pipeline stages"),
    ("pipeline-parallel:p=4:m=2+amp-bf16", 4, "1F1B needs at least as many micro-batches as stages"),
])
def test_layouts_that_do_not_add_up_say_why(stack, world, message):
    from harness.project.layout import layout_of, local_cell

    cell = Cell("gpt", "gpt3-175b", "train", stack, "h100-sxm", 320, source="projected",
                world_size=world).resolve(PROFILES)
    with pytest.raises(Unsupported, match=message):
        local_cell(cell, layout_of(cell))


def test_min_gpus_with_tensor_and_pipeline_degrees_searches_the_data_parallel_groups():
    # Two stages would not do: a stage keeps its 4.4 billion parameters gathered and their gradients whole through
    # the schedule (fp32: 33 GiB), beside 28 GiB of checkpointed activations at 8k tokens.
    request = ProjectRequest(gpu="h100-sxm", workload="gpt", size="gpt-70b", tp=8, pp=4, min_gpus=True,
                             technique="tensor-parallel+pipeline-parallel+fsdp+amp-bf16+checkpointing")
    row = projected_rows(request, PROFILES)[0]
    assert row.status == "ok" and row.world_size % 32 == 0 and f"fits on {row.world_size} GPUs" in row.notes
    assert row.technique.startswith("tensor-parallel:t=8+pipeline-parallel:p=4")


@pytest.mark.parametrize("args, message", [
    (["--technique", "fsdp", "--tp", "8"], "--tp 8 needs tensor-parallel in the stack"),
    (["--technique", "tensor-parallel:t=4", "--tp", "8"], "contradicts tensor-parallel:t=4"),
    (["--technique", "fsdp", "--ep", "8"], "--ep 8 needs expert-parallel in the stack"),
    (["--technique", "expert-parallel", "--ep", "8", "--min-gpus"], "--min-gpus searches data-parallel groups"),
    (["--technique", "fsdp"], "give how many"),
    (["--technique", "amp-bf16", "--dp", "8"], "apply to parallel stacks"),
])
def test_the_command_line_says_what_it_cannot_project(args, message):
    done = subprocess.run([sys.executable, "-m", "harness.cli", "project", "--workload", "gpt", "--size", "gpt2-124m",
                           "--gpu", "h100-sxm", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_pipelines_end_stage_is_costed_with_the_heads_collectives_not_also_the_first_stages_embeddings():
    # gpt smoke, 2 tensor-parallel ranks x 2 stages, 8 micro-batches of 1 (64 tokens, width 64, vocabulary 512):
    # the last stage sends what gloo counted on it, 1,376,256 bytes a step: its blocks' all-reduces and the
    # head's input gradients (all_reduce 655,360), its gathered logits (all_gather 524,288), the gradients it
    # sends back to the first stage (131,072) and the tied embedding's gradient (65,536). The first stage's
    # embedding all-reduce (131,072) is not the last stage's.
    cell = Cell("gpt", "smoke", "train", "tensor-parallel:t=2+pipeline-parallel:p=2", "cpu", 8, source="projected",
                world_size=4).resolve(PROFILES)
    row = project_outcome(cell)
    assert row.status == "ok" and row.comm_bytes_per_step == 655_360 + 524_288 + 131_072 + 65_536


def test_max_batch_on_data_parallel_ranks_is_the_largest_global_batch_every_rank_fits():
    # The search steps by one sample per rank (a batch of 1 does not split over 4 ranks) and asks every rank.
    request = ProjectRequest(gpu="l4", workload="gpt", size="gpt2-124m", technique="fsdp+amp-bf16", dp=4,
                             max_batch=True)
    (row,) = projected_rows(request, PROFILES)
    assert row.status == "ok" and row.batch_size >= 8 and row.batch_size % 4 == 0
    above = Cell("gpt", "gpt2-124m", "train", "fsdp+amp-bf16", "l4", row.batch_size + 4, source="projected",
                 world_size=4).resolve(PROFILES)
    assert project_outcome(above).status == "oom"
    with pytest.raises(ValueError, match="each solve for one unknown"):
        projected_rows(ProjectRequest(gpu="l4", workload="gpt", size="gpt2-124m", technique="fsdp+amp-bf16",
                                      min_gpus=True, max_batch=True), PROFILES)


def test_a_parallel_rows_error_bar_says_what_it_rests_on():
    cell = Cell("gpt", "gpt2-124m", "train", "fsdp+amp-bf16", "h100-sxm", 8, source="projected",
                world_size=4).resolve(PROFILES)
    row = project_outcome(cell)
    assert row.speed.step_time_ms_low < row.speed.step_time_ms_p50 < row.speed.step_time_ms_high
    assert row.interval_basis.startswith("step time: multi-GPU communication time not yet checked")


def test_fsdp_under_a_pipeline_says_it_regathers_per_micro_batch_and_fsdp_zero2_gathers_once():
    rows = {}
    for sharding in ("fsdp", "fsdp-zero2"):
        request = ProjectRequest(gpu="h100-sxm", workload="gpt", size="gpt2-124m", pp=2, dp=2, batch_size=16,
                                 technique=f"pipeline-parallel+{sharding}+amp-bf16")
        rows[sharding] = projected_rows(request, PROFILES)[0]
    assert rows["fsdp"].status == rows["fsdp-zero2"].status == "ok"
    assert "gathers the stage's blocks again for each of its" in rows["fsdp"].notes
    assert "again for each" not in rows["fsdp-zero2"].notes
    # The note's advice holds in the projection itself: fewer bytes sent per step.
    assert rows["fsdp-zero2"].comm_bytes_per_step < rows["fsdp"].comm_bytes_per_step


def test_zero1_broadcasts_only_what_its_optimizer_steps():
    # Under LoRA the optimizer steps the adapters alone: ZeRO-1's broadcast is theirs, as the measured cell counts
    # it (suites/techniques/parallel.py), not the frozen base's half a gigabyte.
    outcome = _projected("zero1+lora", 2, size="gpt2-124m", batch=8)
    assert outcome.status == "ok", outcome.reason
    grads = outcome.memory.grads
    assert outcome.comm_bytes_per_step == pytest.approx(3 * 0.5 * grads, rel=0.01)  # all-reduce 2 (d-1)/d, + (d-1)/d
