"""Every way a call can fail, seen from Python: the exception class, its built-in parent, the
C status it stands for, and that the failure left the pool usable and unchanged."""

from __future__ import annotations

import copy
import pickle
from ctypes import c_void_p
from pathlib import Path

import numpy as np
import ctypes

import pytest
from support import MiB

import pykvalloc
from pykvalloc import _ffi
from pykvalloc.errors import error_for_status


def _hugetlb_pages_free() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


def _unchanged(before: pykvalloc.Stats, after: pykvalloc.Stats) -> bool:
    """Equal except for the counters that exist to count failures."""
    ignore = {"alloc_failures", "rejected_calls"}
    return all(getattr(before, name) == getattr(after, name)
               for name in before.__dataclass_fields__ if name not in ignore)


# -- statuses from the C library -------------------------------------------------------------

def test_size_zero_is_invalid_argument(pool):
    before = pool.stats()
    with pytest.raises(pykvalloc.InvalidArgument) as info:
        pool.alloc(0)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.status == 2 and error.function == "kva_alloc"
    assert error.detail and error.detail in str(error)
    assert str(error).startswith("invalid argument")
    after = pool.stats()
    assert _unchanged(before, after)
    assert after.rejected_calls == before.rejected_calls + 1


def test_size_larger_than_the_pool_is_invalid_argument(pool):
    with pytest.raises(pykvalloc.InvalidArgument, match="exceeds"):
        pool.alloc(pool.stats().max_alloc_size + 1)
    with pytest.raises(pykvalloc.InvalidArgument):
        pool.alloc_aligned(pool.capacity * 2, 4096)


@pytest.mark.parametrize("method", ["alloc", "alloc_exact"])
def test_every_allocator_rejects_size_zero_and_too_large(pool, method):
    allocate = getattr(pool, method)
    with pytest.raises(pykvalloc.InvalidArgument) as info:
        allocate(0)
    assert info.value.function == f"kva_{method}"
    with pytest.raises(pykvalloc.InvalidArgument):
        allocate(pool.capacity + 1)
    with pytest.raises(pykvalloc.InvalidArgument):
        pool.alloc_aligned(0, 64)


@pytest.mark.parametrize("size", [-1, 1 << 64, 1 << 70])
def test_size_outside_size_t_is_invalid_argument(pool, size):
    # Checked in Python: ctypes would wrap -1 into SIZE_MAX without a word.
    with pytest.raises(pykvalloc.InvalidArgument) as info:
        pool.alloc(size)
    assert info.value.function is None


@pytest.mark.parametrize("size", [1.5, "64", None])
def test_size_of_the_wrong_type_is_type_error(pool, size):
    with pytest.raises(TypeError):
        pool.alloc(size)


@pytest.mark.parametrize("method", ["alloc", "alloc_exact"])
def test_exhausting_the_pool_is_out_of_memory(pool, method):
    held = []
    with pytest.raises(pykvalloc.OutOfMemory) as info:
        for _ in range(64):
            held.append(getattr(pool, method)(MiB))
    error = info.value
    assert isinstance(error, MemoryError)
    assert error.status == 1 and error.function == f"kva_{method}"
    assert 0 < len(held) <= 16
    stats = pool.stats()
    assert stats.alloc_failures == 1 and stats.live_allocations == len(held)
    pool.check()
    pool.free(held.pop())
    held.append(getattr(pool, method)(MiB))  # the freed block is reusable at once


def test_bad_alignment_is_invalid_argument(pool):
    with pytest.raises(pykvalloc.InvalidArgument, match="alignment"):
        pool.alloc_aligned(64, 3)
    with pytest.raises(pykvalloc.InvalidArgument):
        pool.alloc_aligned(64, 0)


def test_double_free_detected_by_the_library(pool):
    allocation = pool.alloc(64)
    pool.free(allocation)
    lib = _ffi.load()
    with pytest.raises(pykvalloc.DoubleFree) as info:
        lib.kva_free(pool._handle, allocation.address)
    assert info.value.status == 3 and info.value.function == "kva_free"
    assert "already free" in str(info.value)
    pool.check()


def test_bad_pointers_detected_by_the_library(pool):
    lib = _ffi.load()
    allocation = pool.alloc(256 << 10)  # a buddy block: big enough to point into its middle
    with pytest.raises(pykvalloc.InvalidPointer, match="outside the pool"):
        lib.kva_free(pool._handle, pool.base + pool.capacity + 4096)
    with pytest.raises(pykvalloc.InvalidPointer) as info:
        lib.kva_free(pool._handle, allocation.address + 4096)
    assert info.value.status == 4
    with pytest.raises(pykvalloc.InvalidArgument, match="NULL"):
        lib.kva_free(pool._handle, None)
    with pytest.raises(pykvalloc.InvalidArgument, match="NULL"):
        lib.kva_alloc(None, 64, c_void_p())
    assert pool.usable_size(allocation) == 256 << 10
    pool.free(allocation)
    pool.check()


def test_status_mapping_covers_corruption_and_unknown_statuses():
    corrupt = error_for_status(6, "pool metadata corrupted", "free list of order 3 loops",
                               "kva_check")
    assert isinstance(corrupt, pykvalloc.CorruptionError)
    assert str(corrupt) == "pool metadata corrupted: free list of order 3 loops"
    unknown = error_for_status(99, "unknown status", "", "kva_alloc")
    assert type(unknown) is pykvalloc.KvallocError and unknown.status == 99
    assert str(unknown) == "unknown status"


def test_check_passes_on_a_healthy_pool(pool):
    allocations = [pool.alloc(size) for size in (1, 48, 4096, 65536, 65537, MiB)]
    pool.check()
    for allocation in allocations:
        pool.free(allocation)
    pool.check()


# -- misuse caught in Python before it reaches C ---------------------------------------------

def test_double_free_through_python(pool):
    allocation = pool.alloc(4096)
    pool.free(allocation)
    rejected = pool.stats().rejected_calls
    with pytest.raises(pykvalloc.DoubleFree, match="already freed") as info:
        pool.free(allocation)
    assert info.value.status == 3
    # Python caught it: a stale address never reaches C, where it could belong to a newer
    # allocation by now.
    assert pool.stats().rejected_calls == rejected


def test_free_of_another_pools_allocation_is_invalid_pointer(pool):
    with pykvalloc.Pool(4 * MiB, name="other") as other:
        foreign = other.alloc(64)
        with pytest.raises(pykvalloc.InvalidPointer, match="belongs to"):
            pool.free(foreign)
        with pytest.raises(pykvalloc.InvalidPointer):
            pool.usable_size(foreign)
        other.free(foreign)


def test_free_of_something_else_is_type_error(pool):
    with pytest.raises(TypeError):
        pool.free(pool.alloc(64).address)


def test_use_after_free_raises(pool):
    allocation = pool.alloc(4096)
    pool.free(allocation)
    assert allocation.freed and "freed" in repr(allocation)
    with pytest.raises(pykvalloc.AllocationFreedError):
        allocation.view()
    with pytest.raises(pykvalloc.AllocationFreedError):
        pool.usable_size(allocation)
    assert allocation.address and allocation.size == 4096  # still readable for logs


def test_use_after_close_raises_everywhere():
    pool = pykvalloc.Pool(4 * MiB)
    allocation = pool.alloc(64)
    pool.close()
    assert pool.closed and "closed" in repr(pool)
    calls = [
        lambda: pool.alloc(64),
        lambda: pool.alloc_aligned(64, 64),
        lambda: pool.free(allocation),
        lambda: pool.usable_size(allocation),
        lambda: allocation.view(),
        pool.stats,
        pool.class_stats,
        pool.check,
        pool.trim,
        pool.walk,
        pool.__enter__,
    ]
    for call in calls:
        with pytest.raises(pykvalloc.PoolClosedError):
            call()
    pool.close()  # idempotent


def test_free_with_live_views_is_refused(pool):
    allocation = pool.alloc(4096)
    view = allocation.view(np.float32)
    column = view[::4]  # derived arrays pin the allocation too
    del view
    with pytest.raises(pykvalloc.AllocationInUseError, match="1 numpy view") as info:
        pool.free(allocation)
    assert isinstance(info.value, BufferError)
    del column
    pool.free(allocation)


@pytest.mark.parametrize("dtype, shape, match", [
    (object, None, "Python objects"),
    ([("name", object), ("n", np.int64)], None, "Python objects"),
    ("V0", None, "no size"),
    (np.float64, (1024,), "needs 8192 bytes"),
    (np.uint8, (-1, 4), "negative"),
])
def test_bad_views_are_invalid_argument(pool, dtype, shape, match):
    allocation = pool.alloc(4096)
    with pytest.raises(pykvalloc.InvalidArgument, match=match):
        allocation.view(dtype, shape)
    pool.free(allocation)  # a refused view pins nothing


def test_allocations_cannot_be_made_up(pool):
    with pytest.raises(TypeError, match="Pool.alloc"):
        pykvalloc.Allocation(pool, pool.base, 4096)


def test_copy_and_pickle_are_refused(pool):
    allocation = pool.alloc(64)
    view = allocation.view()
    anchor = view
    while isinstance(anchor, np.ndarray):
        anchor = anchor.base
    for obj in (pool, allocation, anchor):
        with pytest.raises(TypeError, match="cannot be copied"):
            copy.copy(obj)
        with pytest.raises(TypeError, match="cannot be copied"):
            pickle.dumps(obj)
    # the numpy array itself pickles by value, which is harmless
    assert np.array_equal(pickle.loads(pickle.dumps(view)), view)


# -- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=16 * MiB, min_block=3000), "min_block 3000"),
    (dict(capacity=16 * MiB, min_block=128), "min_block"),
    (dict(capacity=16 * MiB, slab_chunk=1000), "slab_chunk"),
    (dict(capacity=0), "capacity"),
    (dict(capacity=-1), "capacity"),
    (dict(capacity=16 * MiB, name="has space"), "name"),
    (dict(capacity=16 * MiB, name="x" * 64), "name"),
    (dict(capacity=16 * MiB, name=""), "name"),
    (dict(capacity=16 * MiB, name="nul\0inside"), "NUL"),
    (dict(capacity=16 * MiB, pages="giant"), "pages"),
])
def test_bad_config_is_invalid_argument(kwargs, match):
    with pytest.raises(pykvalloc.InvalidArgument, match=match):
        pykvalloc.Pool(**kwargs)


def test_name_of_the_wrong_type_is_type_error():
    with pytest.raises(TypeError):
        pykvalloc.Pool(16 * MiB, name=b"bytes")


@pytest.mark.skipif(_hugetlb_pages_free() > 0, reason="this machine has hugetlb pages reserved")
def test_forced_hugetlb_without_hugetlb_pages_is_backend_error():
    with pytest.raises(pykvalloc.BackendError) as info:
        pykvalloc.Pool(16 * MiB, pages="hugetlb")
    assert isinstance(info.value, OSError)
    assert info.value.status == 5 and info.value.function == "kva_pool_create"
    assert "hugetlb" in str(info.value).lower()


def test_alloc_array_refuses_an_overflowing_product():
    with pykvalloc.Pool(16 * 1024 * 1024) as pool:
        with pytest.raises(pykvalloc.InvalidArgument, match="overflow"):
            pool.alloc_array(2**63, 2)
        block = pool.alloc_array(16, 64)
        assert block.size == 1024 and pool.usable_size(block) == 1024
        pool.free(block)
        pool.check()


def test_a_checked_pool_reports_writes_after_free_and_past_the_end():
    with pykvalloc.Pool(16 * 1024 * 1024, checked=True) as pool:
        a = pool.alloc(100)
        view = a.view("uint8")
        view[:] = 7
        del view
        pool.free(a)
        pool.check()
        b = pool.alloc(100)
        raw = (ctypes.c_uint8 * 101).from_address(b.address)
        raw[100] = 1                      # one byte past the end
        with pytest.raises(pykvalloc.CorruptionError, match="past its end"):
            pool.free(b)
        pool.check()
        # Freed all the same: the allocation is gone too, so that it can neither be freed
        # again nor viewed over whatever takes its place next.
        assert b.freed
        c = pool.alloc(100)
        assert c.address == b.address
        with pytest.raises(pykvalloc.DoubleFree):
            pool.free(b)
        with pytest.raises(pykvalloc.AllocationFreedError):
            b.view()
        assert not c.freed
        pool.free(c)
        pool.check()


def test_a_block_written_after_its_free_is_withheld():
    # The allocation that finds the write raises CorruptionError and keeps the block out of
    # use; check() goes on reporting it, and the stale address frees nothing.
    with pykvalloc.Pool(16 * 1024 * 1024, checked=True) as pool:
        stale = pool.alloc(256)
        address = stale.address
        stale.view()[10] = 7
        pool.free(stale)
        ctypes.memset(address + 10, 1, 1)   # through the freed pointer
        with pytest.raises(pykvalloc.CorruptionError, match="withheld"):
            pool.alloc(256)
        with pytest.raises(pykvalloc.CorruptionError, match="C2"):
            pool.check()
        fresh = pool.alloc(256)
        assert fresh.address != address
        pool.free(fresh)
