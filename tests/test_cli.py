"""The `headroom` command: an end-to-end run on this machine, listings, and one-line errors for bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    code = main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline,checkpointing", "--mode",
                 "train,infer", "--repeats", "1", "--out", str(out)])
    return code, out


def test_run_writes_frame_csv_and_report(small_run):
    code, out = small_run
    assert code == 0
    frame = pd.read_parquet(out / "results.parquet")
    csv = pd.read_csv(out / "results.csv")
    assert len(frame) == len(csv) == 8  # 4 measured cells, each with its projected twin
    measured = frame[frame["source"] == "measured"]
    assert set(measured["status"]) == {"ok", "unsupported"}
    ok = measured[measured["status"] == "ok"]
    assert len(ok) == 3 and set(ok["source"]) == {"measured"} and set(ok["gpu"]) == {"cpu"}
    assert (ok["timed_steps"] >= 10).all()
    assert (ok["step_time_ms_p90"] >= ok["step_time_ms_p50"]).all()
    assert (ok["peak_allocated_bytes"] >= ok["params_bytes"]).all()
    # No price and no peak FLOP/s are known for a host CPU: MFU and cost stay empty, not 0.
    assert ok["mfu"].isna().all() and ok["usd_per_million_samples"].isna().all()
    html = (out / "report.html").read_text()
    assert '<h3 class="inline">gpt</h3>' in html and "checkpointing" in html


def test_projected_twins_carry_their_error_against_the_measurement(small_run):
    _, out = small_run
    frame = pd.read_parquet(out / "results.parquet")
    twins = frame[(frame["source"] == "projected") & (frame["status"] == "ok")]
    assert len(twins) == 3
    assert (twins["peak_error_vs_measured"].abs() < 0.03).all()
    # The host CPU has no caching allocator, so there is no reserved figure to check the model against.
    assert twins["reserved_error_vs_measured"].isna().all()


def test_a_folder_holding_a_run_is_not_reused_without_resume(small_run, capsys):
    _, out = small_run
    before = sorted((out / "cells").iterdir())
    assert main(["run", "--workload", "gpt", "--technique", "baseline", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run (8 cells)" in err and "--resume" in err
    assert sorted((out / "cells").iterdir()) == before  # nothing lost, nothing added


def test_a_resume_with_other_measurement_settings_is_refused(small_run, capsys):
    _, out = small_run
    before = sorted((out / "cells").iterdir())
    assert main(["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline,checkpointing", "--mode",
                 "train,infer", "--repeats", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cells were run with --repeats 1 (now 3): resume with those" in err
    assert sorted((out / "cells").iterdir()) == before


def test_a_report_of_some_slices_of_a_sharded_run_says_which_are_missing(tmp_path, capsys):
    argv = ["run", "--gpu", "cpu", "--workload", "gpt", "--technique", "baseline", "--mode", "infer",
            "--repeats", "1", "--steps", "10", "--no-accuracy"]
    for index in (1, 2):
        assert main([*argv, "--shard", f"{index}/2", "--out", str(tmp_path / f"s{index}")]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "s1"), "--out", str(tmp_path / "one.md")]) == 0
    assert "slices 2/2 of a sharded run are not among these results" in capsys.readouterr().err
    assert "slices 2/2 of a sharded run" in (tmp_path / "one.md").read_text()
    assert main(["report", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "both.md")]) == 0
    assert "sharded run" not in capsys.readouterr().err


def test_checkpointing_holds_fewer_activation_bytes(small_run):
    _, out = small_run
    frame = pd.read_parquet(out / "results.parquet")
    frame = frame[frame["source"] == "measured"].set_index(["mode", "technique"])
    base = frame.loc[("train", "baseline")]
    ckpt = frame.loc[("train", "checkpointing")]
    assert ckpt["activations_bytes"] < base["activations_bytes"]
    assert ckpt["params_bytes"] == base["params_bytes"]


def test_report_merges_results(small_run, tmp_path, capsys):
    _, out = small_run
    target = tmp_path / "merged.html"
    assert main(["report", str(out), str(out / "results.csv"), "--out", str(target)]) == 0
    assert target.read_text().count('<h3 class="inline">gpt</h3>') == 1


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--workload", "gtp"], "did you mean 'gpt'"),
    (["run", "--technique", "amp-bf17"], "did you mean amp-bf16"),
    (["run", "--technique", "amp-bf16+amp-fp16"], "incompatible stack"),
    (["run", "--gpu", "a1000"], "unknown GPU 'a1000'"),
    (["run", "--gpu", "a100", "--require-device"], "--require-device: no a100-pcie-40gb"),
    (["run", "--scale", "huge"], "unknown scale 'huge'"),
    (["run", "--size", "gpt2-9b"], "unknown size 'gpt2-9b'"),
    (["run", "--size", "gpt2-125m"], "unknown size 'gpt2-125m'; did you mean gpt2-124m"),
    (["project", "--size", "gpt2-125m", "--gpu", "t4"], "unknown size 'gpt2-125m' for workload 'gpt' (did you mean "
                                                        "'gpt2-124m'?); valid: "),
    (["run", "--mode", "serve"], "unknown mode 'serve'"),
    (["run", "--steps", "3"], "expected 10 to 100000 timed steps"),
    (["run", "--out", "/proc/headroom"], "not writable"),
    (["report", "README.md", "--out", "x.html"], "not a results file"),
    (["frobnicate"], "invalid choice"),
    (["run", "--cell-timeout", "soon"], "expected seconds, got 'soon'"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("headroom: error:")
    assert fragment in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["profiles", "techniques", "workloads", "env"])
def test_a_listing_refuses_a_missing_profiles_folder_before_printing(command, tmp_path, capsys):
    assert main([command, "--profiles", str(tmp_path / "typo")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "profiles folder does not exist" in captured.err


def test_profiles_list_the_memory_a_process_can_use_its_bandwidth_and_a_packages_share(capsys):
    assert main(["profiles"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["id"].split()[3:] == ["usable", "16-bit", "dense", "bandwidth", "price"]
    assert "22.5 GiB" in lines["l4"] and "0.30 TB/s" in lines["l4"]  # the driver's 23,034 MiB, not "24 GB"
    assert "65 TFLOP/s (fp16)" in lines["t4"]  # no bf16 on Turing
    assert "64.0 GiB" in lines["mi250x"] and "[each of its 2 devices; the package: 128 GiB]" in lines["mi250x"]


def test_a_mistyped_flag_is_named_with_the_closest_one_and_its_commands_help(capsys):
    assert main(["ledger", "add", "results", "--ledgr", "l.csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --ledgr l.csv; did you mean --ledger?" in err
    assert "(see `headroom ledger add --help`)" in err
    assert main(["profiles", "--bogus"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess


def test_a_malformed_user_profile_is_one_line_naming_file_and_field(tmp_path, capsys):
    (tmp_path / "mygpu.toml").write_text('id = "mygpu"\nfamily = "mine"\nname = "Mine"\nvendor = "nvidia"\n'
                                         'match = ["Mine"]\nmemory_gib = -4\n[sources]\nmemory_gib = "me"\n'
                                         '[features]\nbf16 = true\ntf32 = true\nfp8 = false\n'
                                         'sparse_2to4 = true\nflash_attention = true\n')
    for argv in (["--profiles", str(tmp_path), "profiles"], ["profiles", "--profiles", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "mygpu.toml" in err and "memory_gib" in err and "positive" in err


def test_a_results_file_from_an_unknown_schema_is_refused(tmp_path, capsys):
    import pandas as pd

    from harness.records import SCHEMA_VERSION

    frame = pd.read_csv(Path(__file__).parent / "fixtures" / "schema_v1" / "results.csv")
    frame["schema_version"] = SCHEMA_VERSION + 5
    frame.to_csv(tmp_path / "future.csv", index=False)
    assert main(["report", str(tmp_path / "future.csv"), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema version" in err and "upgrade headroom" in err


def test_listings(capsys):
    for command in ("profiles", "techniques", "workloads", "env"):
        assert main([command]) == 0
    out = capsys.readouterr().out
    assert "a100-sxm4-80gb" in out and "grad-accumulation" in out and "gpt3-175b" in out
    assert "torch_version" in out and "nvml" in out
    # Each listing says what its columns are; sizes in the unit that reads.
    assert "technique                guide phase" in out and "workload      size         scale" in out
    assert re.search(r"gpt3-175b +large +174\.6 B +1 +2048 tokens", out)
