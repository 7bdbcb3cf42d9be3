"""A model of PyTorch's CUDA caching allocator: how much memory a sequence of allocations reserves.

No library replays an allocation trace through the caching allocator's rules without a GPU, so
this is written by hand from its source (c10/cuda/CUDACachingAllocator.cpp, read at a commit older
than 2.6 and at one of 2.11 or later: same rules for the default configuration) and the notes in
reference/calibration.md:
- native: requests <= 1 MiB come from a small pool carved from 2 MiB segments; 1-10 MiB requests
  get a 20 MiB segment; >= 10 MiB requests a segment of their size rounded up to 2 MiB. A free
  cached block is reused best-fit within its pool and split only when the remainder is large
  enough (> 1 MiB in the large pool, >= 512 B in the small pool); free neighbours in one segment
  merge, blocks in different segments never do (that is fragmentation: reserved - allocated).
  When a new segment does not fit the device, cached free segments are released and it is
  retried (`release_cached_blocks`), and only then is it an OOM.
- `expandable_segments:True`: one virtual range per pool that grows by mapping pages (2 MiB for the
  small pool, 20 MiB for the large), only by the shortfall when no free block fits; any remainder
  of >= 512 B is split off; freed blocks stay mapped until `empty_cache` or an OOM retry, so
  reserved is a high-water mark of mapped pages and holes still fragment it.
- `backend:cudaMallocAsync`: CUDA's stream-ordered pool, which PyTorch never trims (release
  threshold UINT64_MAX). How the driver grows the pool is not documented, so the model reports
  its floor: the peak of live bytes.
Zero-byte requests never reach the allocator (`allocate(0)` returns a null pointer).
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


class _Range:
    """A stretch of one expandable segment's address range: unmapped, free (mapped) or allocated."""

    __slots__ = ("offset", "size", "state", "prev", "next")

    def __init__(self, offset: int, size: int, state: str) -> None:
        self.offset, self.size, self.state = offset, size, state
        self.prev: _Range | None = None
        self.next: _Range | None = None


def _link(first: _Range | None, second: _Range | None) -> None:
    if first is not None:
        first.next = second
    if second is not None:
        second.prev = first


class _ExpandablePool:
    """One pool's expandable segment: an address range mapped page by page, in address order.

    Its virtual range is 1.125x the device's memory, more than can ever be mapped, so a pool
    needs one segment; here it is unbounded."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.free: list[tuple[int, int]] = []  # (size, offset) of free mapped ranges: best fit, then address
        self.at: dict[int, _Range] = {}        # offset -> free mapped range
        self.head = _Range(0, 1 << 62, "unmapped")

    def add_free(self, block: _Range) -> None:
        bisect.insort(self.free, (block.size, block.offset))
        self.at[block.offset] = block

    def remove_free(self, block: _Range) -> None:
        self.free.pop(bisect.bisect_left(self.free, (block.size, block.offset)))
        del self.at[block.offset]

    def merge(self, block: _Range) -> _Range:
        """Merge `block` (not in the free list) with neighbours in the same state (free with free,
        unmapped with unmapped; allocated ranges never merge): try_merge_blocks."""
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.state != block.state or block.state == "alloc":
                continue
            if neighbour.state == "free" and self.at.get(neighbour.offset) is neighbour:
                self.remove_free(neighbour)  # (a range being grown is already out of the list)
            first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
            first.size += second.size
            _link(first, second.next)
            if second is self.head:
                self.head = first
            block = first
        return block


class ExpandableSegmentsAllocator:
    """`expandable_segments:True` (CUDACachingAllocator.cpp: get_free_block, should_split,
    try_allocate_expandable_block, find_expandable_block, map_block, release_blocks)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.pools = {True: _ExpandablePool(SMALL_SEGMENT), False: _ExpandablePool(LARGE_SEGMENT)}
        self.blocks: dict[int, tuple[_ExpandablePool, _Range]] = {}
        self.reserved = 0
        self.allocated = 0

    def malloc(self, key: int, size: int) -> bool:
        pool = self.pools[size <= SMALL_SIZE]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
            if block is None:
                self._release_free_pages()
                block = self._grow(pool, size)
                if block is None:
                    return False
        if block.size - size >= MIN_SPLIT_SMALL:  # the expandable rule, in both pools
            rest = _Range(block.offset + size, block.size - size, "free")
            _link(rest, block.next)
            _link(block, rest)
            block.size = size
            pool.add_free(rest)
        block.state = "alloc"
        self.blocks[key] = (pool, block)
        self.allocated += block.size
        return True

    def free(self, key: int) -> None:
        pool, block = self.blocks.pop(key, (None, None))
        if block is None:
            return
        self.allocated -= block.size
        block.state = "free"
        pool.add_free(pool.merge(block))

    def _best_fit(self, pool: _ExpandablePool, size: int) -> _Range | None:
        """The smallest free range that fits, except that the one ending at the unmapped tail (which
        could grow into it) is passed over for the next larger one, as get_free_block does."""
        index = bisect.bisect_left(pool.free, (size, -1))
        if index == len(pool.free):
            return None

        def growable(i: int) -> int:
            block = pool.at[pool.free[i][1]]
            return block.size + (block.next.size if block.next is not None and block.next.state == "unmapped" else 0)

        while index + 1 < len(pool.free) and growable(index + 1) < growable(index):
            index += 1
        block = pool.at[pool.free[index][1]]
        pool.remove_free(block)
        return block

    def _grow(self, pool: _ExpandablePool, size: int) -> _Range | None:
        """Map pages for `size` bytes: at the first unmapped range whose run of unallocated ranges
        (from the free range just before it, if any) is long enough; only the shortfall is mapped."""
        start = self._expandable_start(pool, size)
        if start.state == "free":
            pool.remove_free(start)
        else:
            start = self._map(pool, start, min(start.size, size))
            if start is None:
                return None
        while start.size < size:
            grown = self._map(pool, start.next, min(size - start.size, start.next.size))
            if grown is None:
                pool.add_free(start)
                return None
            start = grown
        return start

    @staticmethod
    def _expandable_start(pool: _ExpandablePool, size: int) -> _Range:
        block = pool.head
        while block is not None:
            if block.state == "unmapped":
                start = block.prev if block.prev is not None and block.prev.state == "free" else block
                run, total = start, 0
                while run is not None and run.state != "alloc" and total < size:
                    total, run = total + run.size, run.next
                if total >= size:
                    return start
            block = block.next
        raise AssertionError("the unbounded unmapped tail always fits")

    def _map(self, pool: _ExpandablePool, block: _Range, size: int) -> _Range | None:
        """Map whole pages at the start of unmapped `block`; merged with a free range before it
        (taken out of the free list: the caller is about to use it)."""
        mapped = math.ceil(size / pool.page) * pool.page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return None
        if mapped < block.size:
            rest = _Range(block.offset + mapped, block.size - mapped, "unmapped")
            _link(rest, block.next)
            _link(block, rest)
            block.size = mapped
        block.state = "free"
        self.reserved += mapped
        return pool.merge(block)

    def _release_free_pages(self) -> None:
        """What an OOM retry does (release_cached_blocks): unmap every whole page inside a free range,
        in both pools."""
        for pool in (self.pools[False], self.pools[True]):
            for _, offset in list(pool.free):
                block = pool.at[offset]
                low = math.ceil(block.offset / pool.page) * pool.page
                high = (block.offset + block.size) // pool.page * pool.page
                if low >= high:
                    continue
                pool.remove_free(block)
                if high < block.offset + block.size:
                    after = _Range(high, block.offset + block.size - high, "free")
                    _link(after, block.next)
                    _link(block, after)
                    pool.add_free(after)
                if low > block.offset:
                    before = _Range(block.offset, low - block.offset, "free")
                    _link(block.prev, before)
                    _link(before, block)
                    if block is pool.head:
                        pool.head = before
                    pool.add_free(before)
                block.offset, block.size, block.state = low, high - low, "unmapped"
                self.reserved -= high - low
                pool.merge(block)


def replay(events: list[tuple[str, int, int]], setting: str = "native", capacity: int | None = None,
           ) -> AllocatorResult:
    """Run an allocation log through the model of `setting`; `capacity` bytes makes OOM possible."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown allocator setting {setting!r} (valid: {', '.join(SETTINGS)})")
    if setting == "cudaMallocAsync":
        return _async_floor(events, capacity)
    allocator = NativeAllocator(capacity) if setting == "native" else ExpandableSegmentsAllocator(capacity)
    peak_reserved = peak_allocated = 0
    for index, (kind, key, size) in enumerate(events):
        if kind == "alloc":
            if size == 0:
                continue  # never reaches the allocator
            if not allocator.malloc(key, size):
                return AllocatorResult(max(peak_reserved, allocator.reserved), peak_allocated, True, index)
            peak_allocated = max(peak_allocated, allocator.allocated)
            peak_reserved = max(peak_reserved, allocator.reserved)
        else:
            allocator.free(key)
    return AllocatorResult(peak_reserved, peak_allocated)


def _async_floor(events, capacity: int | None) -> AllocatorResult:
    """cudaMallocAsync: the pool holds at least the live bytes and never shrinks, so its reserved
    peak is at least their peak; what the driver adds on top (granularity, sub-allocation) is not
    documented, and is left to measurement."""
    live = 0
    sizes: dict[int, int] = {}
    peak = 0
    for index, (kind, key, size) in enumerate(events):
        if kind == "alloc":
            sizes[key] = size
            live += size
            peak = max(peak, live)
            if capacity is not None and live > capacity:
                return AllocatorResult(peak, peak, True, index)
        else:
            live -= sizes.pop(key, 0)
    return AllocatorResult(peak, peak)
