"""The CUDA memory probe's bookkeeping and the allocator-setting reading, on a stand-in for
torch.cuda (the real counters are read by the GPU check); the CPU probe is exercised by every
measured cell in the other tests."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.measure import memory
from harness.measure.memory import CudaAllocatorProbe, allocator_setting


class _FakeCuda:
    """torch.cuda's counters as the caching allocator keeps them: current, peak since reset, reserved."""

    def __init__(self, backend: str = "native", expandable: bool = False) -> None:
        self.backend, self.expandable = backend, expandable
        self.allocated = self.peak = self.reserved = self.reserved_peak = 0

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, size: int) -> None:
        self.allocated -= size

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {
            "allocated_bytes.all.peak": self.peak, "reserved_bytes.all.peak": self.reserved_peak,
            "num_alloc_retries": 0})
        monkeypatch.setattr(cuda, "get_allocator_backend", lambda: self.backend)
        monkeypatch.setattr(cuda, "memory_snapshot", lambda: [{"is_expandable": self.expandable, "total_size": 1}])

    def _reset(self, device=None) -> None:
        self.peak, self.reserved_peak = self.allocated, self.reserved


@pytest.mark.parametrize("backend, expandable, setting", [
    ("native", False, "native"), ("native", True, "expandable_segments"),
    ("cudaMallocAsync", False, "cudaMallocAsync")])
def test_allocator_setting_is_read_from_the_allocator(monkeypatch, backend, expandable, setting):
    _FakeCuda(backend, expandable).install(monkeypatch)
    assert allocator_setting() == setting


def test_cuda_probe_takes_the_steps_peak_across_its_forward_window(monkeypatch):
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    probe = CudaAllocatorProbe(torch.device("cuda"))
    cuda.alloc(900)   # warm-up: reserves 900, keeps 300 (parameters, optimizer state)
    cuda.free(600)
    probe.begin_measured_step()
    probe.mark("forward_start")  # resets the peak counters; the forward's own peak is read at its end
    cuda.alloc(400)
    probe.mark("forward_end")
    cuda.alloc(500)   # backward: the step's peak, 1200
    cuda.free(800)
    probe.end_measured_step()
    reading = probe.reading()
    assert reading.live_at == {"forward_start": [300], "forward_end": [700]}
    assert reading.peak_in["forward"] == 700 and reading.peak_allocated == 1200
    assert reading.peak_reserved == 1200  # reserved only grows: the step took it past the warm-up's 900
    assert reading.allocator == "native" and reading.alloc_retries == 0


def test_probe_for_picks_the_device_probe():
    assert isinstance(memory.probe_for(torch.device("cpu")), memory.CpuAllocationProbe)
    assert isinstance(memory.probe_for(torch.device("cuda")), CudaAllocatorProbe)


def test_a_free_the_profiler_missed_is_put_back_when_its_address_is_reused():
    # (time, bytes, address): block A at 0x10 freed unseen (on another thread), then 0x10 handed out again.
    events = [(1, 100, 0x10), (2, 50, 0x20), (3, -50, 0x20), (4, 100, 0x10), (5, -100, 0x10)]
    deltas = memory.with_missed_frees(events)
    assert deltas == [(1, 100), (2, 50), (3, -50), (4, -100), (4, 100), (5, -100)]
    assert sum(size for _, size in deltas) == 0  # nothing left live


def test_the_cpu_probe_does_not_keep_blocks_freed_on_another_thread():
    # Each block's last reference dies on a thread the profiler does not follow (as gloo's worker frees a
    # collective's buffers), so the profiler's own sum reaches twenty blocks. The C library hands the freed
    # memory out again at a few addresses (how few varies with what else runs: 2 to 9 of 20 measured here);
    # the repaired peak can hold at most one block per address, whatever that number is.
    holder = {}
    block = 64 << 10
    addresses = set()
    with memory.CpuAllocationProbe() as probe:
        probe.begin_measured_step()
        for _ in range(20):
            holder["tensor"] = torch.empty(block // 4)
            addresses.add(holder["tensor"].data_ptr())
            thread = threading.Thread(target=holder.clear)
            thread.start()
            thread.join()
        probe.end_measured_step()
    assert len(addresses) < 20, "no address was handed out twice, so there was no missed free to repair"
    assert block <= probe.reading().peak_allocated <= len(addresses) * block
