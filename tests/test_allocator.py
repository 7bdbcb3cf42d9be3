"""The caching-allocator model: native segments and fragmentation, expandable segments' page mapping,
cudaMallocAsync's floor, OOM retries, against worked examples and invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.project.allocator import SETTINGS, ExpandableSegmentsAllocator, replay

MiB = 2**20


def _allocs(start: int, count: int, size: int) -> list[tuple[str, int, int]]:
    return [("alloc", start + i, size) for i in range(count)]


def _frees(*keys: int) -> list[tuple[str, int, int]]:
    return [("free", key, 0) for key in keys]


# reference/calibration.md and the 2026-06-01 allocator devlog: 8 x 16 MiB, all freed, then 4 x 32 MiB.
FRAGMENTING = _allocs(0, 8, 16 * MiB) + _frees(*range(8)) + _allocs(8, 4, 32 * MiB)


def test_native_reproduces_the_documented_fragmentation_example():
    good = _allocs(0, 4, 32 * MiB) + _frees(*range(4)) + _allocs(4, 8, 16 * MiB)
    assert replay(FRAGMENTING).peak_reserved == 256 * MiB  # 16 MiB segments cannot serve 32 MiB
    assert replay(good).peak_reserved == 128 * MiB


def test_native_segment_rules_and_oom():
    small = replay(_allocs(0, 3, 4096))  # three small blocks share one 2 MiB segment
    assert small.peak_reserved == 2 * MiB and small.peak_allocated == 3 * 4096
    assert replay(_allocs(0, 1, 3 * MiB)).peak_reserved == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert replay(_allocs(0, 1, 11 * MiB)).peak_reserved == 12 * MiB  # >= 10 MiB: rounded to 2 MiB
    # Freed 16 MiB segments are released and retried before an OOM is declared.
    assert not replay(FRAGMENTING, capacity=200 * MiB).oom
    assert replay(_allocs(0, 4, 32 * MiB), capacity=100 * MiB).oom


def test_zero_byte_requests_never_reach_the_allocator():
    for setting in SETTINGS:
        assert replay([("alloc", 0, 0), ("free", 0, 0)], setting).peak_reserved == 0


def test_expandable_segments_map_pages_by_the_shortfall_and_keep_freed_pages():
    # The devlog's worked examples: 8 x 16 MiB maps 7 pages of 20 MiB; after freeing them, 4 x 32 MiB
    # fit in the freed range without a new page (native needed 256 MiB).
    assert replay(_allocs(0, 8, 16 * MiB), "expandable_segments").peak_reserved == 140 * MiB
    assert replay(FRAGMENTING, "expandable_segments").peak_reserved == 140 * MiB
    # Small requests have their own segment of 2 MiB pages: 2 MiB (large pool, a 20 MiB page) then 0.5 MiB.
    assert replay([("alloc", 0, 2 * MiB), ("free", 0, 0), ("alloc", 1, MiB // 2)],
                  "expandable_segments").peak_reserved == 22 * MiB
    # Holes still fragment: a 32 MiB request cannot use two separate 16 MiB holes.
    holes = _allocs(0, 4, 16 * MiB) + _frees(0, 2) + [("alloc", 9, 32 * MiB)]
    assert replay(holes, "expandable_segments").peak_reserved == 100 * MiB
    # And it can reserve more than native: a lone 22 MiB request maps two 20 MiB pages.
    lone = [("alloc", 0, 22 * MiB)]
    assert replay(lone, "expandable_segments").peak_reserved == 40 * MiB > replay(lone).peak_reserved


def test_expandable_segments_split_large_blocks_down_to_512_bytes():
    # A 20 MiB page for 20 MiB - 512 B: the 512 B remainder is split off (native's large pool splits only
    # a remainder over 1 MiB, and would hand out the whole 20 MiB).
    allocator = ExpandableSegmentsAllocator()
    assert allocator.malloc(0, 20 * MiB - 512)
    assert allocator.reserved == 20 * MiB and allocator.allocated == 20 * MiB - 512
    # A 2 MiB request grows from that free remainder at the tail: one more page, not two.
    assert allocator.malloc(1, 2 * MiB)
    assert allocator.reserved == 40 * MiB and allocator.allocated == 22 * MiB - 512


def test_expandable_segments_unmap_free_pages_before_declaring_oom():
    # 5 x 16 MiB maps four 20 MiB pages; with the first four blocks freed, 64 MiB is free at the front and
    # the last block pins the fourth page. A 72 MiB request fits neither the hole nor the tail (80 + 80 MiB
    # mapped > 100 MiB): only unmapping the three wholly free pages first (release_cached_blocks) leaves
    # room for its four pages (20 + 80 = 100 MiB).
    log = _allocs(0, 5, 16 * MiB) + _frees(*range(4)) + [("alloc", 9, 72 * MiB)]
    assert not replay(log, "expandable_segments", capacity=100 * MiB).oom
    assert replay(log, "expandable_segments", capacity=100 * MiB - 1).oom
    assert replay(_allocs(0, 6, 16 * MiB), "expandable_segments", capacity=90 * MiB).oom


def test_async_reports_the_floor_it_can_know():
    # cudaMallocAsync's pool growth is undocumented: the model gives the peak of live bytes.
    result = replay(FRAGMENTING, "cudaMallocAsync")
    assert result.peak_reserved == result.peak_allocated == 128 * MiB


SIZES = st.sampled_from([512, 4096, 600 * 1024, MiB, 3 * MiB, 12 * MiB, 25 * MiB + 512])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 50)), max_size=150),
       st.sampled_from([None, 120 * MiB, 300 * MiB]))
def test_expandable_segments_invariants(operations, capacity):
    allocator = ExpandableSegmentsAllocator(capacity)
    live, key, previous = [], 0, 0
    for free_one, size, pick in operations:
        if free_one and live:
            allocator.free(live.pop(pick % len(live)))
        elif allocator.malloc(key, size):
            live.append(key)
        key += 1
        mapped = 0
        for pool in allocator.pools.values():
            block, offset, free = pool.head, 0, set()
            while block is not None:
                assert block.offset == offset  # ranges tile the address space in order
                if block.next is not None:
                    assert block.next.prev is block
                    assert block.state == "alloc" or block.next.state != block.state  # neighbours merged
                mapped += block.size if block.state != "unmapped" else 0
                free |= {(block.size, block.offset)} if block.state == "free" else set()
                offset, block = offset + block.size, block.next
            assert free == set(pool.free) and pool.free == sorted(pool.free)
        assert mapped == allocator.reserved >= allocator.allocated
        assert capacity is None or allocator.reserved <= capacity
        assert capacity is not None or allocator.reserved >= previous  # only an OOM retry unmaps
        previous = allocator.reserved


# --- allocator settings as techniques (alloc-expandable, alloc-async) ----------------------------------------


def test_allocator_techniques_set_the_environment_and_project_their_own_reserved_figure():
    import torch

    from harness.cell import Cell
    from harness.outcome import to_record
    from harness.profiles import load_profiles
    from harness.project import project_outcome
    from suites.techniques import Run, parse_stack
    from suites.workloads import get_workload

    profiles = load_profiles()
    rows = {}
    for technique in ("amp-bf16", "amp-bf16+alloc-expandable", "alloc-async+amp-bf16"):
        cell = Cell("gpt", "gpt2-124m", "train", technique, "h100-sxm", 8, source="projected").resolve(profiles)
        rows[cell.stack.name] = to_record(cell, project_outcome(cell), "t")
    native, expandable, asynchronous = rows.values()
    assert list(rows)[2] == "amp-bf16+alloc-async"  # stacks in phase order: the allocator is set last
    # Each row's peak reserved is its own setting's; the other settings' figures stay beside it.
    assert expandable.peak_reserved_bytes == native.peak_reserved_expandable_bytes < native.peak_reserved_bytes
    assert asynchronous.peak_reserved_bytes == native.peak_reserved_async_bytes == native.peak_allocated_bytes
    gpt = get_workload("gpt")
    run = Run(workload=gpt, size=gpt.size("smoke"), mode="train", profile=profiles["h100-sxm"],
              model=torch.nn.Linear(2, 2), batch_size=1)
    parse_stack("alloc-expandable").apply(run)
    assert run.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and run.allocator == "expandable_segments"


def test_allocator_techniques_say_where_they_do_not_apply():
    from harness.cell import Cell
    from harness.profiles import load_profiles

    profiles = load_profiles()
    cpu = Cell("gpt", "smoke", "train", "alloc-expandable", "cpu", 4).resolve(profiles)
    assert "the host CPU's allocator has no such setting" in cpu.unsupported
    amd = Cell("gpt", "smoke", "train", "alloc-async", "mi300x", 4, source="projected").resolve(profiles)
    assert "ROCm counterpart is not modelled" in amd.unsupported
    assert Cell("gpt", "smoke", "train", "alloc-expandable", "mi300x", 4, source="projected").resolve(
        profiles).unsupported is None
    try:
        Cell("gpt", "smoke", "train", "alloc-async+alloc-expandable", "h100-sxm", 4).resolve(profiles)
    except ValueError as exc:
        assert "alloc" in str(exc)
    else:
        raise AssertionError("two allocator settings must not stack")
