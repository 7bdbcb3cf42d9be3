"""The fragmentation probe (harness/fragmentation.py): the guide's scenario and a variable-length training
loop through the allocator model under each setting, C4's verdict, the command and the report."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pandas as pd
import pytest
import torch

from harness.cell import Cell
from harness.fragmentation import (
    FragmentationResult,
    GiB,
    guide_events,
    judge_c4,
    measure_guide_scenario,
    measure_loop,
    replay_fragmentation,
    variable_length_events,
)
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import project_outcome
from suites.step import Step
from suites.workloads import PROBES, WORKLOADS, get_workload
from suites.workloads.fragmentation import loop_specs, step_lengths

PROFILES = load_profiles()


def test_the_guide_scenario_needs_the_cache_freed_on_a_tight_device():
    # Six 1 GiB tensors, three freed: the cache holds 3 GiB in 1 GiB segments no 2 GiB request can use.
    roomy = replay_fragmentation(guide_events(), "native", None, "g")
    assert roomy.retries == 0 and roomy.peak_reserved_bytes == 8 * GiB and roomy.most_held_free_bytes == 3 * GiB
    assert roomy.largest_free_block_bytes == GiB
    tight = replay_fragmentation(guide_events(), "native", 7 * GiB, "g")
    assert not tight.oom and tight.retries == 1 and tight.peak_reserved_bytes == 6 * GiB  # freed, then served
    # Asked for 4 GiB on 6.5 GiB: the cache is freed (one retry) and 3 live + 4 GiB still do not fit.
    short = replay_fragmentation(guide_events(request=4 * GiB), "native", int(6.5 * GiB), "g")
    assert short.oom and short.retries == 1
    expandable = replay_fragmentation(guide_events(), "expandable_segments", 7 * GiB, "g")
    assert not expandable.oom and expandable.retries == 1


def test_a_variable_length_loop_fragments_the_native_allocator_most():
    # gpt2-124m's shapes at two layers: a smoke size's blocks are too small to tell the allocators apart.
    spec = get_workload("gpt").with_depth(get_workload("gpt").size("gpt2-124m"), 2)
    cell = Cell("gpt", "gpt2-124m", "train", "baseline", "h100-sxm", 4, source="projected").resolve(PROFILES, spec=spec)
    events, lengths = variable_length_events(cell, steps=6)
    assert len(lengths) == 6 and len(set(lengths)) > 1 and all(64 <= length <= 1024 for length in lengths)
    assert variable_length_events(cell, steps=6)[1] == lengths  # seeded: the same loop every time
    results = {s: replay_fragmentation(events, s, None, "loop") for s in ("native", "expandable_segments",
                                                                            "cudaMallocAsync")}
    # Native caches blocks sized for other lengths (half its reserve unused at the peak); expandable
    # segments reuse the same pages; the async pool is modelled at the live bytes (no waste by construction).
    assert results["native"].waste > 0.2 > 0.05 > results["expandable_segments"].waste
    assert results["cudaMallocAsync"].waste == 0


def test_the_fragmentation_workload_draws_a_seeded_length_per_step_and_is_run_only_when_named():
    workload = get_workload("fragmentation")
    assert workload.name not in WORKLOADS and workload.name in PROBES  # not in the default plan
    spec = workload.size("gpt2-124m")
    loop = loop_specs(workload, spec, "train")
    lengths = [size.seq_len for size in loop]
    assert lengths == step_lengths(spec) and len(set(lengths)) > 2
    assert all(length % 64 == 0 and 64 <= length <= spec.seq_len for length in lengths)
    assert loop_specs(workload, spec, "infer") is None and loop_specs(get_workload("gpt"), spec, "train") is None


def test_projected_over_its_loop_the_native_allocator_reserves_more_than_for_one_length():
    """The longest step's peak, the loop's reserved: blocks freed by steps of other lengths stay cached."""
    def projected(workload, stack):
        spec = get_workload(workload).with_depth(get_workload(workload).size("gpt2-124m"), 2)
        cell = Cell(workload, "gpt2-124m", "train", stack, "h100-sxm", 4, source="projected")
        return project_outcome(cell.resolve(PROFILES, spec=spec))

    loop, fixed = projected("fragmentation", "amp-bf16"), projected("gpt", "amp-bf16")
    assert loop.memory.peak_allocated == fixed.memory.peak_allocated  # the longest drawn is the whole 1024
    assert loop.memory.peak_reserved > 1.1 * fixed.memory.peak_reserved
    expandable = projected("fragmentation", "amp-bf16+alloc-expandable")
    assert expandable.memory.peak_reserved < loop.memory.peak_reserved
    assert loop.speed.step_time_ms_p50 < fixed.speed.step_time_ms_p50  # shorter steps on average
    drawn = step_lengths(get_workload("fragmentation").size("gpt2-124m"))
    assert f"sequence lengths {', '.join(map(str, drawn))}," in loop.notes[0] and "not allocated" in loop.notes[1]
    # Its tokens and FLOPs per sample are the loop's mean step's, so tokens/s and MFU are not overstated.
    record = to_record(Cell("fragmentation", "gpt2-124m", "train", "amp-bf16", "h100-sxm", 4,
                            source="projected").resolve(PROFILES), loop, "test")
    mean = sum(drawn) / len(drawn)
    assert max(drawn) > mean > min(drawn)  # a loop of several lengths, so the mean is not the longest's
    assert record.seq_len == round(mean) and record.tokens_per_s == pytest.approx(record.throughput_samples_s * mean)
    infer = Cell("fragmentation", "gpt2-124m", "infer", "amp-bf16", "h100-sxm", 4, source="projected").resolve(PROFILES)
    assert to_record(infer, project_outcome(infer), "test").seq_len == 1024  # one forward at the whole length


def test_measured_it_runs_each_length_once_before_the_timed_steps_cycle_through_them():
    cell = Cell("fragmentation", "smoke", "train", "baseline", "cpu", 2).resolve(PROFILES)
    seen = []
    original = Step.__call__

    def spy(self, batch, *args, **kwargs):
        seen.append(batch["input_ids"].shape[1])
        return original(self, batch, *args, **kwargs)

    with mock.patch.object(Step, "__call__", spy):
        outcome = measure(cell, MeasureSettings(warmup=0, steps=10, repeats=1))
    lengths = step_lengths(cell.spec)
    assert outcome.status == "ok" and seen[:len(lengths)] == lengths
    assert seen[len(lengths)] == max(lengths)  # the step memory is read on
    assert len(seen) == len(lengths) + 1 + 16 and seen[-16:] == lengths * 2  # 10 timed steps: two whole loops
    assert any("variable-length loop" in note for note in outcome.notes)


def _result(allocator, waste, scenario="loop"):
    return FragmentationResult(scenario, allocator, "projected", 100, round(100 * (1 - waste)), None, 0)


def test_c4_verdicts():
    assert judge_c4([_result("native", 0.4), _result("expandable_segments", 0.05)]).startswith("supported")
    assert "expandable segments: 5%" in judge_c4([_result("native", 0.4), _result("expandable_segments", 0.05)])
    assert judge_c4([_result("native", 0.1)]).startswith("contradicted: at most 10%")
    assert judge_c4([_result("native", 0.7)]).startswith("exceeded: 70%")
    assert judge_c4([_result("expandable_segments", 0.1)]).startswith("not measurable here")
    # A loop that ran out of memory stopped short of its peak: no verdict from it, nor from the guide's row alone.
    stopped = dataclasses.replace(_result("native", 0.08), oom=True)
    verdict = judge_c4([_result("native", 0.0, scenario="guide"), stopped])
    assert verdict.startswith("not measurable here: loop ran out of memory"), verdict


def test_every_setting_stops_at_the_first_request_past_the_capacity():
    # The driver's pool (cudaMallocAsync) too: what it holds never exceeds the device.
    events = [("alloc", i, GiB) for i in range(10)]
    for setting in ("native", "expandable_segments", "cudaMallocAsync"):
        result = replay_fragmentation(events, setting, 4 * GiB, "s")
        assert result.oom and result.peak_reserved_bytes <= 4 * GiB, setting


def test_measuring_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the gpu test measures instead")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        measure_guide_scenario("native")


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["native", "expandable_segments", "cudaMallocAsync"])
def test_the_guide_scenario_on_the_device(setting):
    result = measure_guide_scenario(setting)
    assert not result.oom and result.peak_reserved_bytes >= 6 * GiB
    if setting == "native":
        assert result.largest_free_block_bytes >= GiB  # the freed tensors' blocks stay cached
    loop = measure_loop(setting, "gpt2-124m", 4, [512, 128, 1024, 256])
    assert not loop.oom and loop.peak_reserved_bytes >= loop.allocated_at_reserved_peak_bytes > 0


def test_the_command_prints_the_rows_and_c4_and_the_report_draws_them(tmp_path, capsys):
    from harness.cli import main
    from reports.build import render

    out = tmp_path / "fragmentation.csv"
    assert main(["fragmentation", "--size", "smoke", "--batch-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "C4 (fragmentation wastes 30-50% of GPU memory)" in printed and "expandable_segments" in printed
    table = printed.split("\nscenario [1] ")[0].splitlines()
    assert len(table) == 7 and max(map(len, table)) <= 120  # scenarios numbered, their text under the table
    assert "scenario [2] variable-length training: gpt smoke batch 2, lengths " in printed
    assert main(["fragmentation", "--size", "smoke", "--batch-size", "2", "--out", str(out)]) == 0
    assert "(replacing the file there)" in capsys.readouterr().err
    rows = pd.read_csv(out)
    assert len(rows) == 6 and set(rows["allocator"]) == {"native", "expandable_segments", "cudaMallocAsync"}
    from harness.records import records_frame

    html = render([records_frame([])], fragmentation=rows)
    assert "Fragmentation probe" in html and "Guide claim C4" in html
    if not torch.cuda.is_available():
        assert main(["fragmentation", "--measure"]) == 2
        assert "--measure runs the guide's scenario on a CUDA device" in capsys.readouterr().err
    assert main(["fragmentation", "--out", str(tmp_path / "probe.txt")]) == 2  # CSV rows in a .txt: refused
    assert "written as .csv" in capsys.readouterr().err and not (tmp_path / "probe.txt").exists()


def test_a_first_run_keeps_the_probe_beside_its_rows_so_its_report_judges_c4(tmp_path):
    from types import SimpleNamespace

    import pandas as pd

    from harness.cli_fragmentation import run_probe
    from reports.fragmentation import FILE, fragmentation_section

    profiles = load_profiles()
    console = SimpleNamespace(print=lambda *a, **k: None)
    plan = SimpleNamespace(local=profiles["cpu"], foreign=[profiles["a10"], profiles["h100-sxm"]])
    frame = run_probe(plan, profiles, tmp_path, console)
    kept = pd.read_csv(tmp_path / FILE)
    assert set(kept["gpu"]) == {"h100-sxm"} and len(kept) == len(frame) and (kept["source"] == "projected").all()
    assert fragmentation_section(kept)["c4"]  # the report's C4 verdict now has rows to stand on
    assert run_probe(SimpleNamespace(local=profiles["cpu"], foreign=[]), profiles, tmp_path / "none", console) is None
