"""A served decoder over a tensor-parallel group (harness/project/served_parallel.py): one rank's share of the
weights and cache, the collectives every forward waits on at NCCL's latency model, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project, project_outcome
from harness.project.collective_cost import ring_latency_s
from harness.project.query import with_degrees
from harness.project.served_parallel import local_served_cell, search_cell, served_collectives
from harness.serve_matrix import MatrixRequest, serve_matrix

PROFILES = load_profiles()
PROMPT, GENERATED = 5, 20


def _served(size: str, gpu: str, ranks: int, technique: str = "bf16-weights+compile", batch: int = 1):
    if ranks > 1:
        technique = with_degrees(f"tensor-parallel+{technique}", ranks, None)
    return Cell("gpt", size, "infer", technique, gpu, batch, "projected", prompt_len=PROMPT, gen_len=GENERATED,
                world_size=ranks).resolve(PROFILES)


@pytest.mark.parametrize("gpu,ranks,collective,expected_us", [
    ("h100-sxm", 2, "all_reduce", 6.6 + 0.6 * 2),  # NVLink: NCCL's Ring/LL base + 2 (n - 1) hops
    ("h100-sxm", 8, "all_reduce", 6.6 + 0.6 * 14),
    ("h100-sxm", 8, "all_gather", 6.6 + 0.6 * 7),  # an all-gather's ring has n - 1 hops
    ("h100-pcie", 2, "all_reduce", 6.6 + 0.6 * 2),  # an NVLink bridge joins a pair ...
    ("h100-pcie", 4, "all_reduce", 6.6 + 1.0 * 6),  # ... a group of four crosses PCIe
    ("l4", 2, "all_reduce", 6.6 + 1.0 * 2),
    ("mi300x", 2, "all_reduce", 12.0 + 0.8 * 2),  # RCCL's own figures, over Infinity Fabric (xGMI)
    ("h100-sxm", 1, "all_reduce", 0.0),
])
def test_a_ring_collective_costs_what_nccls_latency_model_says(gpu, ranks, collective, expected_us):
    profile = PROFILES[gpu].per_device()
    assert ring_latency_s(profile, ranks, collective) * 1e6 == pytest.approx(expected_us)


def test_a_rank_holds_half_the_weights_and_cache_and_every_decode_step_waits_on_its_collectives():
    one, two = _served("gpt-7b", "h100-sxm", 1), _served("gpt-7b", "h100-sxm", 2)
    whole, served = project_outcome(one), project_outcome(two)
    assert whole.status == served.status == "ok", (whole.reason, served.reason)
    # Every weight but the norms' is sharded (attention, MLP, the vocabulary-parallel embedding and head).
    assert served.memory.params / whole.memory.params == pytest.approx(0.5, abs=1e-4)
    assert served.memory.kv_cache == whole.memory.kv_cache // 2
    # The decode step is the rank's own (projected alone, on one GPU) plus its collectives.
    local = local_served_cell(two, 2)
    alone = project(local).generation
    decode = served_collectives(local, 2, "bf16", 1)
    assert decode.all_reduces == 2 * 32 + 1  # two per block and the embedding's
    assert decode.all_reduce_bytes == 4096 * 2  # one token's activation in bf16
    assert decode.gathered_bytes == 16000 * 2  # this rank's half of the 32,000 logits
    assert served.serving.decode_ms_mean == pytest.approx((alone.decode_mean_s + decode.seconds) * 1e3)
    assert served_collectives(local, 2, "bf16", PROMPT).gathered_bytes == decode.gathered_bytes  # last position only
    assert decode.seconds > 65 * ring_latency_s(PROFILES["h100-sxm"].per_device(), 2, "all_reduce")
    prefill = served_collectives(local, 2, "bf16", PROMPT)
    assert served.comm_bytes_per_step == round(prefill.sent_bytes + (GENERATED - 1) * decode.sent_bytes)
    assert any("2-way tensor-parallel serving" in note for note in served.notes)
    assert "never fitted" in served.interval_basis
    # Half the bytes per GPU, but not half the time: the collectives are what two GPUs cannot halve.
    assert 0.5 < served.serving.decode_ms_mean / whole.serving.decode_ms_mean < 1.0


def test_a_model_too_large_for_one_gpu_fits_a_tensor_parallel_group_and_the_oom_says_so():
    alone = project_outcome(_served("gpt-70b", "h100-sxm", 1))
    assert alone.status == "oom" and "--tp N" in alone.reason
    assert project_outcome(_served("gpt-70b", "h100-sxm", 2)).status == "ok"


@pytest.mark.parametrize("technique,ranks,message", [
    ("tensor-parallel:t=16+bf16-weights", 16, "spans nodes of 8 GPUs"),
    ("tensor-parallel+fsdp+bf16-weights", 2, "serving is projected with tensor-parallel alone"),
])
def test_serving_stacks_the_projection_cannot_answer_are_unsupported_rows(technique, ranks, message):
    cell = Cell("gpt", "gpt-7b", "infer", technique, "h100-sxm", 1, "projected", prompt_len=PROMPT,
                gen_len=GENERATED, world_size=ranks).resolve(PROFILES)
    outcome = project_outcome(cell)
    assert outcome.status == "unsupported" and message in outcome.reason


def test_one_pass_inference_over_several_gpus_is_refused_with_its_reason():
    cell = Cell("bert", "", "infer", "tensor-parallel", "h100-sxm", 1, "projected", world_size=2).resolve(PROFILES)
    outcome = project_outcome(cell)
    assert outcome.status == "unsupported" and "generating decoders" in outcome.reason


def test_a_measured_tensor_parallel_server_is_refused_with_the_projection_to_use():
    cell = Cell("gpt", "gpt-7b", "infer", "tensor-parallel", "h100-sxm", 1, "measured", prompt_len=PROMPT,
                gen_len=GENERATED, world_size=2).resolve(PROFILES)
    assert "projected (headroom project --mode infer" in cell.unsupported


def test_the_rank_cell_keeps_the_other_techniques_and_runs_on_one_gpu():
    local = local_served_cell(_served("gpt-7b", "h100-sxm", 4, "group-quant+bf16-weights"), 4)
    names = [t.id for t in local.stack.techniques]
    assert names[0] == "tensor-parallel-rank:t=4" and "group-quant" in names and local.cell.world_size == 1
    assert local.unsupported is None


def test_max_batch_of_a_served_group_is_the_largest_its_rank_holds():
    from harness.project.query import ProjectRequest, projected_rows
    from harness.project.search import runs_steadily

    request = ProjectRequest(gpu="l4", size="gpt-7b", mode="infer", technique="tensor-parallel+bf16-weights+compile",
                             tp=2, prompt_len=2000, gen_len=48, max_batch=True)
    (record,) = projected_rows(request, PROFILES)
    assert record.status == "ok" and record.world_size == 2 and record.batch_size > 1, record.reason
    rank = local_served_cell(_served("gpt-7b", "l4", 2), 2)
    rank = rank.with_spec(dataclasses.replace(rank.spec, seq_len=2000, gen_len=48))
    assert runs_steadily(project(rank.with_batch(record.batch_size)).memory)
    assert not runs_steadily(project(rank.with_batch(record.batch_size + 1)).memory)


def test_a_served_group_wider_than_a_node_is_refused_at_the_door():
    from harness.project.query import ProjectRequest, projected_rows

    request = ProjectRequest(gpu="h100-sxm", size="gpt-7b", mode="infer", technique="tensor-parallel+bf16-weights",
                             tp=16)
    with pytest.raises(ValueError, match="spans nodes of 8 GPUs"):
        projected_rows(request, PROFILES)


def test_every_published_tensor_parallel_decode_names_a_cell_the_projection_answers():
    from pathlib import Path

    import pandas as pd

    published = pd.read_csv(Path(__file__).resolve().parents[1] / "benchmarks/data/published_tp_decode.csv")
    assert len(published) >= 10 and published["source"].str.contains("gpt-fast").all()
    assert set(published["ranks"]) == {1, 2, 4, 8}
    for row in published.to_dict("records"):
        cell = _served(row["size"], row["gpu"], int(row["ranks"]), row["technique"])
        assert cell.unsupported is None and search_cell(cell).unsupported is None, row["label"]


def test_each_rank_sends_the_ring_algorithms_share_of_every_collective():
    local = local_served_cell(_served("gpt-7b", "h100-sxm", 4), 4)
    decode = served_collectives(local, 4, "bf16", 1)
    # 65 all-reduces of one token's 4096 bf16 values, 2 (t - 1) / t of each sent; 8,000 logits to each of 3 others.
    assert decode.sent_bytes == 65 * 2 * 3 / 4 * 4096 * 2 + 3 * 8000 * 2


def test_gpt_fasts_layout_keeps_the_vocabulary_whole_on_every_rank_with_no_collective_of_its_own():
    cell = _served("gpt-7b", "h100-sxm", 2)
    whole = served_collectives(local_served_cell(cell, 2, vocabulary=False), 2, "bf16", 1, vocabulary=False)
    assert whole.all_reduces == 64 and whole.gathered_bytes == 0
    sharded, kept = (project(local_served_cell(cell, 2, vocabulary=v)).memory.params for v in (True, False))
    assert kept - sharded == pytest.approx(2 * 32000 * 4096 * 2 / 2, rel=1e-3)  # half of embedding + head, in bf16


@pytest.mark.parametrize("size,ranks,message", [
    ("gpt-7b", 3, "32 query and 32 key/value heads do not split over 3 ranks"),
    ("mixtral-8x7b", 2, "experts are not sharded by tensor-parallel here"),
])
def test_a_group_the_model_cannot_be_cut_for_is_an_unsupported_row_without_a_search(size, ranks, message):
    from harness.project.query import ProjectRequest, projected_rows

    for search in ({"max_batch": True}, {"max_context": True}, {}):
        request = ProjectRequest(gpu="h100-sxm", size=size, mode="infer", tp=ranks,
                                 technique="tensor-parallel+bf16-weights", **search)
        (record,) = projected_rows(request, PROFILES)
        assert record.status == "unsupported" and message in record.reason, (search, record.reason)
    matrix = serve_matrix(MatrixRequest(sizes=(size,), gpus=("h100-sxm",), weights=("bf16",), contexts=(4096,),
                                        replica_gpus=(ranks,)), PROFILES)
    assert message in matrix["notes"][0]


def test_merged_matrices_keep_each_replica_size_and_the_last_of_a_repeated_row():
    import pandas as pd

    from harness.serve_matrix import merged_matrices

    old = pd.DataFrame([{"size": "gpt-70b", "gpu": "h100-sxm", "weights": "bf16", "max_batch_4k": 0}])
    new = pd.DataFrame([{"size": "gpt-70b", "gpu": "h100-sxm", "weights": "bf16", "gpus": g, "max_batch_4k": b}
                        for g, b in ((1, 0), (2, 10), (4, 58))])
    merged = merged_matrices([old, new])
    assert list(merged["gpus"]) == [1, 2, 4] and list(merged["max_batch_4k"]) == [0, 10, 58]
    assert merged_matrices([]) is None
