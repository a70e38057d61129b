"""VarPool: the variable-size pool's Python API under every policy."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import MiB

import pykvalloc
from pykvalloc import VarPool

POLICIES = ["tlsf", "first", "best", "worst"]


@pytest.mark.parametrize("policy", POLICIES)
def test_alloc_free_stats_check(policy):
    with VarPool(4 * MiB, policy=policy) as var:
        assert var.policy == policy and var.capacity == 4 * MiB and var.alignment == 256
        empty = var.stats()
        assert empty.used == 0 and empty.free == 4 * MiB and empty.largest_free == 4 * MiB
        assert empty.fragmentation == 0.0 and empty.free_ranges == 1 and empty.policy == policy
        a = var.alloc(1000)
        b = var.alloc(3000)
        c = var.alloc(256)
        for allocation in (a, b, c):
            address = allocation.address
            assert address % 256 == 0 and var.base <= address < var.base + var.capacity
            assert allocation.pool is var and allocation.offset == address - var.base
        assert (a.size, b.size, c.size) == (1000, 3000, 256)
        assert var.usable_size(a) == 1024 and var.usable_size(b) == 3072
        s = var.stats()
        assert s.used == 1024 + 3072 + 256 and s.requested == 4256 and s.internal_waste == 96
        assert s.live_allocations == 3 and s.allocs == 3
        var.free(b)
        s = var.stats()
        assert s.free_ranges == 2 and s.free == 4 * MiB - 1280
        assert s.largest_free == 4 * MiB - 1280 - 3072
        assert s.fragmentation == pytest.approx(1 - s.largest_free / s.free)
        var.check()
        var.free(a)
        var.free(c)
        s = var.stats()
        assert s.free_ranges == 1 and s.largest_free == 4 * MiB and s.frees == 3
        var.check()
    assert var.closed


def test_stats_fields():
    with VarPool(1 * MiB) as var:
        fields = {f.name for f in dataclasses.fields(var.stats())}
    assert {"used", "free", "largest_free", "fragmentation", "internal_waste", "free_ranges",
            "allocs", "frees", "failures"} <= fields


@pytest.mark.parametrize("policy", POLICIES)
def test_errors(policy):
    with VarPool(1 * MiB, policy=policy) as var:
        a = var.alloc(4096)
        b = var.alloc(4096)
        var.free(a)
        with pytest.raises(pykvalloc.DoubleFree, match="already freed"):
            var.free(a)
        with pytest.raises(pykvalloc.AllocationFreedError):
            var.usable_size(a)
        # Only a handle names a range: a bare address, even the right one, is refused.
        with pytest.raises(TypeError, match="expected an Allocation"):
            var.free(b.address)
        with pytest.raises(TypeError):
            var.usable_size(b.address)
        with pytest.raises(pykvalloc.InvalidArgument):
            var.alloc(0)
        with pytest.raises(ValueError):
            var.alloc(var.capacity + 1)
        with pytest.raises(pykvalloc.InvalidArgument):
            var.alloc(-1)
        with pytest.raises(TypeError):
            var.alloc(1.5)
        with pytest.raises(MemoryError):
            var.alloc(var.capacity)
        # C saw only alloc(0) and alloc(capacity + 1): the frees above were refused before it.
        s = var.stats()
        assert s.failures == 1 and s.rejected_calls == 2 and s.live_allocations == 1
        var.check()
    with pytest.raises(pykvalloc.PoolClosedError):
        var.alloc(16)
    with pytest.raises(pykvalloc.PoolClosedError):
        var.stats()
    var.close()


def test_bad_config():
    with pytest.raises(pykvalloc.InvalidArgument):
        VarPool(1 * MiB, policy="next")
    with pytest.raises(pykvalloc.InvalidArgument):
        VarPool(1 * MiB, alignment=300)
    with pytest.raises(pykvalloc.InvalidArgument):
        VarPool(100)
    with pytest.raises(pykvalloc.InvalidArgument, match="capacity 9223372036854775809"):
        VarPool(2**63 + 1)   # the message names what the caller gave


def test_huge_capacity():
    # 16 TiB in units of 1 GiB: the backing pool needs blocks above 4 KiB (2^32 of those are
    # too many), a config the caller never wrote, so it must not be refused for it. Address
    # space only: nothing is touched but the metadata of what is handed out.
    with VarPool(1 << 44, alignment=1 << 30) as var:
        assert var.capacity == 1 << 44
        var.free(var.alloc(3 << 30))
        var.check()


def test_default_pages_without_thp():
    # Transparent huge pages are VarPool's and KVCache's default preference, not the caller's
    # demand: in a process denied them (prctl PR_SET_THP_DISABLE, as a container runtime or a
    # parent may set) both are made on base pages, and only a THP request made by name is refused.
    script = textwrap.dedent("""
        import ctypes, sys
        if ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
            print("prctl refused"); sys.exit(77)
        import pykvalloc
        with pykvalloc.VarPool(8 << 20) as var:
            var.free(var.alloc(4096))
        with pykvalloc.KVCache(layers=2, kv_heads=2, head_dim=64, num_blocks=64) as cache:
            cache.allocate(100).free()
        try:
            pykvalloc.VarPool(8 << 20, pages="thp")
        except pykvalloc.BackendError as error:
            assert "PR_SET_THP_DISABLE" in str(error), error
        else:
            sys.exit("a THP VarPool was made where THP is disabled")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if done.returncode == 77:
        pytest.skip("this machine refuses prctl(PR_SET_THP_DISABLE)")
    assert done.returncode == 0, done.stdout + done.stderr


def test_over_a_checked_pool():
    # A checked pool's allocations start 16 B past a red zone: alignments above 16 are refused,
    # and 16 works, at exactly a power-of-two capacity too (the red zones need room beyond it).
    with pytest.raises(pykvalloc.InvalidArgument, match="checked"):
        VarPool(1 * MiB, checked=True, pages="small")
    with VarPool(1 * MiB, alignment=16, checked=True, pages="small") as var:
        allocations = [var.alloc(1000 + 7 * i) for i in range(8)]
        assert all(allocation.address % 16 == 0 for allocation in allocations)
        for allocation in allocations:
            var.free(allocation)
        var.check()


def test_alignment_and_backing_options():
    with VarPool(3 * MiB + 100, alignment=4096, pages="small") as var:
        assert var.capacity == 3 * MiB and var.alignment == 4096
        allocation = var.alloc(1)
        assert allocation.address % 4096 == 0 and var.stats().internal_waste == 4095
        assert repr(var).startswith("<pykvalloc.VarPool tlsf ") and repr(var).endswith(" open>")


@pytest.mark.parametrize("policy", POLICIES)
def test_random_round_trip(policy):
    rng = random.Random(7)
    with VarPool(8 * MiB, policy=policy) as var:
        live = []
        for step in range(3000):
            if live and rng.random() < 0.5:
                var.free(live.pop(rng.randrange(len(live))))
            else:
                try:
                    live.append(var.alloc(rng.randint(1, 256 << 10)))
                except MemoryError:
                    pass
            if step % 500 == 0:
                var.check()
        for allocation in live:
            var.free(allocation)
        s = var.stats()
        assert s.free_ranges == 1 and s.used == 0
        var.check()


def test_garbage_collection_releases_the_pool():
    var = VarPool(1 * MiB)
    var.alloc(100)
    finalizer = var._finalizer
    del var
    gc.collect()
    assert not finalizer.alive


def test_usable_from_an_exit_hook_that_runs_after_the_package_s():
    # The package's exit hook closes idle pools. A VarPool's own pool was one of them, so a
    # later exit hook (registered before the package was imported) found a VarPool that said it
    # was open over unmapped memory, and its first write crashed the interpreter.
    script = textwrap.dedent("""
        import atexit, ctypes
        kept = []
        def late():
            vp = kept[0]
            allocation = vp.alloc(4096)
            ctypes.memset(allocation.address, 7, 4096)
            vp.free(allocation)
            vp.check()
            vp.close()
            print("late hook done", flush=True)
        atexit.register(late)
        import pykvalloc
        kept.append(pykvalloc.VarPool(1 << 20))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "late hook done" in done.stdout


def test_a_closed_var_pool_refuses_with():
    vp = VarPool(1 * MiB)
    vp.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        with vp:
            pass



# -- handles: VarPool.alloc returns an Allocation, under Pool's rules -----------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_a_stale_free_is_double_free_and_spares_the_next_owner(policy):
    # The range a free gives back is the next alloc's: a second free of the old handle must
    # be refused before its address reaches C, where it names the new owner's range.
    with VarPool(1 * MiB, policy=policy) as var:
        old = var.alloc(4096)
        var.free(old)
        new = var.alloc(4096)
        assert int(new) == int(old)
        rejected = var.stats().rejected_calls
        with pytest.raises(pykvalloc.DoubleFree, match="already freed"):
            var.free(old)
        assert var.usable_size(new) == 4096
        s = var.stats()
        assert s.live_allocations == 1 and s.used == 4096 and s.rejected_calls == rejected
        var.check()
        assert old.freed and not new.freed and new.address == int(new)
        var.free(new)


def test_a_handle_of_another_pool_is_refused():
    with VarPool(1 * MiB) as var, VarPool(1 * MiB) as other, \
            pykvalloc.Pool(4 * MiB, pages="small") as pool:
        mine, foreign, block = var.alloc(4096), other.alloc(4096), pool.alloc(4096)
        before = var.stats(), other.stats()
        with pytest.raises(pykvalloc.InvalidPointer, match="belongs to"):
            var.free(foreign)
        with pytest.raises(pykvalloc.InvalidPointer):
            var.usable_size(foreign)
        with pytest.raises(pykvalloc.InvalidPointer):
            var.free(block)
        with pytest.raises(pykvalloc.InvalidPointer):
            pool.free(mine)
        assert (var.stats(), other.stats()) == before
        assert not (mine.freed or foreign.freed or block.freed)
        var.free(mine)
        other.free(foreign)
        pool.free(block)
        var.check()
        other.check()


def test_use_after_close_is_refused():
    var = VarPool(1 * MiB)
    allocation = var.alloc(4096)
    var.close()
    for call in (lambda: var.free(allocation), lambda: var.usable_size(allocation),
                 allocation.view):
        with pytest.raises(pykvalloc.PoolClosedError):
            call()
    assert not allocation.freed  # refused, not freed: the VarPool took the range with it


def test_views_round_trip_and_pin_their_allocation():
    with VarPool(1 * MiB, pages="small") as var:
        first, second = var.alloc(4096), var.alloc(1000)
        keys = first.view(np.float32)
        assert keys.shape == (1024,) and keys.ctypes.data == first.address
        keys[:] = np.arange(1024, dtype=np.float32)
        second.view(np.uint8)[:] = 9
        assert (first.view(np.float32, (32, 32)).ravel() == np.arange(1024)).all()
        assert "1 views" in repr(first)
        stats = var.stats()
        column = keys[::4]  # derived arrays pin the allocation too
        del keys
        with pytest.raises(pykvalloc.AllocationInUseError, match="1 numpy view"):
            var.free(first)
        assert var.stats() == stats and not first.freed
        del column
        var.free(first)
        assert "freed" in repr(first)
        with pytest.raises(pykvalloc.AllocationFreedError):
            first.view()
        assert (second.view(np.uint8) == 9).all()
        var.free(second)
        var.check()


def test_a_view_keeps_its_var_pool_alive_and_mapped():
    def make_view():
        var = VarPool(1 * MiB, pages="small")
        view = var.alloc(MiB).view(np.uint8)
        view[:] = 42
        return view, var._finalizer, var._pool._finalizer  # the VarPool itself is dropped

    view, var_alive, mapping_alive = make_view()
    gc.collect()
    assert var_alive.alive and view.sum() == 42 * MiB
    del view
    gc.collect()
    assert not var_alive.alive and not mapping_alive.alive


def test_a_view_keeps_the_memory_mapped_after_close():
    with VarPool(1 * MiB, pages="small") as var:
        values = var.alloc(4096).view(np.int64)
        values[:] = 7
    assert var.closed
    mapping = var._pool._finalizer
    assert mapping.alive
    values += 1
    assert (values == 8).all()
    del values
    gc.collect()
    assert not mapping.alive


def test_a_view_keeps_its_range_from_the_pool_below_after_close():
    """A VarPool over a caller's Pool gives its range back to that Pool when it is destroyed:
    not while a view of it lives, else the Pool's next allocation gets the viewed memory."""
    with pykvalloc.Pool(64 * MiB, pages="small") as pool:
        var = VarPool(1 * MiB, pool=pool)
        view = var.alloc(4096).view(np.uint8)
        view[:] = 0xAA
        var_range = (var.base, var.base + 1 * MiB)
        var.close()
        newcomer = pool.alloc(1 * MiB)
        assert not var_range[0] <= newcomer.address < var_range[1]
        newcomer.view(np.uint8)[:] = 0x55
        assert (view == 0xAA).all()
        del view
        gc.collect()
        pool.check()
        again = pool.alloc(1 * MiB)  # the range is the Pool's again once the view is gone
        assert var_range[0] <= again.address < var_range[1]


def test_var_pools_and_their_handles_cannot_be_copied_or_pickled():
    # A handle is Pool's Allocation and a view's anchor Pool's too (test_errors covers both).
    with VarPool(1 * MiB) as var:
        allocation = var.alloc(64)
        for obj in (var, allocation):
            for copier in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match="cannot be copied"):
                    copier(obj)
        var.free(allocation)
