"""The KV-cache manager on a real trace: Mooncake's conversation trace (../shared/traces), 512
tokens per block, one request at a time, each request's full blocks keyed by its hash_ids.

With unlimited capacity the hit tokens must equal the count computed straight from the file
(a block hits when its whole prefix of ids was seen before). With a small capacity the LRU hit
rate is reported, and must equal the independent model's (kv_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_model import KVModel

import pykvalloc

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512

pytestmark = pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} "
                                "(../shared beside the repository)")


def requests() -> list[tuple[int, list[int]]]:
    """(input_length, hash ids of its full blocks) per request, in file order."""
    result = []
    with TRACE.open() as lines:
        for line in lines:
            record = json.loads(line)
            full = record["input_length"] // BLOCK_TOKENS
            result.append((record["input_length"], record["hash_ids"][:full]))
    return result


def expected_hits_unlimited(trace: list[tuple[int, list[int]]]) -> int:
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for _, ids in trace:
        prefixes = [tuple(ids[:i + 1]) for i in range(len(ids))]
        for prefix in prefixes:
            if prefix not in seen:
                break
            hits += BLOCK_TOKENS
        seen.update(prefixes)
    return hits


def replay(cache: pykvalloc.KVCache, trace: list[tuple[int, list[int]]]) -> None:
    for input_length, ids in trace:
        cache.allocate(input_length, block_keys=ids).free()


def make_cache(num_blocks: int) -> pykvalloc.KVCache:
    # The geometry does not change the policy; a tiny one keeps a 200,000-block cache small.
    return pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BLOCK_TOKENS, layers=1, kv_heads=1,
                             head_dim=1, dtype="uint8")


def test_unlimited_capacity_hits_every_repeated_prefix() -> None:
    trace = requests()
    distinct = len({tuple(ids[:i + 1]) for _, ids in trace for i in range(len(ids))})
    longest = max(-(-n // BLOCK_TOKENS) for n, _ in trace)
    with make_cache(distinct + longest) as cache:
        replay(cache, trace)
        stats = cache.stats()
        cache.check()
    assert stats.evictions == 0
    assert stats.hit_tokens == expected_hits_unlimited(trace)
    assert stats.query_tokens == sum(n for n, _ in trace)
    print(f"\nunlimited: {stats.hit_tokens} of {stats.query_tokens} prompt tokens hit "
          f"({stats.hit_rate:.1%}), {stats.cached_blocks} blocks cached")


@pytest.mark.parametrize("num_blocks", [1000, 10000])
def test_small_capacity_lru_hit_rate(num_blocks: int) -> None:
    trace = requests()
    with make_cache(num_blocks) as cache:
        model = KVModel(num_blocks, BLOCK_TOKENS)
        for handle, (input_length, ids) in enumerate(trace):
            seq = cache.allocate(input_length, block_keys=ids)
            expected = model.allocate(handle, input_length, model.contents(block_keys=ids), 0, 0)
            assert seq.num_cached_tokens == expected.cached_tokens
            seq.free()
            model.free_seq(handle)
        stats = cache.stats()
        cache.check()
    assert stats.hit_tokens == model.hit_tokens
    assert stats.evictions == model.evictions > 0
    assert stats.hit_tokens < expected_hits_unlimited(trace)
    print(f"\n{num_blocks} blocks: LRU hit rate {stats.hit_rate:.1%} "
          f"({stats.hit_tokens} of {stats.query_tokens} tokens), {stats.evictions} evictions")
