"""pykvalloc.KVCache: the API contract of the issue, the engine's view of memory, lifetimes,
and every bad input (a clear error, nothing changed, the cache's check passing)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import gc
import textwrap
import threading

import numpy as np
import pytest
from support import mapped, run_python

import pykvalloc
from pykvalloc import _ffi
from pykvalloc.kvcache import dtype_bytes


def small(num_blocks: int = 16, block_tokens: int = 4, **kw) -> pykvalloc.KVCache:
    """3 layers, 2 KV heads of 4 fp16 elements: 16-byte slots, 96 bytes per token."""
    kw.setdefault("layers", 3)
    kw.setdefault("kv_heads", 2)
    kw.setdefault("head_dim", 4)
    kw.setdefault("dtype", "float16")
    kw.setdefault("pages", "small")
    return pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=block_tokens, **kw)


def state(cache: pykvalloc.KVCache, *seqs: pykvalloc.Sequence) -> tuple:
    # Everything but the counts of refusals and failures, the bookkeeping's size, and the calls'
    # latencies (a refused call may be one of the timed sample).
    stats = dataclasses.replace(cache.stats(), rejected_calls=0, alloc_failures=0,
                                metadata_bytes=0, timed_calls=0, timed_ns=0, call_ns_log2=(),
                                call_latency={})
    return stats, [np.array(s.block_table).tolist() for s in seqs]


def test_the_contract_of_the_issue() -> None:
    cache = pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=32, kv_heads=8, head_dim=128,
                              dtype="float16")
    assert cache.block_bytes == 2 * 32 * 8 * 128 * 2 * 16
    prompt = list(range(1000, 1040))  # 2 full blocks and 8 tokens
    seq = cache.allocate(40, tokens=prompt)
    assert seq.num_cached_tokens == 0
    table = seq.block_table
    assert table.dtype == np.uint32 and table.shape == (3,) and not table.flags.writeable
    del table
    assert seq.append(8) is None            # fills the third block
    assert seq.append(1) is None            # a fourth block
    assert seq.num_blocks == 4 and seq.num_tokens == 49
    child = seq.fork()
    again = cache.allocate(40, tokens=prompt)
    assert again.num_cached_tokens == 32
    assert np.array(again.block_table)[:2].tolist() == np.array(seq.block_table)[:2].tolist()
    stats = cache.stats()
    assert stats.hit_tokens == 32 and stats.query_tokens == 80
    assert stats.used_blocks == 5 and stats.forks == 1
    assert stats.hit_rate == 32 / 80 and stats.evictions == 0
    for s in (seq, child, again):
        s.free()
    stats = cache.stats()
    assert stats.cached_blocks == 2 and stats.free_blocks == 62
    cache.check()
    cache.close()


def test_block_table_is_a_view_without_a_copy() -> None:
    with small() as cache:
        seq = cache.allocate(9)
        view = seq.block_table
        again = seq.block_table
        assert view.__array_interface__["data"][0] == again.__array_interface__["data"][0]
        with pytest.raises(ValueError):
            view[0] = 7  # read-only
        # The view pins the table: the sequence may not change under it.
        with pytest.raises(pykvalloc.TableInUseError):
            seq.append(4)
        with pytest.raises(pykvalloc.TableInUseError):
            seq.free()
        fork = seq.fork()  # forking does not change this table
        del view, again
        gc.collect()
        seq.append(4)
        seq.free()
        fork.free()
        cache.check()


def test_views_keep_the_cache_alive_after_close() -> None:
    cache = small()
    seq = cache.allocate(8)
    view = seq.block_table
    expected = view.tolist()
    cache.close()
    assert view.tolist() == expected  # still readable: the cache is destroyed after the view
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.allocate(4)
    with pytest.raises(pykvalloc.PoolClosedError):
        seq.fork()
    del view
    gc.collect()
    cache.close()  # idempotent


def test_a_pool_closed_before_its_cache_is_destroyed_after_it() -> None:
    pool = pykvalloc.Pool(64 << 20, pages="small")
    with pytest.raises(pykvalloc.OutOfMemory):   # a failed creation leaves no user behind
        pykvalloc.KVCache(num_blocks=1 << 20, layers=2, kv_heads=1, head_dim=64, pool=pool)
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=16, layers=2, kv_heads=1, head_dim=64, pool=pool)
    seq = cache.allocate(20)
    pool.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        pool.stats()
    with pytest.raises(pykvalloc.PoolClosedError):
        pykvalloc.KVCache(num_blocks=4, layers=2, kv_heads=1, head_dim=64, pool=pool)
    # The cache goes on in the pool C still has; nothing is unmapped under it.
    assert mapped(pool._base)
    seq.append(20)
    other = cache.allocate(40)
    cache.check()
    seq.free()
    other.free()
    cache.close()   # its last user gone, the pool is destroyed
    assert not mapped(pool._base)

    # The same when the cache is garbage instead of closed.
    pool = pykvalloc.Pool(64 << 20, pages="small")
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=16, layers=2, kv_heads=1, head_dim=64, pool=pool)
    cache.allocate(20)
    pool.close()
    assert mapped(pool._base)
    del cache
    gc.collect()
    assert not mapped(pool._base)


def test_forgotten_sequences_are_freed() -> None:
    with small() as cache:
        cache.allocate(16)
        gc.collect()
        assert cache.stats().used_blocks == 0
        with cache.allocate(4) as seq:
            assert cache.stats().used_blocks == 1
        assert seq.freed and cache.stats().used_blocks == 0


def test_a_cache_and_its_forgotten_sequence_collected_together() -> None:
    """An engine object that held a cache and a sequence it never freed, in a cycle: the
    collector runs the cache's finalizer (the C cache destroyed) before the sequence's
    __del__, which must then leave the destroyed cache alone (reaching it would lock a freed
    mutex: a hang or a crash, so the scenario runs in a child process)."""
    result = run_python(textwrap.dedent("""
        import gc, sys
        import pykvalloc
        called, unraisable = [], []
        sys.unraisablehook = unraisable.append

        class Spy:  # the cache's library, recording each function taken from it
            def __init__(self, lib):
                self.lib = lib

            def __getattr__(self, name):
                called.append(name)
                return getattr(self.lib, name)

        class Engine:
            pass

        engine = Engine()
        engine.cache = pykvalloc.KVCache(num_blocks=16, block_tokens=4, layers=1, kv_heads=1,
                                         head_dim=8)
        engine.seq = engine.cache.allocate(16)
        engine.me = engine
        engine.cache._lib = Spy(engine.cache._lib)
        finalizer = engine.cache._finalizer
        del engine
        gc.collect()
        print(finalizer.alive, "kva_kv_seq_free" in called, len(unraisable))
    """), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "0"]  # destroyed; no free reached it


def test_a_sequence_forgotten_while_another_thread_holds_the_lock_is_freed_later() -> None:
    with small() as cache:
        seq = cache.allocate(16)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with cache._lock:
                held.set()
                release.wait(60)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(60), "hung"
        del seq  # __del__ cannot take the lock: the reaper thread frees it once it can
        release.set()
        holder.join(60)
        for _ in range(1200):
            if cache.stats().used_blocks == 0:
                break
            threading.Event().wait(0.05)
        assert cache.stats().used_blocks == 0, "hung: the forgotten sequence was never freed"


def test_addresses_in_both_layouts_are_writable_and_disjoint() -> None:
    for layout in ("layers", "blocks"):
        with small(num_blocks=5, layout=layout) as cache:
            info = cache.info
            assert info.layout.name.lower() == layout
            seen = set()
            for block in range(5):
                for layer in range(3):
                    for kind in ("K", "V"):
                        address = cache.block_address(block, layer, kind)
                        expected = (info.base + block * info.block_stride +
                                    layer * info.layer_stride + (kind == "V") * info.part_bytes)
                        assert address == expected
                        ctypes.memset(address, 0xAB, info.part_bytes)
                        seen.update(range(address, address + info.part_bytes))
            assert len(seen) == info.kv_bytes == 5 * cache.block_bytes


def test_copy_on_write_after_fork() -> None:
    with small() as cache:
        seq = cache.allocate(6, block_keys=[11])  # one full block, one with 2 tokens
        child = seq.fork()
        copy = child.append(1)
        parent_table = np.array(seq.block_table).tolist()
        child_table = np.array(child.block_table).tolist()
        assert copy == pykvalloc.CopyOnWrite(parent_table[1], child_table[1], 2)
        assert parent_table[0] == child_table[0]
        assert seq.append(1) is None  # the parent owns its block alone now
        assert cache.stats().cow_copies == 1


def test_prefix_keys_namespaces_priorities_pins_and_evict() -> None:
    with small(num_blocks=6) as cache:
        a = cache.allocate(8, block_keys=[1, 2], namespace=1, priority=6)
        b = cache.allocate(8, block_keys=[1, 2], namespace=2)
        assert b.num_cached_tokens == 0  # other namespace
        a.free()
        b.free()
        pin = cache.pin(block_keys=[1, 2], namespace=1)
        assert pin.num_tokens == 8
        big = cache.allocate(16)  # 4 blocks: 2 free, then namespace 2's two cached blocks
        assert cache.stats().evictions == 2
        big.free()
        assert cache.allocate(8, block_keys=[1, 2], namespace=1).num_cached_tokens == 8
        with pytest.raises(pykvalloc.InvalidArgument):
            pin.append(1)
        pin.unpin()
        gc.collect()
        assert cache.evict() == 2 and cache.stats().cached_blocks == 0
        cache.check()


def test_contiguous_mode_moves_with_a_copy_descriptor() -> None:
    with small(mode="contiguous", num_blocks=None, capacity_bytes=1 << 20, max_context=1024) as cache:
        seq = cache.allocate(10)
        address, bucket = seq.buffer
        assert bucket == 64 and address
        slot = cache.info.slot_bytes
        for layer in range(3):
            for part in range(2):
                ctypes.memset(address + (2 * layer + part) * bucket * slot, 1 + 2 * layer + part, 10 * slot)
        assert seq.append(54) is None
        move = seq.append(1)
        assert isinstance(move, pykvalloc.Move)
        assert (move.src, move.tokens, move.src_bucket, move.dst_bucket) == (address, 64, 64, 128)
        for layer in range(3):
            for part in range(2):
                ctypes.memmove(move.dst + (2 * layer + part) * 128 * slot,
                               move.src + (2 * layer + part) * 64 * slot, move.tokens * slot)
        new_address, new_bucket = seq.buffer
        assert (new_address, new_bucket) == (move.dst, 128)
        assert ctypes.string_at(new_address + 5 * 128 * slot, 1) == bytes([6])
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.block_table
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.fork()
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.append(2000)  # beyond max_context
        seq.free()
        assert cache.stats().moves == 1
        cache.check()


@pytest.mark.parametrize("dtype, size", [("float16", 2), ("bf16", 2), ("fp8", 1), ("float32", 4),
                                         (np.float16, 2), (np.dtype("float64"), 8),
                                         ("torch.bfloat16", 2)])
def test_dtypes(dtype, size) -> None:
    assert dtype_bytes(dtype) == size


@pytest.mark.parametrize("kwargs", [
    {"dtype": "float17"}, {"dtype": object}, {"dtype": "complex64"},
    {"layers": 0}, {"kv_heads": 0}, {"head_dim": 0}, {"block_tokens": 0}, {"num_blocks": 0},
    {"layers": -1}, {"layers": 2.5}, {"layout": "diagonal"}, {"mode": "sparse"},
    {"max_context": 100, "mode": "contiguous"}, {"pages": "enormous"}, {"hash_seed": -1},
    {"num_blocks": None, "capacity_bytes": -1},
    {"num_blocks": None, "capacity_bytes": 2**64 + 32768},  # would wrap to 32 KiB in C
    {"name": "ab\0cd"},                                    # C would see "ab"
    {"dtype": None},                                       # numpy would read float64
    {"hash_seed": True},
])
def test_bad_configurations_are_refused(kwargs) -> None:
    with pytest.raises(pykvalloc.InvalidArgument):
        small(**kwargs)


def test_the_default_block_size_is_the_library_s() -> None:
    config = _ffi.KvaKvConfig()
    _ffi.load().kva_kv_config_init(ctypes.byref(config))
    assert pykvalloc.DEFAULT_BLOCK_TOKENS == config.block_tokens
    with pykvalloc.KVCache(num_blocks=4, layers=1, kv_heads=1, head_dim=8, pages="small") as cache:
        assert cache.block_tokens == pykvalloc.DEFAULT_BLOCK_TOKENS


def test_hash_seed_takes_any_integer_type() -> None:
    cache = small(hash_seed=np.uint64(2**64 - 1))
    cache.close()


def test_pool_argument_must_be_a_pool() -> None:
    for bad in (5, "pool", object()):
        with pytest.raises(pykvalloc.InvalidArgument, match="must be a pykvalloc.Pool"):
            small(pool=bad)


@pytest.mark.parametrize("shared", [False, True])
def test_a_closed_cache_refuses_its_pool_calls(shared) -> None:
    # pool_fragmentation() and publish() passed the destroyed pool to C (a segfault, a use
    # after free under ASan), both for the cache's own pool and for a shared one.
    pool = pykvalloc.Pool(64 << 20, pages="small") if shared else None
    cache = small(pool=pool)
    assert 0.0 <= cache.pool_fragmentation() <= 1.0
    cache.publish()
    cache.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.pool_fragmentation()
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.publish()
    with pytest.raises(pykvalloc.PoolClosedError):
        with cache:
            pass
    if pool is not None:
        pool.close()


def test_a_cache_cannot_be_copied_or_pickled() -> None:
    # A copy shared the C handle: closing it destroyed the cache under the original.
    import copy
    import pickle
    cache = small()
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            attempt(cache)
    seq = cache.allocate(8)
    seq.free()
    cache.close()


def test_keys_span_64_bits_in_any_iterable() -> None:
    # A trace's hash ids span all 64 bits: a list mixing keys at or above 2**63 with smaller
    # ones (which numpy would make float64) is the same as the uint64 array, and so are a
    # generator and a tuple.
    keys = [1, 2**63 + 5, 2**64 - 1]
    with small(num_blocks=16) as cache:
        first = cache.allocate(12, block_keys=keys)
        assert first.num_cached_tokens == 0
        again = cache.allocate(12, block_keys=np.array(keys, dtype=np.uint64))
        assert again.num_cached_tokens == 12 and list(again.block_table) == list(first.block_table)
        from_generator = cache.allocate(12, block_keys=(key for key in keys))
        assert from_generator.num_cached_tokens == 12
        pin = cache.pin(block_keys=tuple(keys))
        assert pin.num_cached_tokens == 12
        from_tokens = cache.allocate(8, tokens=iter(range(8)))
        assert from_tokens.num_tokens == 8
        for sequence in (first, again, from_generator, pin, from_tokens):
            sequence.free()
        cache.check()


def test_bad_calls_change_nothing() -> None:
    with small(num_blocks=8) as cache:
        seq = cache.allocate(10, block_keys=[5, 6])
        child = seq.fork()
        gone = cache.allocate(4)
        gone.free()
        before = state(cache, seq, child)

        def refused(error, call, *args, **kwargs):
            with pytest.raises(error) as info:
                call(*args, **kwargs)
            assert str(info.value)  # a message that says why
            assert state(cache, seq, child) == before
            cache.check()

        refused(pykvalloc.InvalidArgument, cache.allocate, 7, block_keys=[1, 2])  # more keys than full blocks
        refused(pykvalloc.InvalidArgument, cache.allocate, 8, block_keys=[1], tokens=[1, 2, 3, 4])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, tokens=[1, 2, 3, 4, 5])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, priority=8)
        refused(pykvalloc.InvalidArgument, cache.allocate, -1)
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=[-3])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=[[1]])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=["a"])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=[True])  # not 1 in disguise
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=[1.0])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=[2**64])
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, block_keys=5)
        refused(pykvalloc.InvalidArgument, cache.allocate, 4, tokens=[2**32, 1, 2, 3])
        refused(pykvalloc.OutOfMemory, cache.allocate, 9 * 4)       # more than the cache
        refused(pykvalloc.OutOfMemory, cache.allocate, 6 * 4)       # more than is free now
        refused(pykvalloc.OutOfMemory, child.append, 6 * 4)         # 6 new + 1 copy > 5 free
        refused(pykvalloc.InvalidArgument, gone.append, 1)          # freed
        refused(pykvalloc.InvalidArgument, gone.fork)
        refused(pykvalloc.DoubleFree, gone.free)
        refused(pykvalloc.InvalidArgument, cache.block_address, 8, 0, "K")
        refused(pykvalloc.InvalidArgument, cache.block_address, 0, 3, "K")
        refused(pykvalloc.InvalidArgument, cache.block_address, 0, 0, "Q")
        refused(pykvalloc.InvalidArgument, cache.block_address, 0, 0, [1])   # not a kind at all
        refused(pykvalloc.InvalidArgument, cache.block_address, 0, 0, True)  # not 1 in disguise
        refused(pykvalloc.InvalidArgument, cache.block_address, 0, 0, 2)
        assert cache.block_address(0, 0, np.int64(1)) == cache.block_address(0, 0, "v")
        with pytest.raises(pykvalloc.InvalidArgument):
            gone.block_table
        with pytest.raises(TypeError):
            pykvalloc.Sequence()
        assert cache.stats().rejected_calls == 7  # the C-side refusals (the rest Python caught)
        seq.free()
        child.free()
        cache.check()


def test_threads_share_one_cache() -> None:
    with small(num_blocks=256) as cache:
        errors = []

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(2000):
                    keys = rng.integers(0, 4, size=int(rng.integers(0, 4))).tolist()
                    try:
                        seq = cache.allocate(16 + int(rng.integers(0, 5)), block_keys=keys)
                    except pykvalloc.OutOfMemory:
                        continue
                    if rng.random() < 0.5:
                        try:
                            seq.append(int(rng.integers(1, 9)))
                        except pykvalloc.OutOfMemory:
                            pass
                    seq.free()
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert cache.stats().used_blocks == 0
        cache.check()


def test_a_named_cache_publishes_for_the_inspector() -> None:
    from pykvalloc import stats
    name = f"kv-named-{os.getpid()}"
    cache = pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=2, kv_heads=2, head_dim=64, name=name)
    try:
        seq = cache.allocate(100, block_keys=[1, 2, 3, 4, 5, 6])
        seq.free()
        again = cache.allocate(64, block_keys=[1, 2, 3, 4])
        assert again.num_cached_tokens == 64
        with stats.open_segment(name) as segment:
            cache.publish()
            kv = segment.snapshot().kv
        assert kv["present"] == 1 and kv["total_blocks"] == 64 and kv["hit_tokens"] == 64
        assert kv["used_blocks"] == 4 and kv["cached_blocks"] == 2   # 6 keyed blocks, 4 reused
    finally:
        cache.close()
    with pytest.raises(pykvalloc.InvalidArgument, match="has its own"):
        with pykvalloc.Pool(1 << 26, name=f"{name}-pool") as pool:
            pykvalloc.KVCache(num_blocks=8, block_tokens=16, layers=2, kv_heads=2, head_dim=64, pool=pool,
                              name="other")


def test_gauges_agree_with_stats():
    # The replay asks every step; stats() builds every figure and its histograms.
    cache = pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=2, kv_heads=1, head_dim=64)
    held = cache.allocate(5 * 16)
    cache.allocate(3 * 16, block_keys=[1, 2, 3]).free()
    stats, gauges = cache.stats(), cache.gauges()
    assert gauges == (stats.used_blocks, stats.cached_blocks, stats.free_blocks, stats.sequences,
                      stats.bytes_in_use) == (5, 3, 56, 1, gauges.bytes_in_use)
    assert gauges.bytes_in_use > 0
    held.free()
    cache.close()
    with pytest.raises(pykvalloc.KvallocError):
        cache.gauges()


def test_a_plain_append_is_checked_as_any_other() -> None:
    # append(n) without content takes a path of its own (the reused copy struct, one call with
    # nothing converted): what it returns and refuses is what the general path does (its Move
    # in contiguous mode: test_contiguous_mode_moves_with_a_copy_descriptor).
    with small(num_blocks=4) as cache:
        seq = cache.allocate(2, block_keys=[])
        assert seq.append(2) is None and seq.num_tokens == 4
        child = seq.fork()
        assert child.append(1) is None  # a new block: the full one stays shared
        assert seq.append(0) is None and seq.num_tokens == 4
        grown = cache.allocate(3)
        twin = grown.fork()
        copy = twin.append(1)  # into the shared partial block: copied on write
        assert copy == pykvalloc.CopyOnWrite(grown.block_table[0], twin.block_table[0], 3)
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.append((1 << 32) - 1)  # past 2^32 - 1 tokens
        with pytest.raises(pykvalloc.OutOfMemory):
            seq.append(64)
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.append(1.0)  # type: ignore[arg-type]  # not an int: the general path says so
        with pytest.raises(pykvalloc.InvalidArgument):
            seq.append(-1)
        table = seq.block_table
        with pytest.raises(pykvalloc.TableInUseError):
            seq.append(1)
        del table
        assert seq.num_tokens == 4
        child.free()
        with pytest.raises(pykvalloc.DoubleFree):
            child.free()
        with pytest.raises(pykvalloc.InvalidArgument):
            child.append(1)  # freed
        cache.check()
    with pytest.raises(pykvalloc.PoolClosedError):
        seq.append(1)
