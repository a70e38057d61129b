"""The Pool API on the paths that succeed: allocation, statistics, size classes, the heap walk,
page backing, lifetime and threads."""

from __future__ import annotations

import dataclasses
import gc
import textwrap
import threading
from pathlib import Path

import pytest
from support import MiB, run_python

import pykvalloc
from pykvalloc import PageKind, WalkKind


def test_properties_and_repr():
    with pykvalloc.Pool(16 * MiB + 123, min_block=1024, slab_chunk=128 << 10, name="kv.cache-1",
                        pages="small") as pool:
        assert pool.capacity == 16 * MiB  # rounded down to min_block
        assert pool.min_block == 1024 and pool.slab_chunk == 128 << 10
        assert pool.name == "kv.cache-1" and not pool.closed
        assert pool.base and pool.base % 4096 == 0
        assert repr(pool) == f"<pykvalloc.Pool 'kv.cache-1' 16 MiB at {pool.base:#x} open>"
    assert pool.closed


def test_statistics_options_are_accepted():
    with pykvalloc.Pool(4 * MiB, name="traced", trace=True, publish_interval_ms=50) as pool:
        pool.free(pool.alloc(64))
    with pytest.raises(pykvalloc.InvalidArgument):
        pykvalloc.Pool(4 * MiB, publish_interval_ms=1 << 32)


def test_alloc_free_updates_stats(pool):
    empty = pool.stats()
    assert empty.live_allocations == 0 and empty.bytes_in_use == 0
    assert empty.bytes_free == pool.capacity and empty.fragmentation == 0.0
    allocations = [pool.alloc(size) for size in (1, 100, 4096, 70000, 3 * MiB)]
    stats = pool.stats()
    assert stats.live_allocations == 5 and stats.alloc_count == 5
    assert stats.bytes_in_use == sum(pool.usable_size(a) for a in allocations)
    for allocation in allocations:
        assert pool.base <= allocation.address < pool.base + pool.capacity
        assert allocation.offset == allocation.address - pool.base
        assert pool.usable_size(allocation) >= allocation.size
        pool.free(allocation)
    stats = pool.stats()
    assert stats.live_allocations == 0 and stats.free_count == 5 and stats.bytes_in_use == 0


def test_stats_is_a_frozen_dataclass(pool):
    stats = pool.stats()
    assert dataclasses.is_dataclass(stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.capacity = 0  # type: ignore[misc]
    assert stats.num_orders == len(stats.free_blocks) > 0
    assert stats.block_size(stats.num_orders - 1) == stats.capacity  # 16 MiB is a power of two
    assert isinstance(stats.page_kind, PageKind)
    assert stats.metadata_bytes > 0 and stats.page_size >= 4096


def test_buddy_blocks_are_aligned_to_their_size(pool):
    for size in (65537, 128 << 10, 300 << 10, MiB):
        allocation = pool.alloc(size)
        block = pool.usable_size(allocation)
        assert block & (block - 1) == 0 and block >= size
        assert allocation.offset % block == 0
        pool.free(allocation)


@pytest.mark.parametrize("alignment", [1 << shift for shift in range(0, 22)])
def test_alloc_aligned(pool, alignment):
    allocations = [pool.alloc_aligned(size, alignment) for size in (1, 24, 4096, 100000)]
    for allocation in allocations:
        assert allocation.address % alignment == 0
    for allocation in allocations:
        pool.free(allocation)
    pool.check()


def test_alloc_exact_rounds_only_to_min_block(pool):
    before = pool.stats().bytes_free
    layer = pool.alloc_exact(3 * MiB + 1)
    assert pool.usable_size(layer) == 3 * MiB + pool.min_block
    assert layer.offset % (4 * MiB) == 0  # aligned to the power of two above its size
    stats = pool.stats()
    assert stats.bytes_in_use == 3 * MiB + pool.min_block
    assert stats.bytes_free == before - stats.bytes_in_use  # the tail was given back at once
    regions = list(pool.walk())
    assert (layer.offset, 3 * MiB + pool.min_block, WalkKind.BLOCK) in regions
    layer.view()[-1] = 1  # the whole requested range is usable
    pool.free(layer)
    assert pool.stats().bytes_free == before
    pool.check()


def test_size_classes_match_usable_sizes(pool):
    classes = pykvalloc.size_classes()
    assert len(classes) == 49 and classes[0] == 16 and classes[-1] == 65536
    assert list(classes) == sorted(set(classes))
    for size in (1, 16, 17, 48, 49, 1000, 4096, 65535, 65536):
        index = pykvalloc.size_class_of(size)
        assert index is not None and classes[index] >= size
        assert index == 0 or classes[index - 1] < size
        allocation = pool.alloc(size)
        assert pool.usable_size(allocation) == classes[index]
        pool.free(allocation)
    assert pykvalloc.size_class_of(0) is None and pykvalloc.size_class_of(65537) is None


def test_class_stats_and_trim(pool):
    small = [pool.alloc(64) for _ in range(100)]
    per_class = pool.class_stats()
    assert [c.index for c in per_class] == list(range(49))
    assert [c.object_size for c in per_class] == list(pykvalloc.size_classes())
    sixty_four = per_class[pykvalloc.size_class_of(64)]
    assert sixty_four.live_objects == 100 and sixty_four.slabs == 1
    assert sixty_four.objects_per_slab == pool.slab_chunk // 64
    for allocation in small:
        pool.free(allocation)
    assert pool.stats().slab_count >= 1  # an empty slab is kept as a spare...
    pool.trim()
    stats = pool.stats()  # ...until trim returns it
    assert stats.slab_count == 0 and stats.bytes_free == pool.capacity
    pool.check()


def _assert_tiles(regions, capacity):
    position = 0
    for region in regions:
        assert region.offset >= position, "regions overlap or are out of order"
        assert region.size > 0
        position = region.end
    assert position <= capacity


def test_walk_of_an_empty_pool_is_all_free(pool):
    regions = list(pool.walk())
    assert regions and all(region.kind is WalkKind.FREE for region in regions)
    _assert_tiles(regions, pool.capacity)
    assert sum(region.size for region in regions) == pool.capacity


def test_walk_lists_every_allocation(pool):
    sizes = [24, 64, 64, 1000, 4096, 65536, 70000, 2 * MiB]
    allocations = [pool.alloc(size) for size in sizes]
    pool.free(allocations.pop(1))
    regions = list(pool.walk())
    _assert_tiles(regions, pool.capacity)
    live = {(r.offset, r.size) for r in regions if r.kind.is_live}
    assert live == {(a.offset, pool.usable_size(a)) for a in allocations}
    kinds = {r.kind for r in regions}
    assert kinds == {WalkKind.FREE, WalkKind.BLOCK, WalkKind.SLAB_OBJECT, WalkKind.SLAB_FREE}
    free_buddy = sum(r.size for r in regions if r.kind is WalkKind.FREE)
    assert free_buddy == pool.stats().bytes_free
    offset, size, kind = regions[0]  # a plain tuple too
    assert (offset, size, kind) == tuple(regions[0])


def test_walk_is_a_snapshot(pool):
    allocation = pool.alloc(64)
    walk = pool.walk()
    pool.free(allocation)  # changing the pool does not disturb a walk already taken
    assert any(region.kind is WalkKind.SLAB_OBJECT for region in walk)


class _WalkReportingAnUnknownKind:
    """Stands in for the library's kva_walk: calls the real ctypes callback with a region of
    a kind this package does not know, then one more that must never be reached."""

    def __init__(self) -> None:
        self.returned: list[int] = []

    def kva_walk(self, _handle: int, callback, _ctx) -> int:
        for kind in (WalkKind.FREE, 9, WalkKind.FREE):
            self.returned.append(callback(0, 4096, kind, None))
            if self.returned[-1]:
                break
        return 0


def test_walk_stops_cleanly_on_a_failing_callback():
    pool = pykvalloc.Pool(4 * MiB)
    real_lib, fake = pool._lib, _WalkReportingAnUnknownKind()
    pool._lib = fake
    try:
        with pytest.raises(pykvalloc.KvallocError, match="heap walk stopped") as info:
            pool.walk()
    finally:
        pool._lib = real_lib
    assert fake.returned == [0, 1]  # the callback asked C to stop at the bad region
    assert isinstance(info.value.__cause__, ValueError)
    pool.close()


def test_page_modes():
    with pykvalloc.Pool(8 * MiB, pages="small") as pool:
        stats = pool.stats()
        assert stats.page_kind is PageKind.SMALL and stats.page_size == 4096
    with pykvalloc.Pool(8 * MiB, pages=pykvalloc.PageMode.AUTO, prefault=True) as pool:
        assert pool.stats().page_kind in set(PageKind)
        allocation = pool.alloc(MiB)
        allocation.view()[:] = 1
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        with pykvalloc.Pool(8 * MiB, pages="THP") as pool:
            assert pool.stats().page_kind is PageKind.THP


def test_close_is_idempotent_and_a_forgotten_pool_is_released():
    pool = pykvalloc.Pool(4 * MiB)
    pool.close()
    pool.close()
    assert not pool._finalizer.alive

    forgotten = pykvalloc.Pool(4 * MiB)
    forgotten.alloc(4096)  # an allocation object that is dropped with the pool
    finalizer = forgotten._finalizer
    del forgotten
    gc.collect()
    assert not finalizer.alive


def test_exit_closes_idle_pools_and_spares_pools_with_views():
    # An exit handler registered before pykvalloc is imported runs after pykvalloc's own.
    code = textwrap.dedent("""
        import atexit
        def report():
            print(sorted(destroyed) == [idle._handle], idle.closed, viewed.closed)
            print(int(view.sum()))  # still mapped: the OS, not pykvalloc, reclaims this one
        atexit.register(report)
        import pykvalloc, pykvalloc._ffi
        lib = pykvalloc._ffi.load()
        destroyed, real_destroy = [], lib.kva_pool_destroy
        def spy(handle):
            destroyed.append(handle)
            real_destroy(handle)
        lib.kva_pool_destroy = spy
        idle = pykvalloc.Pool(1 << 20)
        viewed = pykvalloc.Pool(1 << 20)
        view = viewed.alloc(4096).view()
        view[:] = 1
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False", "4096"]


def test_many_pools():
    pools = [pykvalloc.Pool(MiB, name=f"p{i}") for i in range(64)]
    allocations = [pool.alloc(64) for pool in pools]
    assert len({a.address for a in allocations}) == 64
    for pool in pools:
        pool.close()


def test_threads_share_a_pool_safely():
    # The C pool is not thread safe; Pool's lock must serialize the calls. Without it these
    # threads would corrupt the metadata and check() (or the process) would fail.
    # Small slabs: the sizes below touch some thirty size classes, one slab each at least.
    pool = pykvalloc.Pool(16 * MiB, slab_chunk=64 << 10)
    errors = []

    def churn(seed: int) -> None:
        try:
            held = []
            for step in range(5000):
                if len(held) < 50 and (step + seed) % 3:
                    held.append(pool.alloc(16 + (step * 37 + seed) % 5000))
                elif held:
                    pool.free(held.pop((step * 7) % len(held)))
            for allocation in held:
                pool.free(allocation)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    pool.check()
    assert pool.stats().live_allocations == 0
    pool.close()


def test_bool_is_not_a_size() -> None:
    with pykvalloc.Pool(16 * MiB, pages="small") as pool:
        with pytest.raises(TypeError, match="not bool"):
            pool.alloc(True)
        assert pool.stats().live_allocations == 0
