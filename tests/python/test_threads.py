"""Threads: a KV cache, a variable-size pool and a pool shared by several Python threads.

ctypes releases the GIL for the length of every foreign call, so the C calls of different
threads really overlap. The pykvalloc objects serialize their own calls with a Python lock; the
``raw`` tests call the library's functions on the same C object directly (``_ffi``), with no
Python lock in between, so only the library's own locking keeps it consistent. Every test ends
with the object's check passing and its statistics balancing against what the threads counted.

The raw pool test needs the thread-safe core (``kva_thread_flush`` exported); it runs in a child
interpreter, so that a crash fails the test instead of taking pytest down.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import sys
import threading
import time
import textwrap
from collections.abc import Callable
from ctypes import byref, c_uint32, c_uint64, c_void_p

import numpy as np
import pytest
from support import MiB, run_python

import pykvalloc
from pykvalloc import _ffi

THREADS = 6
BT = 4  # tokens per block in the KV tests


@pytest.fixture(autouse=True)
def _fast_switches() -> object:
    """Switch threads often, so that calls interleave as finely as the GIL allows."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def run_threads(work: Callable[[int], dict[str, int]], n: int = THREADS) -> dict[str, int]:
    """Runs work(0) .. work(n-1) at once, re-raises the first exception, sums their tallies."""
    barrier = threading.Barrier(n)
    results: list[dict[str, int] | None] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a thread hung (a deadlock?)"
    if errors:
        raise errors[0]
    total: dict[str, int] = {}
    for r in results:
        assert r is not None
        for k, v in r.items():
            total[k] = total.get(k, 0) + v
    return total


def run_with_checker(work: Callable[[int], dict[str, int]], check: Callable[[], None],
                     n: int = THREADS) -> dict[str, int]:
    """As run_threads, with thread 0 calling check() over and over until the n - 1 workers
    (work(1) .. work(n-1)) are done: long calls (a whole check) overlapping short ones."""
    finished = threading.Semaphore(0)

    def body(tid: int) -> dict[str, int]:
        if tid == 0:
            done = 0
            while done < n - 1:
                check()
                while finished.acquire(blocking=False):
                    done += 1
            return {}
        try:
            return work(tid)
        finally:
            finished.release()

    return run_threads(body, n)


def small_cache(num_blocks: int, **kw: object) -> pykvalloc.KVCache:
    """3 layers, 2 KV heads of 4 fp16 elements: 96 bytes per token."""
    return pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BT, layers=3, kv_heads=2,
                             head_dim=4, dtype="float16", pages="small", **kw)


def family_keys(family: int, n: int) -> list[int]:
    return [0x1000 * (family + 1) + i for i in range(n)]


def assert_kv_balanced(cache: pykvalloc.KVCache, tally: dict[str, int]) -> pykvalloc.KVStats:
    cache.check()
    st = cache.stats()
    assert st.sequences == 0 and st.pins == 0
    assert st.used_blocks == 0
    assert st.free_blocks + st.cached_blocks == st.num_blocks
    assert st.allocations == tally.get("allocations", 0)
    assert st.frees == tally.get("frees", 0)
    assert st.forks == tally.get("forks", 0)
    assert st.appends == tally.get("appends", 0)
    assert st.alloc_failures == tally.get("nomem", 0)
    assert st.hit_tokens > 0  # the threads shared prefix blocks
    return st


# ---- KV cache -----------------------------------------------------------------------------


def test_kv_cache_shared_by_threads() -> None:
    """The public API from several threads: allocate with shared prefixes, append, fork, pin,
    free; each thread checks its own sequences."""
    cache = small_cache(128)

    def work(tid: int) -> dict[str, int]:
        rng = random.Random(tid)
        live: list[tuple[pykvalloc.Sequence, int]] = []
        t = {"allocations": 0, "frees": 0, "forks": 0, "appends": 0, "nomem": 0}
        for _ in range(400):
            op = rng.random()
            if op < 0.3 and len(live) < 6:
                nkeys = rng.randrange(5)
                tokens = max(1, nkeys * BT + rng.randrange(2 * BT))
                try:
                    seq = cache.allocate(tokens, block_keys=family_keys(rng.randrange(4), nkeys),
                                         namespace=tid % 2)
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                t["allocations"] += 1
                assert seq.num_cached_tokens % BT == 0 and seq.num_cached_tokens <= nkeys * BT
                live.append((seq, tokens))
            elif op < 0.55 and live:
                i = rng.randrange(len(live))
                seq, tokens = live[i]
                try:
                    seq.append(1 + rng.randrange(BT))
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                t["appends"] += 1
                live[i] = (seq, seq.num_tokens)
                assert seq.num_blocks == -(-seq.num_tokens // BT)
            elif op < 0.65 and live and len(live) < 6:
                parent, tokens = live[rng.randrange(len(live))]
                child = parent.fork()
                t["forks"] += 1
                assert np.array_equal(np.array(child.block_table), np.array(parent.block_table))
                live.append((child, tokens))
            elif op < 0.7:
                with cache.pin(block_keys=family_keys(rng.randrange(4), 4), namespace=tid % 2) as pin:
                    assert pin.num_tokens % BT == 0
            elif live:
                seq, tokens = live.pop(rng.randrange(len(live)))
                assert seq.num_tokens == tokens
                seq.free()
                t["frees"] += 1
        for seq, _ in live:
            seq.free()
            t["frees"] += 1
        return t

    tally = run_threads(work)
    assert_kv_balanced(cache, tally)
    cache.close()


def test_kv_cache_raw_calls_overlap() -> None:
    """The C functions on one cache from several threads with no Python lock in between, while
    one thread checks and evicts."""
    cache = small_cache(96)
    lib = _ffi.load()
    handle = cache._handle

    def allocate(tokens: int, keys: list[int], ns: int) -> tuple[int, int]:
        arr = (c_uint64 * max(1, len(keys)))(*keys)
        seq, cached = c_uint64(), c_uint32()
        lib.kva_kv_seq_allocate(handle, tokens, arr, len(keys), None, 0, ns, 0, byref(seq),
                                byref(cached))
        return seq.value, cached.value

    def info(seq: int) -> _ffi.KvaKvSeqInfo:
        raw = _ffi.KvaKvSeqInfo()
        lib.kva_kv_seq_get_info(handle, seq, byref(raw))
        return raw

    def check() -> None:
        lib.kva_kv_check(handle)
        stats = _ffi.KvaKvStats()
        lib.kva_kv_get_stats(handle, byref(stats))
        assert stats.free_blocks + stats.used_blocks + stats.cached_blocks == stats.num_blocks
        lib.kva_kv_evict(handle, 2, None)

    def work(tid: int) -> dict[str, int]:
        t = {"allocations": 0, "frees": 0, "forks": 0, "appends": 0, "nomem": 0}
        rng = random.Random(100 + tid)
        live: dict[int, int] = {}  # handle -> tokens
        for _ in range(1500):
            op = rng.random()
            if op < 0.35 and len(live) < 5:
                nkeys = rng.randrange(4)
                tokens = max(1, nkeys * BT + rng.randrange(BT))
                try:
                    seq, cached = allocate(tokens, family_keys(rng.randrange(3), nkeys), tid % 2)
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                t["allocations"] += 1
                assert cached % BT == 0 and cached <= nkeys * BT
                live[seq] = tokens
            elif op < 0.6 and live:
                seq = rng.choice(list(live))
                copy = _ffi.KvaKvCopy()
                try:
                    lib.kva_kv_seq_append(handle, seq, 1, byref(copy))
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                t["appends"] += 1
                live[seq] += 1
            elif op < 0.7 and live and len(live) < 5:
                parent = rng.choice(list(live))
                child = c_uint64()
                lib.kva_kv_seq_fork(handle, parent, byref(child))
                t["forks"] += 1
                live[child.value] = live[parent]
            elif live:
                seq = rng.choice(list(live))
                lib.kva_kv_seq_free(handle, seq)
                t["frees"] += 1
                with pytest.raises(pykvalloc.DoubleFree, match="already freed"):
                    lib.kva_kv_seq_free(handle, seq)
                del live[seq]
            for seq, tokens in live.items():
                got = info(seq)
                assert got.num_tokens == tokens and got.num_blocks == -(-tokens // BT)
        for seq in live:
            lib.kva_kv_seq_free(handle, seq)
            t["frees"] += 1
        return t

    tally = run_with_checker(work, check)
    assert_kv_balanced(cache, tally)
    cache.close()


# ---- variable-size pool -------------------------------------------------------------------


def _stamp(address: int, size: int, value: int) -> None:
    stamp = value.to_bytes(8, "little")
    ctypes.memmove(address, stamp, 8)
    ctypes.memmove(address + size - 8, stamp, 8)


def _stamped(address: int, size: int, value: int) -> bool:
    stamp = value.to_bytes(8, "little")
    return ctypes.string_at(address, 8) == stamp and ctypes.string_at(address + size - 8, 8) == stamp


@pytest.mark.parametrize("policy", ["tlsf", "first", "best"])
def test_varpool_shared_by_threads(policy: str) -> None:
    """kva_var_alloc and kva_var_free on one VarPool from several threads, half through the
    VarPool object and half straight through the library; both ends of every range stamped and
    verified at free, so overlapping ranges would show; meanwhile one thread checks the pool
    straight through the library."""
    vp = pykvalloc.VarPool(8 * MiB, policy, pages="small")
    lib = _ffi.load()
    handle = vp._handle

    def check() -> None:
        lib.kva_var_check(handle)
        raw = _ffi.KvaVarStats()
        lib.kva_var_get_stats(handle, byref(raw))
        assert raw.bytes_used + raw.bytes_free == raw.capacity
        assert raw.live_allocations == raw.alloc_count - raw.free_count

    def work(tid: int) -> dict[str, int]:
        rng = random.Random(tid)
        raw = tid % 2 == 1
        live: dict[int, int] = {}
        allocations: dict[int, pykvalloc.Allocation] = {}  # the handles of the VarPool threads

        def free(address: int) -> None:
            if raw:
                lib.kva_var_free(handle, address)
            else:
                vp.free(allocations.pop(address))

        t = {"allocs": 0, "frees": 0, "nomem": 0, "rejected": 0}
        for _ in range(1500):
            if rng.random() < 0.55 and len(live) < 40:
                size = 16 + rng.randrange(64 * 1024)
                try:
                    if raw:
                        out = c_void_p()
                        lib.kva_var_alloc(handle, size, byref(out))
                        address = out.value
                    else:
                        allocation = vp.alloc(size)
                        address = allocation.address
                        allocations[address] = allocation
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                assert address
                t["allocs"] += 1
                _stamp(address, size, (tid << 48) ^ address)
                live[address] = size
            elif live:
                address = rng.choice(list(live))
                size = live.pop(address)
                assert _stamped(address, size, (tid << 48) ^ address)
                usable = (lib.kva_var_usable_size(handle, address) if raw
                          else vp.usable_size(allocations[address]))
                assert size <= usable < size + vp.alignment
                if usable > vp.alignment:
                    with pytest.raises(pykvalloc.InvalidPointer):
                        lib.kva_var_free(handle, address + vp.alignment)
                    t["rejected"] += 1
                free(address)
                t["frees"] += 1
        for address, size in live.items():
            assert _stamped(address, size, (tid << 48) ^ address)
            free(address)
            t["frees"] += 1
        return t

    tally = run_with_checker(work, check)
    vp.check()
    st = vp.stats()
    assert st.allocs == tally["allocs"] == tally["frees"] == st.frees
    assert st.live_allocations == 0 and st.used == 0 and st.requested == 0
    assert st.free == st.capacity == st.largest_free and st.free_ranges == 1
    assert st.failures == tally["nomem"]
    assert st.rejected_calls == tally["rejected"]
    vp.close()


# ---- pool -----------------------------------------------------------------------------------


def test_pool_shared_by_threads() -> None:
    """The Pool object from several threads: slab objects and buddy blocks, stamped."""
    pool = pykvalloc.Pool(32 * MiB, pages="small")

    def work(tid: int) -> dict[str, int]:
        rng = random.Random(tid)
        live: list[tuple[pykvalloc.Allocation, int]] = []
        t = {"allocs": 0, "frees": 0, "nomem": 0}
        for _ in range(1500):
            if rng.random() < 0.55 and len(live) < 64:
                size = 16 + rng.randrange(4096) if rng.random() < 0.9 else 16 + rng.randrange(1 << 20)
                try:
                    a = pool.alloc(size)
                except pykvalloc.OutOfMemory:
                    t["nomem"] += 1
                    continue
                t["allocs"] += 1
                _stamp(a.address, size, (tid << 48) ^ a.address)
                live.append((a, size))
            elif live:
                a, size = live.pop(rng.randrange(len(live)))
                assert _stamped(a.address, size, (tid << 48) ^ a.address)
                pool.free(a)
                t["frees"] += 1
        for a, size in live:
            assert _stamped(a.address, size, (tid << 48) ^ a.address)
            pool.free(a)
            t["frees"] += 1
        return t

    tally = run_threads(work)
    pool.check()
    st = pool.stats()
    assert st.alloc_count == tally["allocs"] == tally["frees"] == st.free_count
    assert st.live_allocations == 0 and st.bytes_in_use == 0
    assert st.alloc_failures == tally["nomem"]
    pool.close()


def _core_is_thread_safe() -> bool:
    return hasattr(_ffi.load()._dll, "kva_thread_flush")


RAW_POOL = textwrap.dedent("""
    import ctypes, random, sys, threading
    from ctypes import byref, c_void_p
    import pykvalloc
    from pykvalloc import _ffi

    sys.setswitchinterval(1e-5)
    pool = pykvalloc.Pool(64 << 20, pages="small")
    lib, handle = _ffi.load(), pool._handle
    counts = {"allocs": 0, "frees": 0, "nomem": 0}
    lock = threading.Lock()
    errors = []

    def work(tid):
        rng = random.Random(tid)
        live = {}
        a = f = n = 0
        try:
            for _ in range(3000):
                if rng.random() < 0.55 and len(live) < 64:
                    size = 16 + rng.randrange(8192) if rng.random() < 0.95 else 16 + rng.randrange(1 << 20)
                    out = c_void_p()
                    try:
                        lib.kva_alloc(handle, size, byref(out))
                    except pykvalloc.OutOfMemory:
                        n += 1
                        continue
                    a += 1
                    stamp = ((tid << 48) ^ out.value).to_bytes(8, "little")
                    ctypes.memmove(out.value, stamp, 8)
                    ctypes.memmove(out.value + size - 8, stamp, 8)
                    live[out.value] = size
                elif live:
                    address = rng.choice(list(live))
                    size = live.pop(address)
                    stamp = ((tid << 48) ^ address).to_bytes(8, "little")
                    assert ctypes.string_at(address, 8) == stamp, "head stamp"
                    assert ctypes.string_at(address + size - 8, 8) == stamp, "tail stamp"
                    lib.kva_free(handle, address)
                    f += 1
                if rng.random() < 0.01:
                    lib.kva_check(handle)
            for address in live:
                lib.kva_free(handle, address)
                f += 1
            lib.kva_thread_flush(handle)
        except BaseException as exc:
            errors.append(exc)
        with lock:
            counts["allocs"] += a
            counts["frees"] += f
            counts["nomem"] += n

    threads = [threading.Thread(target=work, args=(i,)) for i in range(%d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    pool.check()
    st = pool.stats()
    assert st.alloc_count == counts["allocs"] == counts["frees"] == st.free_count, (st, counts)
    assert st.live_allocations == 0 and st.bytes_in_use == 0, st
    assert st.alloc_failures == counts["nomem"], (st, counts)
    pool.close()
    print("ok", counts)
""") % THREADS


@pytest.mark.skipif(not _core_is_thread_safe(),
                    reason="the library's core pool is not thread safe yet (no kva_thread_flush)")
def test_pool_raw_calls_overlap() -> None:
    """kva_alloc, kva_free and kva_check on one pool from several threads with no Python lock in
    between: the pool's own thread safety (thread caches, arenas)."""
    result = run_python(RAW_POOL, env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")


def test_thread_caches_show_in_the_stats_and_flush() -> None:
    """A thread's cache holds the free objects of the words it owns: the stats count them
    (cached_bytes, thread_caches), thread_flush gives them back, and a thread's exit does."""
    with pykvalloc.Pool(64 * MiB, arenas=2) as pool:
        blocks = [pool.alloc(64) for _ in range(10)]
        for block in blocks[:5]:
            pool.free(block)
        stats = pool.stats()
        assert stats.arenas == 2 and stats.thread_caches == 1
        # The current word's free objects and the five freed: all cached by this thread.
        assert stats.cached_bytes >= 5 * 64 and stats.cached_bytes % 64 == 0
        assert stats.live_allocations == 5
        pool.thread_flush()
        assert pool.stats().cached_bytes == 0
        pool.check()

        def worker() -> None:
            mine = [pool.alloc(256) for _ in range(100)]
            for block in mine:
                pool.free(block)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        # join() returns when the Python thread is done; the C thread's exit (and its cache's
        # return, a pthread key destructor) follows a moment later.
        for polls in itertools.count():
            if pool.stats().thread_caches == 1:
                break
            assert polls < 6000, "hung: the worker's thread cache outlived its thread by 6,000 polls of 0.01 s"
            time.sleep(0.01)
        after = pool.stats()
        assert after.thread_caches == 1 and after.cached_bytes == 0  # the worker's went at exit
        assert after.live_allocations == 5 and after.bytes_in_use == 5 * 64
        for block in blocks[5:]:
            pool.free(block)
        pool.check()


def test_arenas_are_validated() -> None:
    with pytest.raises(pykvalloc.InvalidArgument, match="arenas"):
        pykvalloc.Pool(16 * MiB, arenas=100000)
