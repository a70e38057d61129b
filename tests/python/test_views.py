"""numpy views over pool memory: the data round-trips, and no view ever outlives its memory."""

from __future__ import annotations

import gc
import textwrap

import numpy as np
import pytest
from support import MiB, run_python

import pykvalloc


def test_round_trip_through_two_views(pool):
    allocation = pool.alloc(64 << 10)
    writer = allocation.view(np.float32)
    assert writer.shape == (16 << 10,) and writer.flags.writeable
    writer[:] = np.linspace(0.0, 1.0, writer.size, dtype=np.float32)
    reader = allocation.view(np.float32, shape=(128, 128))
    np.testing.assert_array_equal(reader.ravel(), writer)
    raw = allocation.view(np.uint8)
    assert raw.tobytes() == writer.tobytes()
    assert writer.ctypes.data == reader.ctypes.data == allocation.address


def test_views_of_different_allocations_do_not_overlap(pool):
    first, second = pool.alloc(4096), pool.alloc(4096)
    a, b = first.view(np.int64), second.view(np.int64)
    a[:] = 1
    b[:] = 2
    assert (a == 1).all() and (b == 2).all()


def test_view_shapes_and_dtypes(pool):
    allocation = pool.alloc(100)
    assert allocation.view().shape == (100,)
    assert allocation.view(np.float64).shape == (12,)  # whole items only
    assert allocation.view(np.int16, 3).shape == (3,)
    assert allocation.view(np.int32, (0,)).size == 0
    pair = np.dtype([("key", np.float16), ("value", np.float16)])
    records = allocation.view(pair, (5, 5))
    records["key"] = 1.0
    assert records.shape == (5, 5) and (records["key"] == 1.0).all()
    heads = allocation.view(np.dtype((np.float32, (4,))), (6,))
    assert heads.shape == (6, 4) and heads.dtype == np.float32


def test_view_keeps_its_pool_alive_after_the_with_block():
    with pykvalloc.Pool(4 * MiB) as pool:
        allocation = pool.alloc(4096)
        keys = allocation.view(np.int32)
        keys[:] = 7
    assert pool.closed
    with pytest.raises(pykvalloc.PoolClosedError):
        pool.alloc(64)
    with pytest.raises(pykvalloc.PoolClosedError):
        allocation.view()
    # The pool is closed to calls but its memory is still mapped for the view...
    assert pool._finalizer.alive
    keys += 1
    assert (keys == 8).all()
    tail = keys[-16:]
    del keys
    gc.collect()
    assert pool._finalizer.alive  # ...as long as anything derived from the view lives,
    assert (tail == 8).all()
    del tail
    gc.collect()
    assert not pool._finalizer.alive  # and is unmapped after the last one.


def test_view_keeps_a_forgotten_pool_alive():
    def make_view() -> np.ndarray:
        pool = pykvalloc.Pool(4 * MiB)
        view = pool.alloc(MiB).view(np.uint8)
        view[:] = 42
        return view  # the Pool object itself is dropped here

    view = make_view()
    gc.collect()
    assert view.sum() == 42 * MiB


def test_close_without_views_unmaps_at_once():
    pool = pykvalloc.Pool(4 * MiB)
    allocation = pool.alloc(4096)
    view = allocation.view()
    del view
    pool.close()
    assert not pool._finalizer.alive


def test_no_misuse_crashes_the_interpreter():
    # Each step would be a segfault or silent corruption with a naive binding. Run in a child
    # interpreter so that a crash fails this test instead of killing pytest, and end with views
    # and pools still alive to exercise interpreter shutdown.
    code = textwrap.dedent("""
        import gc, numpy as np, pykvalloc
        with pykvalloc.Pool(4 << 20) as pool:
            a = pool.alloc(4096)
            v = a.view(np.uint64)
        v[:] = 3                                        # after close: still mapped
        for call in (lambda: pool.alloc(1), lambda: pool.free(a), lambda: a.view(),
                     pool.stats, pool.walk, pool.check):
            try:
                call()
            except pykvalloc.PoolClosedError:
                pass
        other = pykvalloc.Pool(4 << 20)
        b = other.alloc(64)
        w = b.view()
        try:
            other.free(b)                               # views alive: refused
        except pykvalloc.AllocationInUseError:
            pass
        try:
            pool.free(b)                                # wrong pool
        except pykvalloc.KvallocError:
            pass
        del w
        other.free(b)
        try:
            b.view()                                    # after free
        except pykvalloc.AllocationFreedError:
            pass
        kept = pykvalloc.Pool(4 << 20).alloc(1 << 20).view()   # pool only reachable via view
        kept[:] = 1
        idle = pykvalloc.Pool(4 << 20, name="idle")              # closed by the exit hook
        gc.collect()
        print("survived", int(v.sum()), int(kept.sum()))
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["survived", str(3 * 512), str(MiB)]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr
