"""Engines plug in (issue #22), the block calls (``cache.blocks``: take, ref, unref, commit) and
eviction by block and by key, reset, lookups and events, against the independent model
(kv_model.py): random streams of an engine that keeps its own prefix structure, as vLLM's
BlockPool does, mixed with sequences whose prompts hit the blocks it committed; bad input of
every kind, each refused with the cache unchanged."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import pytest
from kv_model import STAT_NAMES, KVModel, NoRoom, Refused, SideBySide

import pykvalloc

OPERATIONS = int(os.environ.get("KV_BLOCKS_OPERATIONS", "12000"))
BT = 4
KEY_LEN = 32
ERRORS = {"invalid": pykvalloc.InvalidArgument, "double_free": pykvalloc.DoubleFree}


def chain(parent: bytes, seeds: list[int]) -> list[bytes]:
    """An engine's chained keys (sha256, as vLLM's block hashes)."""
    keys = []
    for seed in seeds:
        parent = hashlib.sha256(parent + seed.to_bytes(8, "little")).digest()
        keys.append(parent)
    return keys


class Engine(SideBySide):
    """A cache and the model side by side, and what the engine holds: its references (a
    multiset of block ids) and the chains it committed."""

    def __init__(self, seed: int, num_blocks: int, event_capacity: int) -> None:
        self.rng = random.Random(seed)
        super().__init__(
            pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BT, layers=1, kv_heads=1,
                              head_dim=1, dtype="uint8", max_key_bytes=KEY_LEN,
                              events=event_capacity),
            KVModel(num_blocks, BT, event_capacity=event_capacity, max_key_bytes=KEY_LEN))
        self.held: list[int] = []  # the engine's references, one entry each
        self.chains = [chain(b"", [self.rng.randrange(1 << 40) for _ in range(6)])
                       for _ in range(5)]
        self.namespaces = (0, 7, (1 << 64) - 1)
        self.seqs: dict[int, pykvalloc.Sequence] = {}

    def refused(self, error: str, call, *args, **kwargs) -> None:
        """A call the model refuses: the library raises that error and nothing changes."""
        before = self.cache.stats()
        with pytest.raises(ERRORS[error]) as info:
            call(*args, **kwargs)
        assert str(info.value)
        after = self.cache.stats()
        assert after.rejected_calls == before.rejected_calls + 1
        self.same_state("after a refused call")
        self.count("refused_" + error)

    def keys(self) -> tuple[list[bytes], int]:
        """Keys of a chain (a prefix of a known one, then new ones) and a namespace."""
        base = self.rng.choice(self.chains)
        keys = base[:self.rng.randint(0, len(base))]
        keys += chain(keys[-1] if keys else b"", [self.rng.randrange(1 << 40)
                                                 for _ in range(self.rng.randint(0, 2))])
        return keys, self.rng.choice(self.namespaces)

    def take(self) -> None:
        n, prio = self.rng.randint(0, 5), self.rng.randrange(8)
        try:
            expected = self.model.block_take(n, prio)
        except NoRoom:
            with pytest.raises(pykvalloc.OutOfMemory):
                self.cache.blocks.take(n, prio)
            self.same_state("take refused")
            self.count("nomem")
            return
        ids = self.cache.blocks.take(n, prio)
        assert ids.dtype == np.uint32 and ids.tolist() == expected
        self.held += expected
        self.count("take")

    def unref(self) -> None:
        if self.held and self.rng.random() < 0.9:
            ids = self.rng.sample(self.held, self.rng.randint(1, min(4, len(self.held))))
        else:  # a block the engine does not hold that many times
            ids = [self.rng.randrange(self.model.num_blocks)]
        try:
            self.model.block_unref(ids)
        except Refused as refusal:
            self.refused(refusal.error, self.cache.blocks.unref, np.array(ids, dtype=np.uint32))
            return
        self.cache.blocks.unref(np.array(ids, dtype=np.uint32))
        for b in ids:
            self.held.remove(b)
        self.count("unref")

    def ref(self) -> None:
        ids = [self.rng.randrange(self.model.num_blocks) for _ in range(self.rng.randint(1, 3))]
        try:
            self.model.block_ref(ids)
        except Refused as refusal:
            self.refused(refusal.error, self.cache.blocks.ref, ids)
            return
        self.cache.blocks.ref(ids)
        self.held += ids
        self.count("ref")

    def commit(self) -> None:
        keys, ns = self.keys()
        alone = [b for b in set(self.held) if self.model.refs[b] == self.model.loose[b]
                 and self.model.prefix_of[b] is None]
        self.rng.shuffle(alone)
        ids = alone[:len(keys)]
        if self.rng.random() < 0.1 and self.held:  # a block not the engine's alone, or twice
            ids = ids[:-1] + [self.rng.choice(self.held + ids)] if ids else [self.held[0]]
        keys = keys[:len(ids)]
        if len(keys) < len(ids):
            ids = ids[:len(keys)]
        parent = self.rng.choice([None, b"\x01" * KEY_LEN])
        first = self.rng.randrange(0, 64) * BT
        try:
            expected = self.model.block_commit(ids, keys, KEY_LEN, ns, parent, first)
        except Refused as refusal:
            self.refused(refusal.error, self.cache.blocks.commit, ids, keys, ns, parent=parent,
                         first_token=first)
            return
        registered = self.cache.blocks.commit(np.array(ids, dtype=np.uint32),
                                              np.frombuffer(b"".join(keys), np.uint8).reshape(
                                                  len(keys), KEY_LEN),
                                              ns, parent=parent, first_token=first)
        assert registered.tolist() == expected
        self.count("commit" if ids else "commit_none")
        if registered.tolist() != ids:
            self.count("commit_duplicate")

    def admit(self) -> None:
        keys, ns = self.keys()
        num_tokens = len(keys) * BT + self.rng.randint(0, BT - 1)
        try:
            expected = self.model.admit(-1, num_tokens, "bytes", keys, ns, 0, KEY_LEN)
        except NoRoom:
            with pytest.raises(pykvalloc.OutOfMemory):
                self.cache.allocate(num_tokens, keys=keys, namespace=ns)
            self.count("nomem")
            return
        seq = self.cache.allocate(num_tokens, keys=keys or np.zeros((0, KEY_LEN), np.uint8),
                                  namespace=ns)
        self.model.seqs[seq.handle] = self.model.seqs.pop(-1)
        assert seq.num_cached_tokens == expected.cached_tokens
        assert self.cache.block_table(seq.handle).tolist() == expected.table
        self.seqs[seq.handle] = seq
        if expected.cached_tokens:
            self.count("admit_hit")
        self.count("admit")

    def free(self) -> None:
        handle = self.rng.choice(list(self.seqs))
        self.seqs.pop(handle).free()
        self.model.free_seq(handle)
        self.count("free")

    def lookup(self) -> None:
        keys, ns = self.keys()
        hits, ids = self.cache.lookup(keys or np.zeros((0, KEY_LEN), np.uint8), namespace=ns)
        assert (hits, ids.tolist()) == (len(self.model.lookup(self.model.contents(keys=keys), ns)),
                                        self.model.lookup(self.model.contents(keys=keys), ns))
        self.count("lookup")

    def evict_blocks(self) -> None:
        ids = [self.rng.randrange(self.model.num_blocks) for _ in range(self.rng.randint(0, 4))]
        assert self.cache.evict_blocks(ids) == self.model.evict_blocks(ids)
        self.count("evict_blocks")

    def evict_keys(self) -> None:
        keys, ns = self.keys()
        keys = keys[self.rng.randint(0, len(keys)):]
        assert self.cache.evict_keys(np.frombuffer(b"".join(keys), np.uint8).reshape(
            len(keys), KEY_LEN), ns) == self.model.evict_keys(keys, KEY_LEN, ns)
        self.count("evict_keys")

    def step(self, op: int) -> None:
        roll = self.rng.random()
        if roll < 0.18:
            self.take()
        elif roll < 0.36:
            self.unref()
        elif roll < 0.44:
            self.ref()
        elif roll < 0.60:
            self.commit()
        elif roll < 0.70:
            self.admit()
        elif roll < 0.78 and self.seqs:
            self.free()
        elif roll < 0.84:
            self.lookup()
        elif roll < 0.88:
            self.evict_blocks()
        elif roll < 0.91:
            self.evict_keys()
        elif roll < 0.912:
            self.cache.reset_prefix_cache()
            self.model.reset_prefix_cache()
            self.count("reset")
        elif roll < 0.92:
            moves = self.cache.compact()
            assert moves.tolist() == [list(m) for m in self.model.compact()]
            where = {int(src): int(dst) for src, dst in moves}
            self.held = [where.get(b, b) for b in self.held]  # the engine renames its ids
            self.count("compact")
        else:
            self.drain(self.rng.choice((None, 1, 3)))
        self.same_state(f"operation {op}")

    def close(self) -> None:
        for handle in list(self.seqs):
            self.seqs.pop(handle).free()
            self.model.free_seq(handle)
        self.cache.blocks.unref(self.held)
        self.model.block_unref(self.held)
        self.held = []
        self.same_state("all released")
        assert self.cache.stats().used_blocks == 0
        self.drain()
        self.cache.close()


@pytest.mark.parametrize("seed, num_blocks, event_capacity", [(3, 24, 16), (4, 120, 4096)])
def test_random_block_calls_match_the_model(seed: int, num_blocks: int, event_capacity: int) -> None:
    engine = Engine(seed, num_blocks, event_capacity)
    for op in range(OPERATIONS // 2):
        engine.step(op)
    engine.close()
    every = ("take", "unref", "ref", "commit", "commit_duplicate", "admit", "admit_hit", "free",
             "lookup", "evict_blocks", "evict_keys", "reset", "compact", "events",
             "refused_invalid", "refused_double_free")
    assert all(engine.counts.get(what, 0) > 0 for what in every), engine.counts


def small(num_blocks: int = 8, **kwargs) -> pykvalloc.KVCache:
    return pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BT, layers=1, kv_heads=1, head_dim=1,
                             dtype="uint8", **kwargs)


def snapshot(cache: pykvalloc.KVCache, handles) -> tuple:
    stats = cache.stats()
    tables = [cache.block_table(h).tolist() for h in handles]
    counters = {n: getattr(stats, n) for n in STAT_NAMES}
    return counters, tables


def test_bad_input_changes_nothing() -> None:
    cache = small(16, max_key_bytes=KEY_LEN, events=64)
    keys = chain(b"", [1, 2, 3])
    seq = cache.allocate(2 * BT + 1, keys=keys[:2])
    batch = cache.allocate_many([BT, 2 * BT], tokens=np.arange(3 * BT, dtype=np.uint32))
    ids = cache.blocks.take(2)
    handles = [seq.handle, *batch.handles.tolist()]
    cache.take_event_records()
    before = [snapshot(cache, handles)]

    def refused(error, call, *args, **kwargs):
        with pytest.raises(error) as info:
            call(*args, **kwargs)
        assert str(info.value)
        assert snapshot(cache, handles) == before[0], call
        assert len(cache.take_event_records()[0]) == 0
        cache.check()

    invalid = pykvalloc.InvalidArgument
    # Engine keys of 0 or 33 bytes; of a length other than the sequence's; in a cache without.
    refused(invalid, cache.allocate, BT, keys=[b""])
    refused(invalid, cache.allocate, BT, keys=[b"x" * 33])
    refused(invalid, cache.allocate, 2 * BT, keys=[b"ab", b"abc"])  # not one length
    refused(invalid, cache.allocate, BT, keys=b"x" * 32)  # one bytes object is not keys
    refused(invalid, cache.allocate, BT, keys=np.zeros((1, 33), np.uint8))
    refused(invalid, cache.allocate, BT, keys=np.zeros(32, np.uint8))  # not 2-D
    refused(invalid, seq.append, BT, keys=[b"y" * 16])
    refused(invalid, seq.append, BT, keys=[keys[2], keys[2]])  # one block fills: one key
    refused(invalid, seq.append, BT, tokens=[1, 2, 3, 4])  # another kind than its own
    refused(invalid, cache.allocate, BT, block_keys=[1], keys=[keys[0]])
    refused(invalid, cache.allocate, BT, namespace=1 << 64)
    refused(invalid, cache.allocate, BT, namespace=-1)
    with small() as plain:
        with pytest.raises(invalid):
            plain.allocate(BT, keys=[b"k" * 8])
        with pytest.raises(invalid):
            plain.take_events()  # a cache without events
    # Block calls: unknown ids, a double unref, a free block, a block a sequence holds.
    refused(invalid, cache.blocks.unref, [16])
    refused(pykvalloc.DoubleFree, cache.blocks.unref, [ids[0], ids[0]])
    refused(invalid, cache.blocks.unref, [ids[1], int(cache.block_table(seq.handle)[0])])
    refused(invalid, cache.blocks.ref, [15])  # free
    refused(invalid, cache.blocks.ref, [ids[0], 99])
    refused(invalid, cache.blocks.commit, [ids[0], ids[0]], keys[:2])  # listed twice
    refused(invalid, cache.blocks.commit, [int(cache.block_table(seq.handle)[2])], keys[2:])
    refused(invalid, cache.blocks.commit, [ids[0]], [b"k" * 33])
    refused(invalid, cache.blocks.commit, [ids[0]], keys[:2])  # 1 block, 2 keys
    refused(invalid, cache.blocks.commit, [ids[0]], keys[:1], parent=b"short")
    refused(invalid, cache.blocks.take, 1, priority=8)
    refused(pykvalloc.OutOfMemory, cache.blocks.take, 17)
    refused(invalid, cache.evict_blocks, [0, 16])
    refused(invalid, cache.evict_keys, [b""])
    refused(invalid, cache.evict_keys, [b"k" * 33])
    # Batches: one bad handle (freed, unknown, a pin, listed twice) and nothing changes.
    gone = cache.allocate(1)
    gone.free()
    pin = cache.pin(keys=keys[:1])
    good = batch.handles
    cache.take_event_records()
    before[0] = snapshot(cache, handles)
    for bad in (gone.handle, 12345, pin.handle, int(good[0])):
        error = pykvalloc.DoubleFree if bad in (gone.handle, int(good[0])) else invalid
        refused(error, cache.free_many, np.array([*good, bad], dtype=np.uint64))
        refused(invalid, cache.append_many, np.array([*good, bad], dtype=np.uint64), 1)
    pin.unpin()
    before[0] = snapshot(cache, handles)
    refused(invalid, cache.append_many, good, 1, tokens=np.arange(5, dtype=np.uint32),
            offsets=np.array([0, 2, 5], dtype=np.uint64))  # 2 tokens for a 1-token append
    refused(invalid, cache.append_many, good, 1, tokens=np.arange(2, dtype=np.uint32),
            offsets=np.array([0, 2, 1], dtype=np.uint64))  # decreasing
    refused(invalid, cache.append_many, good, 1, tokens=np.arange(2, dtype=np.uint32),
            offsets=np.array([0, 1, 3], dtype=np.uint64))  # past the items given
    refused(invalid, cache.append_many, good, np.array([1, 2, 3], dtype=np.uint32))
    refused(invalid, cache.append_many, good.astype(np.int64), 1)  # a cast could wrap
    refused(invalid, cache.append_many, good, 1, tokens=np.array([-1, 2], dtype=np.int64))
    refused(invalid, cache.allocate_many, [BT, BT], priorities=[0, 8])
    refused(invalid, cache.allocate_many, [BT, 2 * BT], block_keys=[1, 2, 3, 4],
            offsets=[0, 2, 4])  # 2 keys for a 1-block request
    refused(invalid, cache.allocate_many, [BT, BT], tokens=[1.5, 2.0])
    refused(invalid, cache.allocate_many, [BT, -BT])
    refused(invalid, cache.lookup_many, tokens=np.arange(4, dtype=np.uint32), offsets=[0, 8])
    cache.take_event_records()  # the refused calls above made no event
    # An events buffer too small: the rest stays for the next take.
    cache.blocks.commit(ids, keys[:2], namespace=9)
    first, dropped = cache.take_event_records(1)
    assert len(first) == 1 and dropped == 0
    rest, _ = cache.take_event_records(5)
    assert [int(r["block"]) for r in (*first, *rest)] == ids.tolist()
    with pytest.raises(invalid):
        cache.take_event_records(0)  # no room at all
    cache.blocks.unref(ids)
    cache.free_many(good)
    seq.free()
    cache.check()
    cache.close()


def test_the_engine_and_sequences_share_one_prefix_cache() -> None:
    cache = small(max_key_bytes=KEY_LEN, events=32)
    keys = chain(b"", [5, 6, 7])
    ids = cache.blocks.take(3)
    assert cache.blocks.commit(ids, keys, namespace=3).tolist() == ids.tolist()
    seq = cache.allocate(3 * BT + 2, keys=keys, namespace=3)  # a prompt hits what the engine committed
    assert seq.num_cached_tokens == 3 * BT
    assert cache.block_table(seq.handle).tolist()[:3] == ids.tolist()
    cache.blocks.unref(ids[::-1])  # vLLM frees a request's blocks last first
    seq.free()
    assert cache.stats().cached_blocks == 3
    hits, found = cache.lookup(keys, namespace=3)
    assert (hits, found.tolist()) == (3, ids.tolist())
    cache.blocks.ref(ids[:1])  # a hit on a cached block takes it off the LRU (vLLM's touch)
    assert cache.stats().cached_blocks == 2
    # An engine key registered already: the new block stays unregistered, the holder named.
    [dup] = cache.blocks.take(1)
    assert cache.blocks.commit([dup], keys[:1], namespace=3).tolist() == [ids[0]]
    cache.blocks.unref([dup, ids[0]])
    assert cache.stats().free_blocks == 8 - 3  # the duplicate went free, not cached
    assert cache.evict_keys(keys[1:2], namespace=3) == 1
    assert cache.evict_keys(keys[1:2], namespace=3) == 0
    assert cache.evict_blocks(ids) == 2  # keys 0 and 2; key 1 is gone already
    assert cache.stats().registered_blocks == 0
    cache.check()
    cache.close()
