"""Projection: the fake-tensor trace against independently measured memory, the allocator model
against the documented fragmentation example, depth extrapolation against a full trace, fit and
max-batch answers (the command line: test_project_command.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from harness.cell import Cell
from harness.measure.local import MeasureSettings, measure
from harness.outcome import to_record
from harness.profiles import load_profiles
from harness.project import max_batch, oom_reason, project, project_outcome, traced
from harness.project.memory import MemoryProjection, _reserved, _with_workspaces, _workspaces_for, library_workspaces
from harness.project.roofline import estimate
from suites.techniques import TECHNIQUES, parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()
MiB = 2**20
GiB = 2**30


def _cell(workload: str, size: str, technique: str = "baseline", mode: str = "train", batch: int | None = None,
          gpu: str = "h100-sxm", spec=None, source: str = "projected"):
    """A resolved cell (`spec` replaces the size table's entry)."""
    spec = spec or WORKLOADS[workload].sizes[size]
    cell = Cell(workload, spec.name, mode, parse_stack(technique).name, gpu, batch or spec.batch_size, source)
    return cell.resolve(PROFILES, spec=spec)


def project_cell(cell: Cell):
    resolved = cell.resolve(PROFILES)
    return to_record(resolved, project_outcome(resolved), "t")


CASES = [(w, t) for w in ("resnet50", "bert", "gpt") for t in ("baseline", "amp-bf16", "checkpointing")]


@pytest.mark.parametrize("workload_name, technique", CASES)
def test_projected_peak_is_within_3_percent_of_the_measured_peak(workload_name, technique):
    cell = _cell(workload_name, "smoke", technique, gpu="cpu", source="measured")
    measured = to_record(cell, measure(cell, MeasureSettings(warmup=1, steps=10, repeats=1)), "t")
    projection = project(cell)
    projected = projection.memory
    error = projected.peak_allocated / measured.peak_allocated_bytes - 1
    assert abs(error) < 0.03, f"projected {projected.peak_allocated} vs measured {measured.peak_allocated_bytes}"
    assert projected.params == measured.params_bytes
    assert projected.optimizer == measured.optimizer_bytes
    assert projection.trace.param_count == measured.param_count


@pytest.mark.parametrize("workload_name, size, technique, mode", [
    ("gpt", "gpt2-124m", "amp-bf16", "train"), ("gpt", "gpt2-124m", "checkpointing", "train"),
    ("gpt", "gpt2-124m", "amp-bf16", "infer"), ("bert", "bert-base", "grad-accumulation", "train"),
])
def test_depth_extrapolation_matches_a_full_trace_of_a_mid_size_model(workload_name, size, technique, mode):
    batch = 4 if technique == "grad-accumulation" else 1
    spec = dataclasses.replace(WORKLOADS[workload_name].sizes[size], seq_len=256, batch_size=batch)
    h100 = PROFILES["h100-sxm"]
    cell = _cell(workload_name, size, technique, mode, batch, spec=spec)
    extrapolated = project(cell)
    assert extrapolated.memory.extrapolated_from  # 12 layers: traced at two small depths
    full = traced(cell)
    # The step's peak is the largest of its phases' peaks, each extrapolated on its own: at 2-3 layers
    # the embeddings dominate, at 12 the optimizer step can (a single extrapolated peak missed by 7.6%).
    assert abs(extrapolated.trace.peak_bytes / full.peak_bytes - 1) < 0.005
    assert extrapolated.memory.peak_allocated == extrapolated.trace.peak_bytes + extrapolated.memory.workspaces
    assert abs(extrapolated.memory.activations / full.activations_bytes - 1) < 0.005
    assert abs(extrapolated.trace.flops / full.flops - 1) < 0.005
    # Reserved carries the 3-layer trace's fragmentation over in bytes (harness/project/memory.py):
    # against the full-depth replay, within 10.3% under every allocator setting for these cells.
    replayed = _reserved(full, _workspaces_for(full, h100, mode))
    assert all(abs(extrapolated.memory.reserved[s] / replayed[s] - 1) < 0.11 for s in replayed)


@pytest.mark.parametrize("workload_name, size, technique, seq_len, batch", [
    ("gpt", "gpt2-124m", "checkpointing", 256, 1), ("gpt", "gpt2-124m", "amp-bf16+checkpointing", 64, 1),
    ("bert", "bert-base", "amp-bf16", 512, 4), ("gpt", "gpt2-124m", "selective-checkpointing+amp-bf16", 1024, 4),
    ("gpt", "gpt2-124m", "param-sharing+amp-bf16", 512, 2)])  # its block list repeats one module
def test_every_phase_peak_extrapolates_to_a_full_trace(workload_name, size, technique, seq_len, batch):
    # A phase must peak at the same moment at every depth for its peak to extrapolate. Two that did not:
    # - Under checkpointing the forward keeps little, so the gradients left from the previous step (until
    #   zero_grad frees them) can outweigh it. Counted as the forward's, that moment was its peak at one traced
    #   depth and mid-forward at another (the first two cells' forward peaks came out 12.5% and 3.7% low;
    #   gpt-70b under fsdp+amp-bf16+checkpointing on 64 GPUs read 49 GiB per rank at 6,144 tokens, 181 at 7,168).
    # - Over the blocks' backward the live bytes move in a line from the first block's to the last block's,
    #   and which end is higher changed with the depth: one phase for all blocks came out 15% and 14% low for
    #   the last two cells.
    spec = dataclasses.replace(WORKLOADS[workload_name].sizes[size], seq_len=seq_len, batch_size=batch)
    cell = _cell(workload_name, size, technique, batch=batch, spec=spec)
    extrapolated = project(cell).trace
    full = traced(cell)
    assert "grads" not in {k for k, v in full.phase_at_peak["forward"].items() if v}
    assert set(extrapolated.phase_peaks) == set(full.phase_peaks) - {"backward_middle"}
    # Between the two ends of the blocks' backward nothing is higher than at one of them.
    assert full.phase_peaks["backward_middle"] <= max(full.phase_peaks["backward_blocks"],
                                                      full.phase_peaks["backward_last_block"])
    for phase, peak in extrapolated.phase_peaks.items():
        assert peak == pytest.approx(full.phase_peaks[phase], rel=0.005), phase
        assert all(v >= 0 for v in extrapolated.phase_at_peak[phase].values()), phase


def test_a_phase_whose_peak_moment_switches_between_the_traced_depths_is_traced_one_layer_deeper(monkeypatch):
    # At 2 layers the forward peaks mid-forward (activations), from 3 on at a moment holding gradients: the
    # line through 2 and 3 would take activations negative. Traced at 3 and 4, the moment is the same.
    from harness.project import depth as D
    from harness.project.trace import StepTrace

    def synthetic(cell, profile):
        layers = cell.workload.depth(cell.spec)
        forward = {"params": layers * GiB, "activations": 10 * GiB} if layers == 2 else \
            {"params": layers * GiB, "grads": layers * GiB}
        peak = sum(forward.values())
        return StepTrace(peak_bytes=peak, at_peak=forward, params_bytes=layers, grads_bytes=layers, optimizer_bytes=0,
                         activations_bytes=0, events=[], phase_peaks={"forward": peak},
                         phase_at_peak={"forward": forward})

    monkeypatch.setattr(D, "traced", synthetic)
    cell = _cell("gpt", "gpt2-124m")  # 12 layers
    trace, logged, depths = D.traced_to_depth(cell, PROFILES["h100-sxm"])
    assert depths == (3, 4) and logged.params_bytes == 4
    assert trace.phase_peaks["forward"] == 24 * GiB
    assert trace.phase_at_peak["forward"] == {"params": 12 * GiB, "grads": 12 * GiB}
    consistent = [synthetic(cell.with_spec(cell.workload.with_depth(cell.spec, n)), None) for n in (3, 4)]
    assert D.moment_switched(synthetic(cell.with_spec(cell.workload.with_depth(cell.spec, 2)), None), consistent[0])
    assert not D.moment_switched(*consistent)


def test_an_extrapolated_rows_technique_notes_count_the_whole_model():
    # A technique counts what it touched on the 2- and 3-layer models it was applied to; those counts are
    # affine in the depth like the trace's totals, so the row's note gives the whole model's: what the
    # technique itself writes when applied to all 12 layers.
    import torch

    from suites.techniques import Run

    projection = project(_cell("gpt", "gpt2-124m", "lora+amp-bf16", gpu="l4"))
    lora = next(note for note in projection.trace.notes if "parameters trainable" in note)
    workload = WORKLOADS["gpt"]
    with torch.device("meta"):
        run = Run(workload=workload, size=workload.sizes["gpt2-124m"], mode="train", profile=PROFILES["l4"],
                  model=workload.build(workload.sizes["gpt2-124m"]), batch_size=1)
    parse_stack("lora").apply(run)
    assert lora == next(note for note in run.notes if "parameters trainable" in note)
    # A note whose changing figure is not a count keeps the deeper trace's, and says so.
    from harness.project.depth import _notes_at_depth

    assert _notes_at_depth(["1.5 GiB held"], ["2.0 GiB held"], lambda x, y: 2 * y - x, 3) == \
        ["[3-layer trace] 2.0 GiB held"]


def test_cuda_profiles_round_allocations_to_512_bytes():
    on_gpu = traced(_cell("gpt", "smoke", batch=4, gpu="a100-sxm4-80gb"))
    on_cpu = traced(_cell("gpt", "smoke", batch=4, gpu="cpu"))
    assert all(size % 512 == 0 for kind, _, size in on_gpu.events if kind == "alloc")
    assert on_gpu.peak_bytes > on_cpu.peak_bytes


def test_autocasts_weight_copies_are_counted_as_the_part_of_the_activations_they_are():
    with torch.device("meta"):
        model = WORKLOADS["gpt"].build(WORKLOADS["gpt"].sizes["smoke"])
    # Every matmul weight once at 2 bytes, gpt2's output projection (the token embedding, tied) included, each
    # allocation rounded to 512 bytes.
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.wte.weight]
    expected = sum(-(-w.numel() * 2 // 512) * 512 for w in weights)
    small, large = (traced(_cell("gpt", "smoke", "amp-bf16", batch=b)) for b in (2, 8))
    assert small.weight_cast_bytes == large.weight_cast_bytes == expected
    assert large.activations_bytes > small.activations_bytes > small.weight_cast_bytes
    memory = project(_cell("gpt", "smoke", "amp-bf16", batch=2)).memory
    assert any(f"{expected / MiB:,.1f} MiB of autocast" in note for note in memory.notes)
    # fp32 makes no copies; checkpointed blocks keep none for the backward (they recompute them there).
    assert traced(_cell("gpt", "smoke", batch=2)).weight_cast_bytes == 0
    assert 0 < traced(_cell("gpt", "smoke", "amp-bf16+checkpointing", batch=2)).weight_cast_bytes < expected


def test_blas_workspaces_are_inside_the_allocators_figures():
    # CublasHandlePool.cpp: 32 MiB cuBLAS workspace on sm90 (and sm100/sm120 from torch 2.11), else
    # ":4096:2:16:8"; a separate 1 MiB cuBLASLt one in 2.8-2.10; hipBLAS 128 MiB on gfx94x + hipBLASLt
    # 76 MiB. One set per thread that runs matmuls: training adds autograd's device thread.
    small = 8 * MiB + 128 * 1024
    assert library_workspaces(PROFILES["h100-sxm"], "infer", "2.14.1") == (32 * MiB,)
    assert library_workspaces(PROFILES["h100-sxm"], "train", "2.14.1") == (32 * MiB, 32 * MiB)
    assert library_workspaces(PROFILES["b200"], "infer", "2.14.1") == (32 * MiB,)
    assert library_workspaces(PROFILES["b200"], "infer", "2.9.0+cu128") == (small, MiB)
    assert library_workspaces(PROFILES["a100-sxm4-80gb"], "infer", "2.14.1") == (small,)
    assert library_workspaces(PROFILES["a100-sxm4-80gb"], "infer", "2.6.0") == (small,)
    assert library_workspaces(PROFILES["mi300x"], "infer") == (128 * MiB, 76 * MiB)
    assert library_workspaces(PROFILES["cpu"], "train") == ()
    h100 = project(_cell("gpt", "smoke", batch=4, gpu="h100-sxm")).memory
    a100 = project(_cell("gpt", "smoke", batch=4, gpu="a100-sxm4-80gb")).memory
    # Same trace (both GPUs), different workspaces: the difference is exactly the workspaces'.
    assert h100.peak_allocated - a100.peak_allocated == h100.workspaces - a100.workspaces
    assert h100.workspaces == sum(library_workspaces(PROFILES["h100-sxm"], "train"))
    assert h100.reserved["native"] >= h100.peak_allocated
    assert h100.overhead == 512 * MiB  # the context alone, outside the allocator


def test_each_threads_workspaces_are_allocated_after_its_first_matmul():
    # A cuBLAS handle takes its workspace at its thread's first matmul, after that matmul's output:
    # the warm-up's forward (the fused q/k/v projection of the first block), then autograd's thread.
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["smoke"]
    trace = traced(_cell("gpt", "smoke", batch=4, gpu="a100-sxm4-80gb"))
    forward_at, backward_at = trace.first_matmul_at
    n_embd = spec.config["n_embd"]
    qkv_output = 4 * spec.seq_len * 3 * n_embd * 4  # batch x tokens x 3d, fp32
    assert trace.events[forward_at - 1][0::2] == ("alloc", qkv_output)
    parameters = len(list(workload.build(spec).parameters()))
    assert parameters < forward_at < backward_at
    events = _with_workspaces(trace, (10 * MiB, 20 * MiB))
    assert events[forward_at] == ("alloc", -1, 10 * MiB)
    assert events[backward_at + 1] == ("alloc", -2, 20 * MiB)
    assert [e for e in events if e[1] >= 0] == trace.events


def test_fit_is_judged_against_the_memory_the_driver_reports():
    # A T4's datasheet says 16 GB; with ECC on its driver reports 15,360 MiB, and that is what a process gets.
    assert PROFILES["t4"].capacity_bytes == 15360 * MiB < PROFILES["t4"].memory_bytes
    memory = project(_cell("gpt", "smoke", batch=4, gpu="t4")).memory
    assert memory.capacity == 15360 * MiB
    assert not any("datasheet memory size" in note for note in memory.notes)


def test_a_multi_device_package_is_projected_on_one_of_its_devices():
    # An MI250X is two GCDs, each a GPU to PyTorch: one process gets one GCD's memory, bandwidth and peak.
    package = PROFILES["mi250x"]
    device = package.per_device()
    assert package.devices_per_package == 2 and device.devices_per_package == 1
    assert device.memory_bandwidth_bytes_s == package.memory_bandwidth_bytes_s / 2
    assert device.peak("fp16") == package.peak("fp16") / 2
    assert dataclasses.replace(package, usd_per_hour=3.0).per_device().usd_per_hour == 1.5  # half the rent
    projection = project(_cell("gpt", "smoke", "amp-fp16", batch=4, gpu="mi250x"))
    assert projection.memory.capacity == 65520 * MiB  # one GCD, not the package's 128 GiB
    whole_package = estimate(projection.trace, package)
    assert projection.time.step_s == pytest.approx(estimate(projection.trace, device).step_s)
    # Half the bandwidth: memory-bound kernels take longer (compute-bound ones of this tiny model are
    # saturation-bound, and half the units fill as soon as half the peak is reached).
    assert projection.time.memory_s > 1.5 * whole_package.memory_s
    assert projection.time.step_s > whole_package.step_s


def test_gpt3_175b_training_does_not_fit_one_gpu_and_says_by_how_much():
    cell = Cell("gpt", "gpt3-175b", "train", "amp-bf16", "h100-sxm", 1, source="projected")
    record = project_cell(cell)
    assert record.status == "oom" and record.fits is False
    assert "MiB allocated at its peak" in record.reason and "MiB on h100-sxm" in record.reason
    # Parameters in fp32 (4 B) plus AdamW's two moments (8 B) for ~175e9 parameters (C3's order).
    assert 0.68e12 < record.params_bytes < 0.72e12
    assert 1.36e12 < record.optimizer_bytes < 1.44e12
    assert 174e9 < record.param_count < 176e9
    # Its peak is in the foreach AdamW step (activations gone): the state plus the step's temporary,
    # one fp32 copy of every parameter, are the whole peak.
    parts = record.params_bytes + record.grads_bytes + record.optimizer_bytes + record.temporaries_bytes
    assert parts + record.library_workspace_bytes == pytest.approx(record.peak_allocated_bytes, rel=0.01)
    # A cell that cannot run has memory figures but no speed or cost, like a measured oom row; the
    # work one step would be is still known.
    assert record.source == "projected" and record.step_time_ms_p50 is None and record.mfu is None
    assert record.flops_per_step == pytest.approx(6 * 175e9 * 2048, rel=0.05)
    assert record.usd_per_million_tokens is None


def test_an_oom_reason_states_its_figures_without_rounding_them_into_a_contradiction():
    # On the rounding edge: 22,528.4 MiB allocated + 512 MiB context > 23,040.3 MiB, which rounded to the
    # nearest MiB would read 22,528 + 512 > 23,040 (false); needed figures round up, capacity down.
    def reason(allocated, reserved, allocator="native"):
        memory = MemoryProjection(peak_allocated=allocated, reserved={allocator: reserved}, params=0, grads=0,
                                  optimizer=0, activations=0, temporaries=0, workspaces=0, overhead=512 * MiB,
                                  capacity=23_040 * MiB + 3 * MiB // 10, allocator=allocator)
        text = oom_reason(memory, "l4")
        needed, context, capacity = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) MiB", text)][:3]
        assert needed + context > capacity, text
        return text

    edge = 22_528 * MiB + 4 * MiB // 10
    assert "allocated at its peak" in reason(edge, 23_552 * MiB)
    native = reason(21_504 * MiB, edge)  # live bytes fit, its segments do not
    assert "freeing the cached blocks" in native and "21,504 MiB allocated" in native
    assert "reserved under expandable_segments" in reason(21_504 * MiB, edge, "expandable_segments")
    # And a real cell past the largest batch on an L4 says the same, in figures that add up.
    record = project_cell(Cell("resnet50", "resnet50", "train", "baseline", "l4", 400, source="projected"))
    figures = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) MiB", record.reason)]
    assert record.status == "oom" and figures[0] + figures[1] > figures[2], record.reason


def test_a_step_fits_when_freeing_the_allocators_cache_makes_room():
    # gpt2-124m amp-bf16 at batch 135 on an H200: unconstrained, the caching allocator would reserve
    # ~149 GiB, more than the device; its live peak is ~110 GiB. When cudaMalloc fails the allocator
    # frees its unused cached segments and retries, and replayed against the device's size that suffices.
    memory = project(_cell("gpt", "gpt2-124m", "amp-bf16", batch=135, gpu="h200")).memory
    room = memory.capacity - memory.overhead
    assert memory.peak_allocated < room < memory.reserved["native"]
    assert memory.fits and memory.fits_by_freeing_cache
    assert any("frees its cached blocks" in note for note in memory.notes)


def test_bf16_is_unsupported_on_a_t4_projection():
    cell = Cell("gpt", "gpt2-124m", "train", "amp-bf16", "t4", 8, source="projected")
    record = project_cell(cell)
    assert record.status == "unsupported" and "bf16" in record.reason


def test_max_batch_fits_and_one_more_step_does_not():
    cell = _cell("bert", "bert-base", gpu="t4")
    best = max_batch(cell)
    assert best >= 1
    from harness.project.search import runs_steadily

    assert runs_steadily(project(cell.with_batch(best)).memory)
    assert not runs_steadily(project(cell.with_batch(best + 1)).memory)


def test_max_batch_leaves_out_batches_that_fit_only_by_the_allocator_freeing_its_cache():
    from harness.project.search import runs_steadily

    cell = _cell("gpt", "gpt2-124m", technique="amp-fp16", gpu="t4")
    best = max_batch(cell)
    assert runs_steadily(project(cell.with_batch(best)).memory)
    above = project(cell.with_batch(best + 1)).memory
    # One more sample still fits, but only as the allocator frees its cached blocks and retries every step
    # (its unconstrained reserve outgrows the card): not a batch to run for throughput.
    assert above.fits and above.fits_by_freeing_cache and not runs_steadily(above)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_projected_utilisation_is_physical(mode):
    """MFU can never exceed 1: the roofline's compute time is at least FLOPs / peak of the dtype used.
    Catches FLOPs the trace fails to see (composite ops under inference_mode, int8 GEMMs, sparse
    products), model FLOPs that ignore a smaller architecture, and peak mix-ups."""
    a100, h100 = PROFILES["a100-sxm4-80gb"], PROFILES["h100-sxm"]
    for workload_name, size in (("gpt", "gpt2-124m"), ("bert", "bert-base"), ("resnet50", "resnet50")):
        for stack in ("baseline", "amp-bf16"):
            spec = WORKLOADS[workload_name].sizes[size]
            cell = Cell(workload_name, size, mode, stack, a100.id, spec.batch_size, source="projected")
            record = project_cell(cell)
            assert record.status == "ok", record.reason
            if record.gen_len:
                # A generation's decode steps are bound by bandwidth, not compute: their share of the
                # bandwidth is what cannot exceed 1 there, and MFU stays low.
                assert 0.05 < record.decode_bandwidth_util <= 1 and 0 < record.mfu <= 1, record
                continue
            assert 0.05 < record.mfu <= 1, f"{workload_name} {stack} {mode}: MFU {record.mfu}"
    spec = WORKLOADS["gpt"].sizes["gpt2-124m"]
    for technique in ["baseline", *TECHNIQUES]:
        cell = Cell("gpt", "gpt2-124m", mode, technique, h100.id, spec.batch_size, source="projected")
        record = project_cell(cell)
        assert record.mfu is None or 0 < record.mfu <= 1, f"gpt {technique} {mode}: MFU {record.mfu}"


@pytest.mark.parametrize("workload, size, technique", [("gpt", "smoke", "amp-bf16"), ("resnet50", "smoke", "baseline"),
                                                       ("bert", "smoke", "checkpointing")])
def test_the_batch_model_gives_the_memory_a_trace_at_that_batch_gives(workload, size, technique):
    from harness.project.batch_model import BatchModel

    cell = _cell(workload, size, technique, batch=4, gpu="a100-sxm4-80gb")
    model = BatchModel(cell, 4, 20)
    for batch in (4, 11, 20, 24):  # the ends, between them, and a little beyond
        modelled, real = model.memory(batch), project(cell.with_batch(batch)).memory
        assert modelled.peak_allocated == pytest.approx(real.peak_allocated, rel=1e-3, abs=64 * 1024)
        assert modelled.reserved["native"] == pytest.approx(real.reserved["native"], rel=0.01, abs=2 * MiB)
        assert modelled.fits == real.fits


def test_the_largest_batch_says_what_it_leaves_and_whether_the_error_bar_stays_on_the_card():
    from types import SimpleNamespace

    from harness.project.query import _margin_note

    gib = 2**30
    inside = SimpleNamespace(batch_size=14, peak_reserved_bytes=75 * gib, peak_reserved_high_bytes=79 * gib,
                             device_overhead_bytes=gib // 2)
    # What advise says it leaves: the card less the CUDA context less the reserved peak.
    assert _margin_note(inside, 80 * gib) == \
        "--max-batch: batch 14 leaves 4.5 GiB of the card's 80 GiB after the CUDA context"
    over = SimpleNamespace(batch_size=14, peak_reserved_bytes=75 * gib, peak_reserved_high_bytes=86 * gib,
                           device_overhead_bytes=gib // 2)
    assert "upper end (86.0 GiB reserved) it is short by 6.5 GiB" in _margin_note(over, 80 * gib)
