"""A model of PyTorch's CUDA caching allocator: how much memory a sequence of allocations reserves.

No library replays an allocation trace through the caching allocator's rules without a GPU, so
this is written by hand from the documented rules (PyTorch CUDA semantics notes and the 2026 devlog
on fragmentation, summarised in reference/calibration.md):
- requests <= 1 MiB come from a small pool carved from 2 MiB segments; 1-10 MiB requests get a
  20 MiB segment; >= 10 MiB requests get a segment of their size rounded up to 2 MiB;
- a free cached block is reused best-fit within its pool and split only when the remainder is large
  enough (> 1 MiB in the large pool, >= 512 B in the small pool); free neighbours in one segment
  merge, blocks in different segments never do (that is fragmentation: reserved - allocated);
- when a new segment does not fit the device, cached free segments are released and it is retried
  (what `cudaMalloc` failure handling does), and only then is it an OOM;
- `expandable_segments:True` maps pages into one growing range per pool, so freed ranges are reused
  regardless of allocation order: modelled as pool-level packing with 2 MiB (small) / 20 MiB
  (large) granularity; `backend:cudaMallocAsync` pools at 2 MiB granularity.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

MiB = 2**20
SMALL_SIZE = 1 * MiB          # requests up to this come from the small pool
SMALL_SEGMENT = 2 * MiB
MIN_LARGE_ALLOC = 10 * MiB    # requests below this (and above SMALL_SIZE) get a 20 MiB segment
LARGE_SEGMENT = 20 * MiB
ROUND_LARGE = 2 * MiB
MIN_SPLIT_LARGE = 1 * MiB     # a large block is split only if more than this would remain
MIN_SPLIT_SMALL = 512

SETTINGS = ("native", "expandable_segments", "cudaMallocAsync")


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class _Segment:
    size: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)


@dataclass
class AllocatorResult:
    """Peak reserved bytes, peak allocated bytes, and whether (and at which request) it ran out."""

    peak_reserved: int
    peak_allocated: int
    oom: bool = False
    oom_request: int | None = None


def segment_size(request: int) -> int:
    """The size of the segment cudaMalloc'd for a request no cached block can serve."""
    if request <= SMALL_SIZE:
        return SMALL_SEGMENT
    if request < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return math.ceil(request / ROUND_LARGE) * ROUND_LARGE


class NativeAllocator:
    """Segments, best-fit reuse, splitting and in-segment merging, as described above."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.segments: dict[int, _Segment] = {}
        self.free_blocks: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # (size, seg, offset)
        self.blocks: dict[int, _Block] = {}  # allocation id -> block
        self.reserved = 0
        self.allocated = 0
        self._next_segment = 0

    def malloc(self, key: int, size: int) -> bool:
        small = size <= SMALL_SIZE
        pool = self.free_blocks[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index == len(pool):
            if not self._new_segment(segment_size(size), small):
                return False
            index = bisect.bisect_left(pool, (size, -1, -1))
        _, seg_id, offset = pool.pop(index)
        segment = self.segments[seg_id]
        block = next(b for b in segment.blocks if b.offset == offset)
        remainder = block.size - size
        if remainder > (MIN_SPLIT_SMALL - 1 if small else MIN_SPLIT_LARGE):
            rest = _Block(seg_id, offset + size, remainder)
            segment.blocks.insert(segment.blocks.index(block) + 1, rest)
            bisect.insort(pool, (rest.size, seg_id, rest.offset))
            block.size = size
        block.free = False
        self.blocks[key] = block
        self.allocated += block.size
        return True

    def free(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        segment = self.segments[block.segment]
        pool = self.free_blocks[segment.small]
        block.free = True
        index = segment.blocks.index(block)
        # Merge with free neighbours in the same segment.
        for neighbour_index in (index + 1, index - 1):
            if 0 <= neighbour_index < len(segment.blocks) and segment.blocks[neighbour_index].free:
                neighbour = segment.blocks[neighbour_index]
                pool.remove((neighbour.size, neighbour.segment, neighbour.offset))
                first, second = sorted((block, neighbour), key=lambda b: b.offset)
                first.size += second.size
                segment.blocks.remove(second)
                block = first
                index = segment.blocks.index(block)
        bisect.insort(pool, (block.size, block.segment, block.offset))

    def _new_segment(self, size: int, small: bool) -> bool:
        if self.capacity is not None and self.reserved + size > self.capacity:
            self._release_free_segments()
            if self.reserved + size > self.capacity:
                return False
        seg_id = self._next_segment
        self._next_segment += 1
        self.segments[seg_id] = _Segment(size, small, [_Block(seg_id, 0, size)])
        bisect.insort(self.free_blocks[small], (size, seg_id, 0))
        self.reserved += size
        return True

    def _release_free_segments(self) -> None:
        """What the allocator does before reporting OOM: give back segments with nothing allocated."""
        for seg_id, segment in list(self.segments.items()):
            if len(segment.blocks) == 1 and segment.blocks[0].free:
                self.free_blocks[segment.small].remove((segment.size, seg_id, 0))
                self.reserved -= segment.size
                del self.segments[seg_id]


def replay(events: list[tuple[str, int, int]], setting: str = "native", capacity: int | None = None,
           baseline: list[tuple[str, int, int]] | None = None) -> AllocatorResult:
    """Run an allocation log through the model of `setting`; `capacity` bytes makes OOM possible."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown allocator setting {setting!r} (valid: {', '.join(SETTINGS)})")
    if setting != "native":
        return _pooled(events, setting, capacity)
    allocator = NativeAllocator(capacity)
    peak_reserved = peak_allocated = 0
    for index, (kind, key, size) in enumerate(events):
        if kind == "alloc":
            if not allocator.malloc(key, size):
                return AllocatorResult(max(peak_reserved, allocator.reserved), peak_allocated, True, index)
            peak_allocated = max(peak_allocated, allocator.allocated)
            peak_reserved = max(peak_reserved, allocator.reserved)
        else:
            allocator.free(key)
    return AllocatorResult(peak_reserved, peak_allocated)


def _pooled(events, setting: str, capacity: int | None) -> AllocatorResult:
    """Expandable segments and cudaMallocAsync: freed space is reused whatever the order, so reserved
    tracks the live bytes of each pool rounded up to the mapping granularity."""
    live = {True: 0, False: 0}
    sizes: dict[int, tuple[int, bool]] = {}
    peak_reserved = peak_allocated = 0
    for index, (kind, key, size) in enumerate(events):
        if kind == "alloc":
            small = size <= SMALL_SIZE
            sizes[key] = (size, small)
            live[small] += size
        else:
            size, small = sizes.pop(key, (0, True))
            live[small] -= size
            continue
        if setting == "expandable_segments":
            reserved = _round_up(live[True], SMALL_SEGMENT) + _round_up(live[False], LARGE_SEGMENT)
        else:
            reserved = _round_up(live[True] + live[False], ROUND_LARGE)
        peak_allocated = max(peak_allocated, live[True] + live[False])
        peak_reserved = max(peak_reserved, reserved)
        if capacity is not None and reserved > capacity:
            return AllocatorResult(peak_reserved, peak_allocated, True, index)
    return AllocatorResult(peak_reserved, peak_allocated)


def _round_up(value: int, unit: int) -> int:
    return math.ceil(value / unit) * unit
