"""VarPool: the variable-size pool's Python API under every policy."""

from __future__ import annotations

import dataclasses
import gc
import random
import subprocess
import sys
import textwrap

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
        for address in (a, b, c):
            assert address % 256 == 0 and var.base <= address < var.base + var.capacity
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
        with pytest.raises(pykvalloc.DoubleFree):
            var.free(a)
        with pytest.raises(pykvalloc.InvalidPointer):
            var.free(b + 256)
        with pytest.raises(pykvalloc.InvalidPointer):
            var.free(var.base + var.capacity)
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
        s = var.stats()
        assert s.failures == 1 and s.rejected_calls == 5 and s.live_allocations == 1
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
        addresses = [var.alloc(1000 + 7 * i) for i in range(8)]
        assert all(address % 16 == 0 for address in addresses)
        for address in addresses:
            var.free(address)
        var.check()


def test_alignment_and_backing_options():
    with VarPool(3 * MiB + 100, alignment=4096, pages="small") as var:
        assert var.capacity == 3 * MiB and var.alignment == 4096
        address = var.alloc(1)
        assert address % 4096 == 0 and var.stats().internal_waste == 4095
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
        for address in live:
            var.free(address)
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
            address = vp.alloc(4096)
            ctypes.memset(address, 7, 4096)
            vp.free(address)
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
