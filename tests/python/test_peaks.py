"""Peaks with a reset (Pool, KVCache, VarPool) and the KV cache's per-kind call latencies, in
Python and in the statistics segment, where they read as the objects say."""

from __future__ import annotations

import pytest
from stats_writer import unique_name

import pykvalloc
from pykvalloc import stats
from pykvalloc.errors import PoolClosedError
from pykvalloc._ffi import KV_CALL_KINDS, KVA_KV_CALL_SAMPLE_PERIOD


def small_cache(**options) -> pykvalloc.KVCache:
    return pykvalloc.KVCache(num_blocks=32, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                             **options)


def test_pool_peaks_rise_stay_and_reset() -> None:
    with pykvalloc.Pool(16 << 20, name=unique_name("peaks"), pages="small") as pool:
        big = pool.alloc(1 << 20)
        small = [pool.alloc(64) for _ in range(10)]
        during = pool.stats()
        assert during.peak_bytes_in_use == during.bytes_in_use
        assert during.peak_block_bytes >= during.peak_bytes_in_use >= 1 << 20
        pool.free(big)
        after = pool.stats()
        assert after.bytes_in_use == during.bytes_in_use - (1 << 20)
        assert (after.peak_block_bytes, after.peak_bytes_in_use) == (
            during.peak_block_bytes, during.peak_bytes_in_use)
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            summary = segment.snapshot().to_dict()["summary"]
        assert summary["peak_block_bytes"] == during.peak_block_bytes
        assert summary["peak_bytes_in_use"] == during.peak_bytes_in_use
        pool.reset_peaks()
        reset = pool.stats()
        assert reset.peak_bytes_in_use == reset.bytes_in_use
        assert reset.peak_block_bytes == reset.capacity - reset.bytes_free
        for block in small:
            pool.free(block)


def test_var_pool_peak_and_reset() -> None:
    with pykvalloc.VarPool(1 << 20) as var:
        a, b = var.alloc(4096), var.alloc(8192)
        assert var.stats().peak_used == var.stats().used
        var.free(b)
        assert var.stats().peak_used == var.stats().used + 8192
        var.reset_peaks()
        assert var.stats().peak_used == var.stats().used
        var.free(a)


def test_kv_peaks_and_reset_reach_the_segment() -> None:
    name = unique_name("kvpeaks")
    with small_cache(name=name) as cache:
        keyed = cache.allocate(64, block_keys=[1, 2, 3, 4])
        other = cache.allocate(100)
        assert cache.stats().peak_used_blocks == 4 + 7
        other.free()
        keyed.free()  # its 4 keyed blocks stay cached
        now = cache.stats()
        assert (now.used_blocks, now.cached_blocks) == (0, 4)
        assert (now.peak_used_blocks, now.peak_cached_blocks) == (11, 4)
        assert now.peak_bytes_in_use == 11 * cache.block_bytes
        with stats.open_segment(name) as segment:
            cache.publish()
            kv = segment.snapshot().to_dict()["kv"]
        assert (kv["peak_used_blocks"], kv["peak_cached_blocks"]) == (11, 4)
        assert kv["peak_bytes_in_use"] == 11 * cache.block_bytes and kv["bytes_in_use"] == 0
        cache.reset_peaks()
        reset = cache.stats()
        assert (reset.peak_used_blocks, reset.peak_cached_blocks, reset.peak_bytes_in_use) == (0, 4, 0)


def test_kv_call_latency_per_kind_in_python_and_the_segment() -> None:
    name = unique_name("kvlat")
    with small_cache(name=name, trace=True) as cache:
        seq = cache.allocate(16, block_keys=[7])
        for _ in range(5):
            seq.append(1)
        seq.free()
        assert cache.lookup(block_keys=[7]).hits == 1
        cache.evict(1)
        now = cache.stats()
        assert now.call_sample_period == 1
        timed = {kind: now.call_latency[kind].timed_calls for kind in KV_CALL_KINDS}
        assert timed["allocate"] == 1 and timed["append"] == 5 and timed["free"] == 1
        assert timed["lookup"] == 1 and timed["evict"] == 1
        for kind in KV_CALL_KINDS:
            assert sum(now.call_latency[kind].ns_log2) == timed[kind]
        assert now.timed_calls == sum(timed.values())
        cache.publish()
        with stats.open_segment(name) as segment:
            snap = segment.snapshot()
        assert snap.kv_call_sample_period == 1
        assert snap.kv_latency is not None
        # The segment holds what the cache said at the publish (stats() itself is not timed).
        for kind in KV_CALL_KINDS:
            assert snap.kv_latency[kind].tolist() == list(now.call_latency[kind].ns_log2)
        assert snap.kv_latency_percentiles("append") is not None
        assert snap.kv_latency_percentiles("other") is None  # no call of another kind
        latency = snap.to_dict()["kv"]["latency"]
        assert latency["append"]["samples"] == 5
        assert latency["append"]["sum_ns"] == now.call_latency["append"].timed_ns


def test_an_untraced_cache_times_a_sample_of_each_kind() -> None:
    with small_cache() as cache:
        rounds = 20 * KVA_KV_CALL_SAMPLE_PERIOD
        for _ in range(rounds):
            cache.allocate(16).free()
        now = cache.stats()
        assert now.call_sample_period == KVA_KV_CALL_SAMPLE_PERIOD
        for kind in ("allocate", "free"):
            assert 5 < now.call_latency[kind].timed_calls < 60, kind
        assert now.call_latency["append"].timed_calls == 0


def test_reset_peaks_after_close_raises() -> None:
    cache = small_cache()
    cache.close()
    with pytest.raises(PoolClosedError):
        cache.reset_peaks()


def test_kv_histograms_of_an_unstated_kind_count_are_not_read() -> None:
    # The histograms' meaning rests on call_kinds: a section that states another count (a
    # hand-made or damaged one) reads with its counters, without latencies.
    name = unique_name("kvkinds")
    with small_cache(name=name, trace=True) as cache:
        cache.allocate(16).free()
        cache.publish()
        with stats.open_segment(name) as segment:
            data = bytearray(segment.snapshot().data)
    snap = stats.Snapshot(bytes(data))
    assert snap.kv_latency is not None
    at = snap._sections[stats.SECTION_KV][0] + stats.KV_DTYPE.fields["call_kinds"][1]
    data[at:at + 4] = (5).to_bytes(4, "little")
    damaged = stats.Snapshot(bytes(data))
    assert damaged.kv is not None and int(damaged.kv["used_blocks"]) == 0
    assert damaged.kv_latency is None and damaged.to_dict()["kv"]["latency"] is None
