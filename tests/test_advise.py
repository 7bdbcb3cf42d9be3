"""OOM advice (harness/advise.py, `headroom advise`): the stacks that make a cell fit, ranked by step time,
and for a cell that fits, a larger batch or a cheaper GPU."""

from __future__ import annotations

import re

import pytest

from harness import advise
from harness.cli import main
from harness.profiles import BUILTIN_PROFILES_DIR

GIB = 2**30


def test_fixes_that_fit_are_ranked_by_step_time_and_worded():
    target = {"reserved": 50 * GIB, "step_ms": 100.0}
    fixes = [{"stack": "amp-bf16", "reserved": 30 * GIB, "step_ms": 80.0, "left": -2 * GIB},   # still short
             {"stack": "amp-bf16+checkpointing", "reserved": 9 * GIB, "step_ms": 128.0, "left": 6 * GIB},
             {"stack": "qlora+checkpointing", "reserved": 5 * GIB, "step_ms": 300.0, "left": 10 * GIB},
             {"stack": "checkpointing", "reserved": 20 * GIB, "step_ms": 120.0, "left": 1 * GIB}]
    lines = advise.rank_fixes(target, fixes)
    assert [line.split(":")[0] for line in lines] == ["checkpointing", "amp-bf16+checkpointing", "qlora+checkpointing"]
    assert lines[1] == "amp-bf16+checkpointing: reserves 41.0 GiB less, +28% step time, fits with 6.0 GiB left"
    assert lines[2].endswith("(trains adapters on 4-bit frozen weights)")


def test_a_fix_whose_error_bar_reaches_past_the_card_is_ranked_after_the_sure_ones_and_says_so():
    target = {"reserved": 90 * GIB, "step_ms": None}
    fixes = [{"stack": "amp-bf16+optim-8bit", "reserved": 75 * GIB, "step_ms": 566.0, "left": 2.6 * GIB,
              "worst": -4.9 * GIB},
             {"stack": "amp-bf16+checkpointing+optim-8bit", "reserved": 40 * GIB, "step_ms": 700.0, "left": 38 * GIB,
              "worst": 30 * GIB}]
    lines = advise.rank_fixes(target, fixes)
    assert lines[0].startswith("amp-bf16+checkpointing+optim-8bit:") and "(+24% vs the fastest)" in lines[0]
    assert lines[1].endswith("fits with 2.6 GiB left, but may not: short by 4.9 GiB at its error bar's high end")
    assert "(the fastest)" in lines[1]


def test_without_a_step_time_of_its_own_the_fastest_fix_is_the_reference():
    lines = advise.rank_fixes({"reserved": 50 * GIB, "step_ms": None},
                              [{"stack": "a", "reserved": GIB, "step_ms": 200.0, "left": GIB},
                               {"stack": "b", "reserved": GIB, "step_ms": 100.0, "left": GIB}])
    assert "100 ms per step (the fastest)" in lines[0] and "(+100% vs the fastest)" in lines[1]


def test_memory_left_follows_the_projections_fit():
    assert advise.memory_left(8 * GIB, GIB, 10 * GIB) == GIB
    assert advise.memory_left(12 * GIB, GIB, 10 * GIB) == -3 * GIB
    # Fits only because the allocator frees its cache and retries: what the live bytes leave.
    assert advise.memory_left(12 * GIB, GIB, 10 * GIB, allocated=7 * GIB, fits=True) == 2 * GIB
    assert advise.memory_left(None, GIB, 10 * GIB) is None


@pytest.fixture
def small_l4(tmp_path):
    """An L4 with 10,000 MiB: gpt2-124m's baseline step (about 12 GiB reserved) does not fit, its
    amp-bf16 + checkpointing step (about 8 GiB) does."""
    text = (BUILTIN_PROFILES_DIR / "l4.toml").read_text()
    text = re.sub(r'^id = .*$', 'id = "small-l4"', text, flags=re.M)
    text = re.sub(r'^family = .*$', 'family = "small-l4"', text, flags=re.M)
    text = re.sub(r'^match = .*$', 'match = ["Small L4"]', text, flags=re.M)
    text = re.sub(r"^visible_memory_mib = .*$", "visible_memory_mib = 10000", text, count=1, flags=re.M)
    text = re.sub(r"^memory_gib = .*$", "memory_gib = 10", text, count=1, flags=re.M)
    (tmp_path / "small-l4.toml").write_text(text)
    return tmp_path


def test_advise_names_the_stacks_that_make_a_cell_fit(small_l4, monkeypatch, capsys):
    monkeypatch.setattr(advise, "TRAIN_STACKS", ("tf32", "amp-bf16+checkpointing"))
    assert main(["advise", "--workload", "gpt", "--size", "gpt2-124m", "--gpu", "small-l4",
                 "--profiles", str(small_l4)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("projected: baseline does not fit on small-l4: short by ")
    assert "1 of 2 stacks" in lines[0]
    assert re.fullmatch(r"  checkpointing\+amp-bf16: reserves \d+\.\d GiB less, [\d,]+ ms per step \(the fastest\), "
                        r"fits with \d+\.\d GiB left", lines[1]), lines[1]
    assert len(lines) == 2  # tf32 keeps fp32 activations: still short, not advised
    # Progress goes to stderr: each stack as it is projected (in parallel processes where there are cores).
    assert re.search(r"project(ing|ed) tf32 on small-l4", err), err


def test_advise_names_each_unsupported_stack_with_its_reason_and_says_served_speeds_are_eager(small_l4, monkeypatch,
                                                                                                capsys):
    monkeypatch.setattr(advise, "INFER_STACKS", ("bf16-weights", "checkpointing"))
    assert main(["advise", "--workload", "gpt", "--size", "gpt2-124m", "--mode", "infer", "--gpu", "small-l4",
                 "--batch-size", "512", "--profiles", str(small_l4)]) == 0
    out = capsys.readouterr().out
    assert "(1 unsupported on small-l4: checkpointing: " in out.splitlines()[0]
    assert out.rstrip().endswith("add +compile to the stack, or see headroom serve-matrix, for that speed")


def test_a_served_model_one_gpu_cannot_hold_is_offered_the_smallest_tensor_parallel_group(small_l4, monkeypatch,
                                                                                            capsys):
    monkeypatch.setattr(advise, "INFER_STACKS", ("checkpointing",))  # unsupported in inference: no stack fits
    assert main(["advise", "--workload", "gpt", "--size", "gpt2-124m", "--mode", "infer", "--gpu", "small-l4",
                 "--batch-size", "192", "--profiles", str(small_l4)]) == 0
    out = capsys.readouterr().out
    assert "a larger GPU or several (serving over a tensor-parallel group, below) is needed" in out.splitlines()[0]
    group = next(line for line in out.splitlines() if "serve" in line and "tensor-parallel" in line)
    ranks = re.match(r"  (\d) GPUs serve it: --technique tensor-parallel --tp (\d) holds 1/(\d) of the weights", group)
    assert ranks and len(set(ranks.groups())) == 1 and "per million tokens at" in group, group
    # 12 heads do not split over 8: said, not taken for "does not fit".
    assert main(["advise", "--workload", "gpt", "--size", "gpt2-124m", "--mode", "infer", "--gpu", "small-l4",
                 "--batch-size", "4096", "--profiles", str(small_l4)]) == 0
    out = capsys.readouterr().out
    assert "no tensor-parallel group of 2, 4 or 8 small-l4 GPUs serves baseline" in out
    assert "8: 12 query and 12 key/value heads do not split over 8 ranks" in out


def test_a_batch_no_stack_holds_is_answered_with_the_largest_that_fits(small_l4, monkeypatch, capsys):
    monkeypatch.setattr(advise, "TRAIN_STACKS", ("amp-bf16",))
    assert main(["advise", "--workload", "gpt", "--size", "smoke", "--gpu", "small-l4", "--batch-size", "200000",
                 "--profiles", str(small_l4)]) == 0
    headline, line = capsys.readouterr().out.splitlines()
    # amp-bf16, then amp-bf16 in micro-batches (the second round where none fits).
    assert headline.endswith("none of the 2 stacks tried makes it fit: a smaller batch, a larger GPU or several "
                             "(headroom project --min-gpus) is needed")
    largest = int(re.search(r"at most (\d+) with baseline \(asked 200000\)", line).group(1))
    assert 1 < largest < 200000


def test_where_no_stack_fits_each_is_tried_in_micro_batches(small_l4, monkeypatch, capsys):
    # amp-bf16 alone is short at this batch; in 4 micro-batches its activations are a quarter: it fits.
    monkeypatch.setattr(advise, "TRAIN_STACKS", ("amp-bf16",))
    assert main(["advise", "--workload", "gpt", "--size", "gpt2-124m", "--gpu", "small-l4", "--batch-size", "24",
                 "--profiles", str(small_l4)]) == 0
    headline, line = capsys.readouterr().out.splitlines()[:2]
    assert "1 of 2 stacks tried make it fit" in headline, headline
    assert line.startswith("  amp-bf16+grad-accumulation: ") and "same global batch in 4 micro-batches" in line


def test_suggestions_keep_the_asked_stacks_techniques_they_do_not_replace():
    # compile stays in every suggestion; an optimizer of the candidate's own replaces the asked one.
    assert advise.built_on("bf16-weights+group-quant", "bf16-weights+compile") == (
        "bf16-weights+group-quant+compile", ["compile"])
    assert advise.built_on("amp-bf16+checkpointing+optim-8bit", "amp-bf16+optim-fused") == (
        "checkpointing+amp-bf16+optim-8bit", [])
    assert advise.built_on("amp-bf16+checkpointing", "amp-bf16+optim-fused")[1] == ["optim-fused"]
    # A stack the two cannot make together is the candidate alone (two adapters).
    assert advise.built_on("qlora+amp-bf16+checkpointing", "lora")[1] == []


def test_a_fix_that_fits_only_by_the_allocators_retries_says_so_and_ranks_after_sure_ones():
    target = {"reserved": 100 * advise.GIB, "step_ms": None}
    sure = {"stack": "a", "reserved": 50 * advise.GIB, "step_ms": 200.0, "left": advise.GIB}
    retrying = {"stack": "b", "reserved": 60 * advise.GIB, "step_ms": 100.0, "left": 5 * advise.GIB,
                "retrying": True}
    first, second = advise.rank_fixes(target, [retrying, sure])
    assert first.startswith("a:")
    assert "only by the allocator freeing its cache and retrying every step" in second


def test_advise_for_a_cell_that_fits_offers_a_larger_batch(small_l4, capsys):
    assert main(["advise", "--workload", "gpt", "--size", "smoke", "--gpu", "small-l4", "--profiles",
                 str(small_l4)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("projected: baseline fits on small-l4 with ") and "a larger batch fits: up to " in out


def test_a_gpu_dearer_by_the_hour_is_named_only_where_it_is_cheaper_per_sample():
    from types import SimpleNamespace

    from harness.profiles import load_profiles

    profiles = load_profiles()
    # On the H100 ($3.78/h) a million samples cost $1.00; on the B200 ($6.69/h, faster) $0.80; on the A10 ($0.86/h)
    # and the L4 ($0.80/h), both slower, $1.20 and $1.50. Every other GPU runs out of memory here.
    costs = {"h100-sxm": 1.0, "b200": 0.8, "l4": 1.5, "a10": 1.2}

    def project(gpu="h100-sxm", **_):
        return SimpleNamespace(status="ok" if gpu in costs else "oom", peak_reserved_bytes=GIB,
                               peak_reserved_high_bytes=GIB, device_overhead_bytes=GIB // 2, peak_allocated_bytes=GIB,
                               fits=gpu in costs, usd_per_million_samples=costs.get(gpu), step_time_ms_p50=10.0,
                               batch_size=8, throughput_samples_s=800.0)

    request = SimpleNamespace(max_batch=True, technique="amp-bf16")
    lines = advise._when_it_fits(request, project(), profiles["h100-sxm"], profiles,
                                 lambda changes: [project(**c) for c in changes], None)
    named = [line.split(": ")[1].split(" ")[0] for line in lines[:-1]]
    assert named == ["b200", "a10", "l4"]  # per sample, cheapest first; no other GPU dearer by the hour
    assert lines[0].startswith("another GPU holds it: b200") and "(dearer by the hour, cheaper per sample" in lines[0]
    assert lines[2].endswith("(dearer per sample)")
    assert lines[3].startswith("per sample, each GPU is compared at the largest batch it holds (here $1.00")


def test_gpus_are_compared_per_sample_at_the_largest_batch_each_holds():
    from types import SimpleNamespace

    from harness.profiles import load_profiles

    profiles = load_profiles()
    # At the asked batch 8 the H100 costs $1.00 per million samples and the B200 $1.10; at their largest
    # batches (32 and 96) $0.90 and $0.60: the B200, dearer at batch 8, is cheaper as a buyer would run it.
    costs = {("h100-sxm", False): (8, 1.0), ("h100-sxm", True): (32, 0.9),
             ("b200", False): (8, 1.1), ("b200", True): (96, 0.6)}

    def project(gpu="h100-sxm", max_batch=False, **_):
        batch, usd = costs.get((gpu, max_batch), (8, None))
        return SimpleNamespace(status="ok" if usd else "oom", peak_reserved_bytes=GIB, peak_reserved_high_bytes=GIB,
                               device_overhead_bytes=GIB // 2, peak_allocated_bytes=GIB, fits=bool(usd),
                               usd_per_million_samples=usd, step_time_ms_p50=10.0, batch_size=batch,
                               throughput_samples_s=800.0)

    request = SimpleNamespace(max_batch=False, technique="amp-bf16")
    lines = advise._when_it_fits(request, project(), profiles["h100-sxm"], profiles,
                                 lambda changes: [project(**c) for c in changes], None)
    assert lines[0].startswith("a larger batch fits: up to 32 (now 8)")
    assert lines[1].startswith("another GPU holds it: b200") and "$1.10 per million samples; up to batch 96: $0.60" \
        in lines[1] and lines[1].endswith("(dearer by the hour, cheaper per sample)")
    assert "(here $0.90 per million samples)" in lines[2] and len(lines) == 3


def test_advise_compares_gpus_at_a_prices_file(monkeypatch, tmp_path, capsys):
    seen = {}

    def record(request, profiles, progress):
        seen.update(profiles)
        return advise.Advice("l4", {}, [], "projected: (not asked here)")

    monkeypatch.setattr(advise, "advise", record)
    prices = tmp_path / "prices.csv"
    prices.write_text("gpu,usd_per_hour,date,source\nh200,3.50,2026-11,our contract\n")
    assert main(["advise", "--gpu", "l4", "--size", "smoke", "--prices", str(prices)]) == 0
    assert seen["h200"].usd_per_hour == 3.5 and seen["l4"].usd_per_hour  # the file's price beside the profiles'
    prices.write_text("gpu,usd_per_hour,date,source\nh200,-1,2026-11,x\n")
    assert main(["advise", "--gpu", "l4", "--size", "smoke", "--prices", str(prices)]) == 2
    err = capsys.readouterr().err
    assert "--prices" in err and "positive number" in err and len(err.splitlines()) == 1


def test_advise_refuses_a_family_of_several_gpus(capsys):
    assert main(["advise", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "one GPU" in err and "h100-nvl" in err and len(err.splitlines()) == 1


def test_an_exact_id_wins_over_its_family(monkeypatch, capsys):
    # `h200` is the SXM's id and the family of the SXM and the NVL: advise answers for the SXM.
    monkeypatch.setattr(advise, "_when_it_fits", lambda *args: ["(not asked here)"])
    assert main(["advise", "--workload", "gpt", "--size", "smoke", "--gpu", "h200"]) == 0
    assert capsys.readouterr().out.startswith("projected: baseline fits on h200 with ")


def test_gpus_without_bf16_are_advised_fp16_stacks():
    from harness.profiles import load_profiles

    profiles = load_profiles()
    t4 = advise.candidate_stacks("train", profiles["t4"])
    assert "amp-fp16+checkpointing" in t4 and not any("bf16" in stack for stack in t4)
    assert "fp16-weights+group-quant-int4" in advise.candidate_stacks("infer", profiles["v100-sxm2-32gb"])
    assert advise.candidate_stacks("train", profiles["a10"]) == list(advise.TRAIN_STACKS)


def test_advise_refuses_what_it_cannot_answer_with_the_command_that_can(capsys):
    from harness.cli import main

    assert main(["advise", "--gpu", "cpu", "--size", "smoke"]) == 2
    err = capsys.readouterr().err
    assert "cpu has no memory size: pick a GPU profile" in err and "--max-batch" not in err
    assert main(["advise", "--gpu", "l4", "--technique", "tensor-parallel", "--size", "gpt2-124m"]) == 2
    err = capsys.readouterr().err
    assert "--min-gpus counts how many" in err and "--dp N" not in err and "projecting" not in err


def test_stacks_projected_in_parallel_processes_give_the_rows_projected_here():
    from harness.profiles import load_profiles
    from harness.project.query import ProjectRequest

    profiles = load_profiles()
    requests = [ProjectRequest(gpu="l4", workload="gpt", technique=stack, mode="train", size="smoke", batch_size=2)
                for stack in ("amp-bf16", "checkpointing")]
    said = []
    parallel = advise.project_all(requests, profiles, said.append, workers=2)
    serial = advise.project_all(requests, profiles, said.append, workers=1)
    assert [(r.technique, r.peak_reserved_bytes, r.step_time_ms_p50) for r in parallel] == \
        [(r.technique, r.peak_reserved_bytes, r.step_time_ms_p50) for r in serial]
    assert [r.technique for r in parallel] == ["amp-bf16", "checkpointing"]  # in the order asked
    assert said[0] == "projecting 2 cells in 2 processes" and "projecting checkpointing on l4" in said


def test_a_mistyped_size_is_refused_before_anything_is_projected(capsys):
    assert main(["advise", "--size", "gpt-7x", "--gpu", "l4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown size 'gpt-7x'" in err and "projecting" not in err


def test_a_summary_knows_a_fit_that_needs_the_allocators_retries():
    from types import SimpleNamespace

    gib = advise.GIB
    # Reserved 30 GiB on a 24 GiB card, live bytes 20 GiB: the projection says it fits, by retrying.
    record = SimpleNamespace(technique="t", peak_reserved_bytes=30 * gib, peak_reserved_high_bytes=None,
                             device_overhead_bytes=0, peak_allocated_bytes=20 * gib, fits=True, status="ok",
                             reason=None, batch_size=8, usd_per_million_samples=None, step_time_ms_p50=1.0,
                             gen_len=None, mode="train")
    summary = advise._summary(record, 24 * gib)
    assert summary["retrying"] and summary["left"] == 4 * gib
    assert not advise._summary(SimpleNamespace(**{**vars(record), "peak_reserved_bytes": 22 * gib}),
                               24 * gib)["retrying"]
