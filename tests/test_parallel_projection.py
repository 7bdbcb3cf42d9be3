"""Data-parallel and sharded stacks projected to N GPUs (harness/project/parallel.py): what each rank keeps,
the links its collectives cross, and the questions a buyer asks (`--dp`, `--min-gpus`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project_outcome
from harness.project.parallel import collective_bytes, link_bytes_s, rank_memory
from harness.project.query import ProjectRequest, projected_rows

PROFILES = load_profiles()
# One rank's unsharded figures at each phase's peak (a toy trace): 100 bytes of parameters, as many of
# gradients, 200 of optimizer state; the optimizer step's temporaries are a parameter-sized 100.
AT_PEAK = {"forward": {"params": 100, "activations": 50},
           "backward": {"params": 100, "grads": 100, "optimizer": 200, "activations": 50},
           "optimizer": {"params": 100, "grads": 100, "optimizer": 200, "temporaries": 100}}


def _rank(technique: str, dp: int = 4):
    return rank_memory(technique, dp, AT_PEAK, (100, 100, 200), block_params=10, block_grads=10)


def test_each_technique_keeps_the_model_states_zero_says_it_does():
    ddp, zero1, zero2, fsdp, offload = (_rank(t) for t in ("data-parallel", "zero1", "fsdp-zero2", "fsdp",
                                                           "cpu-offload"))
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.peak) == (100, 100, 200, 500 + 100)  # + its grad buckets
    # State / 4; its peak is now the backward's (the optimizer step's scratch shrank to 25 with its shard).
    assert (zero1.optimizer, zero1.peak) == (50, 100 + 100 + 50 + 50 + 100)
    assert (zero2.params, zero2.grads, zero2.optimizer) == (25, 25, 50)
    # Its parameters stay whole from the forward's end through the backward: that is its peak here.
    assert zero2.peak == 100 + 25 + 50 + 50 + 10
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (25, 25, 50)
    assert fsdp.peak == max(25 + 50 + 20, 25 + 25 + 50 + 50 + 30, 25 + 25 + 50 + 25)
    assert offload.peak == 50 + 30 and offload.host == 25 + 25 + 50  # shards in host memory


def test_collectives_are_ring_volumes_and_cross_the_slowest_link():
    assert collective_bytes("data-parallel", 4, 100, 100) == {"backward": 150.0}  # 2 (d - 1) / d
    assert collective_bytes("fsdp", 4, 100, 100) == {"forward": 75.0, "backward": 150.0}  # gathered twice
    h100 = PROFILES["h100-sxm"]
    assert link_bytes_s(h100, 8)[0] == 450e9  # NVLink4: 900 GB/s both ways
    bandwidth, why = link_bytes_s(h100, 16)
    assert bandwidth == pytest.approx(400e9 / 8) and "node network" in why  # 8 x 400 Gb/s per DGX H100 node
    assert link_bytes_s(PROFILES["l4"], 4)[1].startswith("PCIe Gen4 x16 through the host")
    assert link_bytes_s(PROFILES["t4"], 16)[0] is None  # no node network known: no step time, said why


def test_a_7b_full_fine_tune_needs_sharding_on_eight_h100s():
    def projected(stack, dp=8):
        cell = Cell("gpt", "gpt-7b", "train", stack, "h100-sxm", dp, source="projected", world_size=dp)
        return project_outcome(cell.resolve(PROFILES))

    ddp, fsdp = projected("data-parallel+amp-bf16+checkpointing"), projected("fsdp+amp-bf16+checkpointing")
    assert ddp.status == "oom" and "per rank, 8-way data-parallel" in ddp.reason
    assert fsdp.status == "ok" and fsdp.memory.params * 8 == pytest.approx(ddp.memory.params, rel=1e-6)
    assert fsdp.memory.peak_allocated < ddp.memory.peak_allocated / 4
    assert fsdp.speed.step_time_ms_p50 > 0 and fsdp.comm_bytes_per_step > 0


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


@pytest.mark.parametrize("args, message", [
    (["--technique", "fsdp", "--tp", "8"], "tensor, pipeline and expert parallelism is not implemented yet"),
    (["--technique", "fsdp"], "give --dp N"),
    (["--technique", "amp-bf16", "--dp", "8"], "apply to data-parallel and sharded stacks"),
])
def test_the_command_line_says_what_it_cannot_project(args, message):
    done = subprocess.run([sys.executable, "-m", "harness.cli", "project", "--workload", "gpt", "--size", "gpt2-124m",
                           "--gpu", "h100-sxm", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1
