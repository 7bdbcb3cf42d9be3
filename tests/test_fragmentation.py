"""The fragmentation probe (harness/fragmentation.py): the guide's scenario and a variable-length training
loop through the allocator model under each setting, C4's verdict, the command and the report."""

from __future__ import annotations

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
from harness.profiles import load_profiles

PROFILES = load_profiles()


def test_the_guide_scenario_needs_the_cache_freed_on_a_tight_device():
    # Six 1 GiB tensors, three freed: the cache holds 3 GiB in 1 GiB segments no 2 GiB request can use.
    roomy = replay_fragmentation(guide_events(), "native", None, "g")
    assert roomy.retries == 0 and roomy.peak_reserved_bytes == 8 * GiB and roomy.most_held_free_bytes == 3 * GiB
    assert roomy.largest_free_block_bytes == GiB
    tight = replay_fragmentation(guide_events(), "native", 7 * GiB, "g")
    assert not tight.oom and tight.retries == 1 and tight.peak_reserved_bytes == 6 * GiB  # freed, then served
    assert replay_fragmentation(guide_events(), "native", int(4.5 * GiB), "g").oom  # 3 live + 2 do not fit
    expandable = replay_fragmentation(guide_events(), "expandable_segments", 7 * GiB, "g")
    assert not expandable.oom and expandable.retries == 1


def test_a_variable_length_loop_fragments_the_native_allocator_most():
    cell = Cell("gpt", "smoke", "train", "baseline", "h100-sxm", 4, source="projected").resolve(PROFILES)
    events, lengths = variable_length_events(cell, steps=6)
    assert len(lengths) == 6 and len(set(lengths)) > 1 and all(8 <= length <= 64 for length in lengths)
    assert variable_length_events(cell, steps=6)[1] == lengths  # seeded: the same loop every time
    results = {s: replay_fragmentation(events, s, None, "loop") for s in ("native", "expandable_segments",
                                                                            "cudaMallocAsync")}
    assert results["native"].waste >= results["expandable_segments"].waste >= results["cudaMallocAsync"].waste == 0


def _result(allocator, waste, scenario="loop"):
    return FragmentationResult(scenario, allocator, "projected", 100, round(100 * (1 - waste)), None, 0)


def test_c4_verdicts():
    assert judge_c4([_result("native", 0.4), _result("expandable_segments", 0.05)]).startswith("supported")
    assert "expandable segments: 5%" in judge_c4([_result("native", 0.4), _result("expandable_segments", 0.05)])
    assert judge_c4([_result("native", 0.1)]).startswith("contradicted: at most 10%")
    assert judge_c4([_result("native", 0.7)]).startswith("exceeded: 70%")
    assert judge_c4([_result("expandable_segments", 0.1)]).startswith("not measurable here")


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
    rows = pd.read_csv(out)
    assert len(rows) == 6 and set(rows["allocator"]) == {"native", "expandable_segments", "cudaMallocAsync"}
    from harness.records import records_frame

    html = render([records_frame([])], fragmentation=rows)
    assert "Fragmentation probe" in html and "Guide claim C4" in html
    if not torch.cuda.is_available():
        assert main(["fragmentation", "--measure"]) == 2
        assert "--measure runs the guide's scenario on a CUDA device" in capsys.readouterr().err
