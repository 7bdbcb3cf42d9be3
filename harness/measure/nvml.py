"""What the driver sees while a cell's timed steps run, sampled through NVML (nvidia-ml-py) in a thread:
this process's GPU memory (what `nvidia-smi` lists, the CUDA context included), the device's used
memory, power, energy, SM clock and temperature.

Energy comes from the GPU's total-energy counter where it has one (Volta and newer: the difference
across the window), else from the power readings integrated over time (trapezoids). The torch device
is matched to its NVML handle by UUID, so `CUDA_VISIBLE_DEVICES` renumbering cannot pick another GPU.
The source is an object with six readings, so tests drive the sampler with a stand-in.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

# Sampling period: NVML refreshes power about every 20-100 ms (driver dependent), so faster adds nothing.
SAMPLE_INTERVAL_S = 0.02


class NvmlSource(Protocol):
    """One GPU's readings; each None where the GPU or driver cannot say."""

    def process_bytes(self) -> int | None: ...
    def used_bytes(self) -> int | None: ...
    def power_w(self) -> float | None: ...
    def energy_j(self) -> float | None: ...
    def sm_clock_mhz(self) -> float | None: ...
    def temperature_c(self) -> float | None: ...


def _or_none(read):
    """A reading, or None where NVML refuses it (not supported on this GPU, no permission)."""
    try:
        return read()
    except Exception:  # pynvml.NVMLError and its many subclasses
        return None


class PynvmlSource:
    """Readings of the NVML device behind one torch CUDA device."""

    def __init__(self, pynvml, handle, pid: int):
        self.nvml, self.handle, self.pid = pynvml, handle, pid

    def process_bytes(self) -> int | None:
        def read():
            for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if process.pid == self.pid:
                    return process.usedGpuMemory  # None where the driver hides it (some containers)
            return None

        return _or_none(read)

    def used_bytes(self) -> int | None:
        return _or_none(lambda: int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used))

    def power_w(self) -> float | None:
        return _or_none(lambda: self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)  # milliwatts

    def energy_j(self) -> float | None:
        return _or_none(lambda: self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3)  # millijoules

    def sm_clock_mhz(self) -> float | None:
        return _or_none(lambda: float(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)))

    def temperature_c(self) -> float | None:
        return _or_none(lambda: float(self.nvml.nvmlDeviceGetTemperature(self.handle, self.nvml.NVML_TEMPERATURE_GPU)))


def open_source(device: torch.device) -> tuple[PynvmlSource | None, str]:
    """The NVML source of `device`, or None and why there is none (no CUDA device, ROCm, no NVML)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, "no CUDA device: NVML reads NVIDIA GPUs"
    if torch.version.hip:
        return None, "ROCm: NVML does not see AMD GPUs (amd-smi would)"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _handle_by_uuid(pynvml, str(torch.cuda.get_device_properties(device).uuid))
    except Exception as exc:  # library missing, driver mismatch, UUID not found
        return None, f"NVML unavailable ({type(exc).__name__}: {str(exc)[:120]})"
    return PynvmlSource(pynvml, handle, os.getpid()), ""


def _handle_by_uuid(pynvml, uuid: str):
    """NVML's handle of the device torch calls `uuid`: NVML names a whole GPU `GPU-<uuid>` and a MIG
    instance `MIG-<uuid>`, torch gives the bare UUID."""
    if uuid.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:  # pynvml.NVMLError_NotFound: a MIG instance
        return pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")


@dataclass(frozen=True)
class NvmlFigures:
    """What the sampler saw over its window (None: not readable)."""

    process_peak_bytes: int | None
    device_used_peak_bytes: int | None
    power_w_mean: float | None
    energy_j: float | None
    energy_basis: str | None  # "energy counter" or "integrated power"
    sm_clock_mhz_mean: float | None
    temperature_c_max: float | None
    samples: int
    seconds: float


class NvmlSampler:
    """Samples `source` every `interval_s` in a thread while entered (and once at each end)."""

    def __init__(self, source: NvmlSource, interval_s: float = SAMPLE_INTERVAL_S, clock=time.perf_counter):
        self.source, self.interval_s, self.clock = source, interval_s, clock
        self.samples: list[tuple[float, tuple]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="headroom-nvml", daemon=True)

    def _sample(self) -> None:
        s = self.source
        self.samples.append((self.clock(), (s.process_bytes(), s.used_bytes(), s.power_w(), s.energy_j(),
                                            s.sm_clock_mhz(), s.temperature_c())))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> NvmlSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def figures(self) -> NvmlFigures:
        times = [t for t, _ in self.samples]
        columns = list(zip(*(values for _, values in self.samples), strict=True))

        def present(index: int) -> list:
            return [v for v in columns[index] if v is not None]

        process, used, power, energy, clock, temperature = (present(i) for i in range(6))
        joules, basis = None, None
        counter = columns[3]
        if counter[0] is not None and counter[-1] is not None:
            joules, basis = counter[-1] - counter[0], "energy counter"
        elif all(v is not None for v in columns[2]) and len(times) > 1:
            watts = columns[2]
            joules = sum((b - a) * (p + q) / 2 for a, b, p, q in zip(times, times[1:], watts, watts[1:], strict=False))
            basis = "integrated power"
        return NvmlFigures(
            process_peak_bytes=max(process) if process else None, device_used_peak_bytes=max(used) if used else None,
            power_w_mean=sum(power) / len(power) if power else None, energy_j=joules, energy_basis=basis,
            sm_clock_mhz_mean=sum(clock) / len(clock) if clock else None,
            temperature_c_max=max(temperature) if temperature else None, samples=len(times),
            seconds=times[-1] - times[0] if times else 0.0)
