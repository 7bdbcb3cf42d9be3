"""`headroom project` as a user types it: one JSON record or a readable table, families and prices, the
largest batch and model with what they leave, and the flags it refuses with the reason."""

from __future__ import annotations

import json
import re

import pytest

from harness.cli import main
from harness.project import MAX_BATCH_LIMIT, max_batch
from suites.techniques import parse_stack
from suites.workloads import WORKLOADS
from tests.test_projection import PROFILES, _cell


def test_project_command_prints_one_json_record(capsys):
    assert main(["project", "--workload", "bert", "--size", "bert-base", "--gpu", "a100-sxm4-80gb",
                 "--technique", "amp-bf16+checkpointing", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["source"] == "projected" and record["status"] == "ok" and record["fits"] is True
    assert record["technique"] == "checkpointing+amp-bf16" and record["usd_per_million_samples"] > 0


def test_project_command_largest_model(capsys):
    # Mixed-precision AdamW keeps 16 bytes of state per parameter (fp32 weights, grads, two moments):
    # 13B needs ~208 GB before activations, more than an H200's 141 GiB; 1.3B needs ~21 GB, more than
    # a T4's 16 GiB. So the answers are bounded by physics whatever the allocator details.
    answers = {}
    for gpu, technique in (("h200", "amp-bf16"), ("t4", "amp-fp16")):
        assert main(["project", "--gpu", gpu, "--technique", technique, "--largest-model", "--format", "json"]) == 0
        for line in capsys.readouterr().out.splitlines():  # a family answers for each variant
            answer = json.loads(line)
            answers[answer["gpu"]] = answer["largest_size_that_fits"]
    assert set(answers) == {"h200", "h200-nvl", "t4"}
    assert answers["h200"] in ("gpt2-1.3b", "gpt-7b") and answers["h200-nvl"] in ("gpt2-1.3b", "gpt-7b")
    assert answers["t4"] in ("gpt2-124m", "gpt2-350m")


def test_project_takes_a_family_as_run_does(capsys):
    assert main(["project", "--gpu", "h100", "--size", "smoke", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(row["gpu"] for row in rows) == ["h100-nvl", "h100-pcie", "h100-sxm"]
    assert main(["project", "--gpu", "h100-sxm", "--size", "smoke", "--format", "json"]) == 0
    assert [json.loads(line)["gpu"] for line in capsys.readouterr().out.splitlines()] == ["h100-sxm"]
    assert main(["project", "--gpu", "h1OO", "--size", "smoke"]) == 2
    assert "unknown GPU 'h1OO'" in capsys.readouterr().err


def test_project_costs_at_the_price_given_says_which_and_prints_bytes_in_gib(capsys, tmp_path):
    args = ["project", "--gpu", "h100-sxm,mi250x", "--size", "smoke", "--format", "json"]
    assert main(args) == 0
    h100, mi250x = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert "cost at $3.78/h, 2026-05-07 (on-demand, Lambda" in h100["notes"]
    assert mi250x["usd_per_million_samples"] is None and "no price for mi250x: give --prices" in mi250x["notes"]
    prices = tmp_path / "prices.csv"
    prices.write_text("gpu,usd_per_hour,date,source\nh100-sxm,7.56,2026-11-30,our negotiated rate\n")
    assert main([*args, "--prices", str(prices)]) == 0
    doubled = json.loads(capsys.readouterr().out.splitlines()[0])
    assert doubled["usd_per_million_samples"] == pytest.approx(2 * h100["usd_per_million_samples"])
    assert "cost at $7.56/h, 2026-11-30 (on-demand, our negotiated rate)" in doubled["notes"]
    assert main(["project", "--gpu", "h100-sxm", "--size", "smoke"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"peak_reserved_bytes +[\d,]+ \(\d+\.\d\d GiB\)", table)


def test_largest_model_says_why_there_is_none_and_at_which_batch(capsys):
    assert main(["project", "--gpu", "t4", "--technique", "amp-bf16", "--largest-model"]) == 0
    out = capsys.readouterr().out
    assert "none (unsupported:" in out and "bf16" in out
    # Accumulation needs one sample per micro-batch; BatchNorm in training two samples.
    assert main(["project", "--gpu", "t4", "--technique", "grad-accumulation", "--largest-model", "--format",
                 "json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == 4
    assert main(["project", "--gpu", "t4", "--workload", "resnet50", "--largest-model", "--format", "json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["batch_size"] == 2 and answer["largest_size_that_fits"] == "resnet50"
    assert main(["project", "--gpu", "t4", "--workload", "resnet50", "--technique", "grad-accumulation",
                 "--largest-model", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == 8  # 4 micro-batches of 2


def test_largest_model_goes_past_a_smaller_size_that_does_not_fit_and_stops_at_the_weight_floor(monkeypatch):
    # llama3-8b (sequence 8192) has fewer parameters than gpt-13b (4096) but needs more memory; a search that
    # stopped at the first size that does not fit answered gpt-7b where gpt-13b fits.
    import harness.project.search as search

    tried = []

    def fits_at(cell, batch_size=None):
        tried.append(cell.spec.name)
        return cell.spec.name != "llama3-8b" and search._param_estimate(cell.workload, cell.spec) < 14e9

    monkeypatch.setattr(search, "fits_at", fits_at)
    answer = search.largest_model(_cell("gpt", "gpt2-124m", "amp-bf16", gpu="l4"))
    assert answer.size == "gpt-13b"
    assert answer.reason == "llama3-8b, with fewer parameters, does not fit (sequence 8192)"
    # No stack holds a weight in under 4 bits: sizes whose weights alone pass the L4's memory are not traced.
    capacity = PROFILES["l4"].memory_bytes
    assert all(search._param_estimate(WORKLOADS["gpt"], WORKLOADS["gpt"].sizes[name]) * 0.5 <= capacity
               for name in tried) and "gpt3-175b" not in tried
    # The floor holds only where every weight stays on the device, dense: not where a stack shares, drops,
    # sparsifies or offloads them (param-sharing fits gpt3-175b on one H100).
    assert search._weight_floor_holds(parse_stack("amp-bf16+group-quant-int4"))
    assert not any(search._weight_floor_holds(parse_stack(stack)) for stack in
                   ("param-sharing", "low-rank", "unstructured-pruning", "cpu-offload+amp-bf16"))
    monkeypatch.setattr(search, "fits_at", lambda cell, batch_size=None: False)
    nothing = search.largest_model(_cell("gpt", "gpt2-124m", "amp-bf16", gpu="l4"))
    assert nothing.size is None and nothing.reason == "even smoke does not fit"


def test_max_batch_of_a_batchnorm_net_in_training_starts_at_two_samples(capsys, monkeypatch):
    # The 32 px smoke ResNet's last feature map is 1 x 1: BatchNorm cannot train on one sample.
    assert max_batch(_cell("resnet50", "smoke", gpu="t4"), smallest=2, limit=6) == 6
    # The command asks for that smallest batch (the search itself stubbed: the full one takes 40 s).
    import harness.project.query

    asked = {}
    monkeypatch.setattr(harness.project.query, "max_batch", lambda *a, **k: asked.update(k) or 0)
    assert main(["project", "--gpu", "t4", "--workload", "resnet50", "--size", "smoke", "--max-batch",
                 "--technique", "grad-accumulation", "--format", "json"]) == 0
    assert asked["smallest"] == 8 and asked["step"] == 4  # 4 micro-batches of 2 samples
    assert json.loads(capsys.readouterr().out)["batch_size"] == 8  # a search answering 0 shows the smallest


@pytest.mark.parametrize("argv, message", [
    (["--largest-model", "--size", "smoke"], "drop --size"),
    (["--largest-model", "--seq-len", "128"], "drop --seq-len"),
    (["--largest-model", "--batch-size", "2"], "drop --batch-size"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer up to 2147483647, got 0"),
    (["--gpu", "cpu", "--max-batch"], "--max-batch needs a profile with a memory size"),
    (["--mode", "infer", "--max-context", "--prompt-len", "100"], "--max-context solves for the prompt's length"),
    (["--size", "gpt2-124m,gpt2-350m"], "expected one name, got the list 'gpt2-124m,gpt2-350m'"),
    (["--technique", "amp-bf16,checkpointing"], "one stack joins its techniques with '+'"),
    (["--gpu", ""], "expected a name, got nothing"),
])
def test_project_refuses_flags_it_would_ignore_or_cannot_honour(argv, message, capsys):
    argv = ["project", *(["--gpu", "t4"] if "--gpu" not in argv else []), *argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_max_batch_of_an_unsupported_stack_is_an_unsupported_row_without_a_search(capsys):
    # The row is still written (a script reads why), and the command fails in one line, as other bad input does.
    assert main(["project", "--gpu", "t4", "--size", "gpt2-124m", "--technique", "amp-bf16", "--max-batch",
                 "--format", "json"]) == 2
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["status"] == "unsupported" and record["batch_size"] == 8  # the size's own batch
    assert err.count("\n") == 1 and err.startswith("headroom: error: unsupported here: ")


def test_several_gpus_end_with_a_side_by_side_summary_fastest_first(capsys):
    assert main(["project", "--gpu", "a100", "--size", "smoke"]) == 0
    out = capsys.readouterr().out
    summary = out.split("side by side, fastest first (projected):\n")[1].splitlines()
    assert summary[0].split()[:3] == ["GPU", "status", "batch"] and len(summary) == 1 + 4  # the four A100s
    speeds = [float(line.split()[6].replace(",", "")) for line in summary[1:]]  # samples/s
    assert speeds == sorted(speeds, reverse=True)


def test_max_batch_where_no_batch_fits_says_so(capsys):
    assert main(["project", "--gpu", "l4", "--size", "gpt-7b", "--max-batch", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "oom" and record["reason"].startswith("no batch fits: even batch 1 needs ")


def test_max_batch_says_when_it_stopped_at_its_search_limit(capsys):
    assert main(["project", "--gpu", "h200-nvl", "--size", "smoke", "--mode", "infer", "--max-batch",
                 "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["batch_size"] == MAX_BATCH_LIMIT and "search limit" in record["notes"]


def test_the_table_shows_every_column_of_the_record(capsys):
    assert main(["project", "--gpu", "t4", "--size", "smoke"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert main(["project", "--gpu", "t4", "--size", "smoke", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [line.split()[0] for line in table] == list(record)


def test_bench_family_without_that_gpu_projects_and_says_so(tmp_path, capsys):
    out = tmp_path / "a100"
    code = main(["run", "--gpu", "a100", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
                 "--out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "PROJECTED" in err and "a100-sxm4-80gb" in err
    import pandas as pd

    frame = pd.read_parquet(out / "results.parquet")
    assert set(frame["source"]) == {"projected"} and len(frame) == 4
    assert set(frame["gpu"]) == {"a100-pcie-40gb", "a100-sxm4-40gb", "a100-pcie-80gb", "a100-sxm4-80gb"}
    assert "<strong>projected</strong>" in (out / "report.html").read_text()
    assert main(["run", "--gpu", "a100", "--require-device", "--out", str(tmp_path / "x")]) == 2
