"""NVML sampling (harness/measure/nvml.py) with a stand-in source, the columns it fills, and on a real GPU
the device matched by UUID."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.cell import Cell
from harness.measure.nvml import NvmlSampler, open_source
from harness.outcome import Outcome, to_record
from harness.profiles import load_profiles


class StandIn:
    """Scripted readings: memory grows then shrinks, power steps, the energy counter climbs 100 J a read."""

    def __init__(self, energy_counter: bool = True):
        self.reads = itertools.count()
        self.energy_counter = energy_counter
        self.last = 0

    def process_bytes(self):
        self.last = next(self.reads)
        return [1_000, 5_000, 3_000][min(self.last, 2)]

    def used_bytes(self):
        return 10_000 + self.last

    def power_w(self):
        return 200.0 if self.last == 0 else 300.0

    def energy_j(self):
        return 1_000.0 + 100.0 * self.last if self.energy_counter else None

    def sm_clock_mhz(self):
        return 1_500.0

    def temperature_c(self):
        return 50.0 + self.last


class SteppingClock:
    """One second per reading, so integrals are exact."""

    def __init__(self):
        self.now = -1.0

    def __call__(self):
        self.now += 1.0
        return self.now


def _sampled(source) -> NvmlSampler:
    sampler = NvmlSampler(source, interval_s=3600, clock=SteppingClock())  # only the two end samples
    with sampler:
        sampler._sample()  # one in the middle, as the thread would take
    return sampler


def test_the_sampler_takes_peaks_means_and_energy_from_the_counter():
    figures = _sampled(StandIn()).figures()
    assert figures.samples == 3 and figures.seconds == 2.0
    assert figures.process_peak_bytes == 5_000 and figures.device_used_peak_bytes == 10_002
    assert figures.power_w_mean == pytest.approx((200 + 300 + 300) / 3)
    assert figures.energy_j == 200.0 and figures.energy_basis == "energy counter"
    assert figures.sm_clock_mhz_mean == 1_500.0 and figures.temperature_c_max == 52.0


def test_without_an_energy_counter_power_is_integrated():
    figures = _sampled(StandIn(energy_counter=False)).figures()
    # Trapezoids over 1 s each: (200 + 300) / 2 + (300 + 300) / 2.
    assert figures.energy_j == pytest.approx(550.0) and figures.energy_basis == "integrated power"


def test_rows_carry_the_readings_and_energy_per_sample():
    cell = Cell("gpt", "smoke", "train", "baseline", "h100-sxm", 4).resolve(load_profiles())
    outcome = Outcome(status="ok", nvml=_sampled(StandIn()).figures(), samples_timed=40)
    row = to_record(cell, outcome, "t")
    assert row.nvml_process_bytes == 5_000 and row.power_w_mean == pytest.approx(800 / 3)
    assert row.energy_j_per_sample == 5.0 and row.temperature_c_max == 52.0
    assert row.energy_usd_per_million_samples is None  # no electricity price given
    priced = to_record(cell, Outcome(status="ok", nvml=outcome.nvml, samples_timed=40, usd_per_kwh=0.18), "t")
    assert priced.energy_usd_per_million_samples == pytest.approx(5.0 * 1e6 / 3.6e6 * 0.18)  # 0.25 USD
    assert "energy from the GPU's energy counter over 2.00 s (3 NVML samples)" in row.notes


def test_without_a_cuda_device_there_is_no_source_and_the_reason_says_why():
    source, why = open_source(torch.device("cpu"))
    assert source is None and "no CUDA device" in why


@pytest.mark.gpu
def test_the_cuda_device_is_matched_to_its_nvml_handle_by_uuid():
    source, why = open_source(torch.device("cuda"))
    assert source is not None, why
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB: this process shows in NVML
    torch.cuda.synchronize()
    assert source.process_bytes() is None or source.process_bytes() >= x.numel()
    assert source.used_bytes() >= x.numel() and (source.power_w() or 0) > 0
