"""The KV-cache manager against an independent model of its policy (kv_model.py): 100,000 random
operations (allocations with shared prefixes by keys and by token ids in three namespaces and
eight priorities, appends, forks, frees, pins, evictions, compactions) on a cache small enough
to evict and to run out, comparing every block table, every copy on write, every compaction's
moves and every statistic."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from kv_model import STAT_NAMES, KVModel, NoRoom, check_namespaces

import pykvalloc

OPERATIONS = int(os.environ.get("KV_MODEL_OPERATIONS", "100000"))
BLOCK_TOKENS = 4


def make_request(rng: random.Random, families: list[list[int]]):
    """A prompt: a family's head (shared with other requests) and a tail of its own."""
    family = rng.choice(families)
    shared = rng.randint(0, len(family))
    own = [rng.randrange(1 << 40) for _ in range(rng.randint(0, 3))]
    keys = family[:shared] + own
    num_tokens = len(keys) * BLOCK_TOKENS + rng.randint(0, 2 * BLOCK_TOKENS - 1)
    style = rng.random()
    if style < 0.45:
        return num_tokens, {"block_keys": keys[:rng.randint(0, len(keys))]}
    if style < 0.9:  # the same content as token ids: each key spelled as BLOCK_TOKENS ids
        ids = [int(k >> (8 * j)) & 0xFFFFFF for k in keys for j in range(BLOCK_TOKENS)]
        return num_tokens, {"tokens": ids[:rng.randint(0, len(ids))]}
    return num_tokens, {}


@pytest.mark.parametrize("seed, num_blocks", [(1, 48), (2, 200)])
def test_random_operations_match_the_model(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    families = [[rng.randrange(1 << 40) for _ in range(rng.randint(1, 10))] for _ in range(6)]
    cache = pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BLOCK_TOKENS, layers=1,
                              kv_heads=1, head_dim=4, dtype="uint8")
    model = KVModel(num_blocks, BLOCK_TOKENS)
    live: dict[int, pykvalloc.Sequence] = {}
    counts = dict.fromkeys(("allocate", "nomem", "append", "cow", "fork", "free", "pin", "evict",
                            "compact"), 0)

    def same_table(handle: int) -> None:
        table = np.array(live[handle].block_table)
        assert table.tolist() == model.seqs[handle].table, f"table of {handle:#x}"

    for op in range(OPERATIONS // 2):  # each parametrized run does half
        roll = rng.random()
        if roll < 0.35 or not live:
            num_tokens, content = make_request(rng, families)
            namespace, priority = rng.randrange(3), rng.randrange(8)
            again = rng.random() < 0.25  # a preempted request admitted again
            try:
                expected = model.allocate(-1, num_tokens, model.contents(**content), namespace,
                                          priority, again)
            except NoRoom:
                expected = None
            if expected is None:
                with pytest.raises(pykvalloc.OutOfMemory):
                    cache.allocate(num_tokens, namespace=namespace, priority=priority,
                                   again=again, **content)
                counts["nomem"] += 1
            else:
                seq = cache.allocate(num_tokens, namespace=namespace, priority=priority,
                                     again=again, **content)
                model.seqs[seq.handle] = model.seqs.pop(-1)
                live[seq.handle] = seq
                assert seq.num_cached_tokens == expected.cached_tokens
                same_table(seq.handle)
                counts["allocate"] += 1
        elif roll < 0.40:
            _, content = make_request(rng, families)
            namespace = rng.randrange(3)
            expected = model.pin(-1, model.contents(**content), namespace)
            pin = cache.pin(namespace=namespace, **content)
            model.seqs[pin.handle] = model.seqs.pop(-1)
            live[pin.handle] = pin
            assert pin.num_tokens == expected.tokens
            same_table(pin.handle)
            counts["pin"] += 1
        elif roll < 0.70:
            handle = rng.choice(list(live))
            if model.seqs[handle].pin:
                continue
            n = rng.choice((0, 1, 1, 1, 2, 3, BLOCK_TOKENS, 3 * BLOCK_TOKENS))
            try:
                expected_copy = model.append(handle, n)
            except NoRoom:
                with pytest.raises(pykvalloc.OutOfMemory):
                    live[handle].append(n)
                counts["nomem"] += 1
            else:
                copy = live[handle].append(n)
                if expected_copy is None:
                    assert copy is None
                else:
                    assert copy == pykvalloc.CopyOnWrite(*expected_copy)
                    counts["cow"] += 1
                same_table(handle)
                counts["append"] += 1
        elif roll < 0.78:
            handle = rng.choice(list(live))
            if model.seqs[handle].pin:
                continue
            child = live[handle].fork()
            model.fork(handle, child.handle)
            live[child.handle] = child
            same_table(child.handle)
            counts["fork"] += 1
        elif roll < 0.97:
            handle = rng.choice(list(live))
            seq = live.pop(handle)
            if model.seqs[handle].pin:
                seq.unpin()
            else:
                seq.free()
            model.free_seq(handle)
            counts["free"] += 1
        elif roll < 0.985:
            count = rng.randint(0, 6)
            assert cache.evict(count) == model.evict(count)
            counts["evict"] += 1
        else:
            assert cache.compact().tolist() == [list(move) for move in model.compact()]
            for handle in live:
                same_table(handle)
            counts["compact"] += 1

        stats = cache.stats()
        assert {name: getattr(stats, name) for name in STAT_NAMES} == model.stats(), f"operation {op}"
        if op % 500 == 0:
            for handle in live:
                same_table(handle)
            check_namespaces(cache.namespaces(), model.namespace_totals(), f"operation {op}")
            cache.check()

    for handle, seq in live.items():
        same_table(handle)
        (seq.unpin if model.seqs[handle].pin else seq.free)()
        model.free_seq(handle)
    assert {name: getattr(cache.stats(), name) for name in STAT_NAMES} == model.stats()
    cache.check()
    # Every kind of operation happened, and often.
    assert min(counts.values()) > OPERATIONS // 2000, counts
    cache.close()
