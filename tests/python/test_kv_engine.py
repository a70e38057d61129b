"""Engines plug in (issue #22), the sequence side, against the independent model (kv_model.py):
content given as token ids, u64 keys or engine keys (bytes of one length) in 64-bit namespaces;
appends that commit the blocks decoding fills, so that a later turn of a conversation hits
them; the batch calls (allocate_many, append_many, free_many, lookup_many); lookups; KV events
drained in pieces from a ring small enough to drop some. Random streams compare every hit,
block table, copy on write, event and statistic after each operation, with ``cache.check()``
after each; the Mooncake conversation trace replays with the blocks each request's decoding
fills keyed as its next turn's prompt names them."""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from kv_model import KVModel, NoRoom, SideBySide

import pykvalloc

OPERATIONS = int(os.environ.get("KV_ENGINE_OPERATIONS", "8000"))
BT = 4
KEY_LEN = 20
NAMESPACES = (0, 1, 1 << 40, (1 << 64) - 1)
# More namespaces than the cache tracks one by one (32), for a share of the requests: the pooled
# row of kva_kv_namespaces is followed too.
MANY_NAMESPACES = tuple(range(1000, 1040))
KINDS = ("tokens", "key", "bytes")
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def engine_key(parent: bytes, seed: int) -> bytes:
    """An engine's chained key (what vLLM's block hashes are): the parent's key and the block."""
    return hashlib.sha256(parent + seed.to_bytes(8, "little")).digest()[:KEY_LEN]


def block_tokens_of(seed: int) -> list[int]:
    return [(seed * 131 + j * 7) % 60000 for j in range(BT)]


class Content:
    """What a sequence holds so far, in its kind: every token id, or a key per full block (and
    the token count), so that a next turn can start with all of it."""

    def __init__(self, kind: str, namespace: int) -> None:
        self.kind = kind
        self.namespace = namespace
        self.items: list = []
        self.tokens = 0

    def copy(self) -> Content:
        other = Content(self.kind, self.namespace)
        other.items = list(self.items)
        other.tokens = self.tokens
        return other

    def last_key(self) -> bytes:
        return self.items[-1] if self.items else b""

    def grow(self, rng: random.Random, seeds: list[int], extra: int) -> list:
        """Appends the blocks of seeds and `extra` more tokens; returns the items added."""
        added: list = []
        if self.kind == "tokens":
            for seed in seeds:
                added += block_tokens_of(seed)
            added += [rng.randrange(60000) for _ in range(extra)]
        else:  # a key per block: the caller keeps tokens // BT == len(items)
            for seed in seeds:
                added.append(seed if self.kind == "key" else engine_key(
                    (added[-1] if added and self.kind == "bytes" else self.last_key()), seed))
        self.items += added
        self.tokens += len(seeds) * BT + extra
        return added


def call_args(kind: str, items) -> dict:
    if kind == "bytes" and not len(items):  # no key to say the length: a (0, KEY_LEN) array does
        items = np.zeros((0, KEY_LEN), dtype=np.uint8)
    return {{"tokens": "tokens", "key": "block_keys", "bytes": "keys"}[kind]: items}


def flat(kind: str, per_request: list[list]):
    """A batch's content array: every request's items one after the other, and the offsets."""
    offsets = np.zeros(len(per_request) + 1, dtype=np.uint64)
    offsets[1:] = np.cumsum([len(items) for items in per_request])
    everything = [item for items in per_request for item in items]
    if kind == "tokens":
        return np.array(everything, dtype=np.uint32), offsets
    if kind == "key":
        return np.array(everything, dtype=np.uint64), offsets
    return (np.frombuffer(b"".join(everything), dtype=np.uint8).reshape(-1, KEY_LEN)
            if everything else np.zeros((0, KEY_LEN), dtype=np.uint8)), offsets


class Harness(SideBySide):
    """The sequence calls on a cache and the model, side by side."""

    def __init__(self, seed: int, num_blocks: int, event_capacity: int) -> None:
        self.rng = random.Random(seed)
        super().__init__(
            pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BT, layers=1, kv_heads=1,
                              head_dim=4, dtype="uint8", max_key_bytes=32,
                              events=event_capacity),
            KVModel(num_blocks, BT, event_capacity=event_capacity, max_key_bytes=32))
        self.objects: dict[int, pykvalloc.Sequence | None] = {}  # None: a batch's handle
        self.held: dict[int, Content | None] = {}  # None: a pin, or content not followed
        self.turns: list[Content] = []  # finished conversations' content, for next turns
        self.families = {kind: [[self.rng.randrange(1, 1 << 40) for _ in range(
            self.rng.randint(1, 8))] for _ in range(4)] for kind in KINDS}

    # -- requests ---------------------------------------------------------------------------

    def request(self, kind: str | None = None) -> tuple[int, Content, list, bool]:
        """A prompt: (num_tokens, its content, the items given, whether all are given)."""
        rng = self.rng
        kind = kind or rng.choice(KINDS)
        turns = [t for t in self.turns if t.kind == kind]
        if turns and rng.random() < 0.4:  # the next turn of a conversation
            content = rng.choice(turns).copy()
            if kind != "tokens" and content.tokens % BT:
                content.tokens -= content.tokens % BT  # its partial block is the new turn's
        else:
            content = Content(kind, rng.choice(NAMESPACES) if rng.random() < 0.8
                              else rng.choice(MANY_NAMESPACES))
            family = rng.choice(self.families[kind])
            content.grow(rng, family[:rng.randint(0, len(family))], 0)
        content.grow(rng, [rng.randrange(1, 1 << 40) for _ in range(rng.randint(0, 3))],
                     rng.randint(0, BT - 1) if kind == "tokens" else 0)
        if kind != "tokens":
            content.tokens += rng.randint(0, BT - 1)
        items = content.items
        whole = rng.random() < 0.75
        if not whole:
            items = items[:rng.randint(0, len(items))]
            whole = len(items) == (content.tokens if kind == "tokens" else content.tokens // BT)
        return content.tokens, content, items, whole

    def extension(self, handle: int) -> tuple[int, list | None]:
        """How many tokens an append adds and the content to give (None: none)."""
        rng = self.rng
        n = rng.choice((0, 1, 1, 1, 2, 3, BT, 2 * BT + 1))
        content = self.held.get(handle)
        if content is None or not self.model.seqs[handle].kind or rng.random() < 0.1:
            if content is not None:
                self.held[handle] = None  # no longer followed: the chain may end
            return n, None
        before = content.tokens
        assert before == self.model.seqs[handle].tokens
        if content.kind == "tokens":
            added = content.grow(rng, [], n)
        else:
            fills = (before + n) // BT - before // BT
            added = []
            for _ in range(fills):
                added += content.grow(rng, [rng.randrange(1, 1 << 40)], 0)
            content.tokens = before + n
        return n, added

    # -- checks -----------------------------------------------------------------------------

    def same_table(self, handle: int) -> None:
        assert self.cache.block_table(handle).tolist() == self.model.seqs[handle].table

    # -- operations -------------------------------------------------------------------------

    def admit(self) -> None:
        num_tokens, content, items, whole = self.request()
        ns, prio = content.namespace, self.rng.randrange(8)
        again = self.rng.random() < 0.3  # a preempted request admitted again
        try:
            expected = self.model.admit(-1, num_tokens, content.kind, items, ns, prio, KEY_LEN,
                                        again=again)
        except NoRoom:
            with pytest.raises(pykvalloc.OutOfMemory):
                self.cache.allocate(num_tokens, namespace=ns, priority=prio, again=again,
                                    **call_args(content.kind, items))
            self.count("nomem")
            return
        seq = self.cache.allocate(num_tokens, namespace=ns, priority=prio, again=again,
                                  **call_args(content.kind, items))
        self.model.seqs[seq.handle] = self.model.seqs.pop(-1)
        assert seq.num_cached_tokens == expected.cached_tokens
        assert seq.namespace == ns
        self.objects[seq.handle] = seq
        self.held[seq.handle] = content if whole else None
        self.same_table(seq.handle)
        self.count("admit")

    def admit_many(self) -> None:
        kind = self.rng.choice(KINDS)
        requests = [self.request(kind) for _ in range(self.rng.randint(1, 5))]
        namespaces = [content.namespace for _, content, _, _ in requests]
        priorities = [self.rng.randrange(8) for _ in requests]
        again = [self.rng.random() < 0.3 for _ in requests]
        content, offsets = flat(kind, [items for _, _, items, _ in requests])
        done = 0
        for i, (num_tokens, request, items, _) in enumerate(requests):
            try:
                self.model.admit(-1 - i, num_tokens, kind, items, namespaces[i], priorities[i],
                                 KEY_LEN, again=again[i])
            except NoRoom:
                break
            done += 1
        result = self.cache.allocate_many(
            np.array([r[0] for r in requests], dtype=np.uint32), offsets=offsets,
            namespaces=np.array(namespaces, dtype=np.uint64),
            priorities=np.array(priorities, dtype=np.uint8), again=np.array(again),
            **call_args(kind, content))
        assert result.done == done
        for i in range(done):
            handle = int(result.handles[i])
            self.model.seqs[handle] = self.model.seqs.pop(-1 - i)
            assert int(result.cached_tokens[i]) == self.model.seqs[handle].cached_tokens
            self.objects[handle] = None
            self.held[handle] = requests[i][1] if requests[i][3] else None
            self.same_table(handle)
        self.count("admit_many" if done == len(requests) else "admit_many_short")

    def growable(self) -> list[int]:
        return [h for h in self.objects if not self.model.seqs[h].pin]

    def extend(self) -> None:
        handle = self.rng.choice(self.growable())
        n, added = self.extension(handle)
        kind = self.held[handle].kind if added is not None else None
        try:
            copy = self.model.extend(handle, n, kind, added or [], KEY_LEN)
        except NoRoom:
            if added is not None:
                self.held[handle] = None  # the model changed nothing; stop following it
            with pytest.raises(pykvalloc.OutOfMemory):
                self.append(handle, n, kind, added)
            self.count("nomem")
            return
        got = self.append(handle, n, kind, added)
        if copy is None:
            assert got is None
        else:
            assert tuple(got) == copy
            self.count("cow")
        if added:
            self.count("commit")
        self.same_table(handle)
        self.count("extend")

    def append(self, handle: int, n: int, kind: str | None, added: list | None):
        seq = self.objects[handle]
        args = {} if added is None else call_args(kind, added)
        if seq is not None:
            return seq.append(n, **args)
        if added is not None:
            content, offsets = flat(kind, [added])
            args = dict(call_args(kind, content), offsets=offsets)
        result = self.cache.append_many(np.array([handle], dtype=np.uint64), n, **args)
        if result.done == 0:
            raise pykvalloc.OutOfMemory("the batch stopped at its first request")
        return None if not len(result.copies) else tuple(int(x) for x in result.copies[0][1:])

    def extend_many(self) -> None:
        handles = self.rng.sample(self.growable(), min(len(self.growable()),
                                                       self.rng.randint(1, 6)))
        kinds = [self.held[h].kind for h in handles if self.held[h] is not None]
        kind = self.rng.choice(kinds) if kinds else "tokens"
        plan = []
        for h in handles:
            if self.held[h] is not None and self.held[h].kind != kind:
                self.held[h] = None  # given no content in this batch: no longer followed
            n, added = self.extension(h)
            plan.append((h, n, added or []))
        copies, done = [], 0
        for i, (h, n, added) in enumerate(plan):
            try:
                copy = self.model.extend(h, n, kind if added else None, added, KEY_LEN)
            except NoRoom:
                for later, _, _ in plan[i:]:
                    self.held[later] = None  # not extended: its content ran ahead
                break
            if copy is not None:
                copies.append((i, *copy))
            done += 1
        content, offsets = flat(kind, [added for _, _, added in plan])
        result = self.cache.append_many(np.array([h for h, _, _ in plan], dtype=np.uint64),
                                        np.array([n for _, n, _ in plan], dtype=np.uint32),
                                        offsets=offsets, **call_args(kind, content))
        assert result.done == done
        assert result.copies.tolist() == [list(c) for c in copies]
        for h, _, _ in plan:
            self.same_table(h)
        self.count("extend_many" if done == len(plan) else "extend_many_short")

    def fork(self) -> None:
        handle = self.rng.choice(self.growable())
        seq = self.objects[handle]
        if seq is None:
            return
        child = seq.fork()
        self.model.fork(handle, child.handle)
        self.objects[child.handle] = child
        parent = self.held[handle]
        self.held[child.handle] = None if parent is None else parent.copy()
        self.same_table(child.handle)
        self.count("fork")

    def finish(self, handle: int) -> None:
        content = self.held.pop(handle)
        if content is not None and self.model.seqs[handle].kind and content.tokens:
            self.turns.append(content)
            del self.turns[:-12]
        self.objects.pop(handle)

    def free(self) -> None:
        handle = self.rng.choice(list(self.objects))
        seq = self.objects[handle]
        if seq is None:
            self.cache.free_many(np.array([handle], dtype=np.uint64))
        elif self.model.seqs[handle].pin:
            seq.unpin()
        else:
            seq.free()
        self.finish(handle)
        self.model.free_seq(handle)
        self.count("free")

    def free_many(self) -> None:
        handles = self.rng.sample(self.growable(), min(len(self.growable()),
                                                       self.rng.randint(1, 5)))
        self.cache.free_many(handles)  # a list of ints: converted once
        for handle in handles:
            self.finish(handle)
            self.model.free_seq(handle)
        self.count("free_many")

    def pin(self) -> None:
        _, content, items, _ = self.request()
        contents = self.model.block_contents(content.kind, items)
        expected = self.model.pin(-1, contents, content.namespace)
        pin = self.cache.pin(namespace=content.namespace, **call_args(content.kind, items))
        self.model.seqs[pin.handle] = self.model.seqs.pop(-1)
        assert pin.num_tokens == expected.tokens
        self.objects[pin.handle] = pin
        self.held[pin.handle] = None
        self.same_table(pin.handle)
        self.count("pin")

    def lookup(self) -> None:
        requests = [self.request() for _ in range(self.rng.randint(1, 4))]
        kind = requests[0][1].kind
        requests = [r for r in requests if r[1].kind == kind]
        expected = [self.model.lookup(self.model.block_contents(kind, items), c.namespace)
                    for _, c, items, _ in requests]
        if len(requests) == 1:
            _, content, items, _ = requests[0]
            hits, ids = self.cache.lookup(namespace=content.namespace, **call_args(kind, items))
            assert (hits, ids.tolist()) == (len(expected[0]), expected[0])
        else:
            content, offsets = flat(kind, [items for _, _, items, _ in requests])
            result = self.cache.lookup_many(
                offsets=offsets, namespaces=[c.namespace for _, c, _, _ in requests],
                **call_args(kind, content))
            for i, hits in enumerate(expected):
                start = int(offsets[i])
                # Token ids: a request's hit block ids from the first entry of its items.
                assert int(result.hits[i]) == len(hits)
                assert result.ids[start:start + len(hits)].tolist() == hits
        self.count("lookup")

    def step(self, op: int) -> None:
        roll = self.rng.random()
        if roll < 0.20 or not self.growable():
            self.admit()
        elif roll < 0.27:
            self.admit_many()
        elif roll < 0.50:
            self.extend()
        elif roll < 0.60:
            self.extend_many()
        elif roll < 0.64:
            self.fork()
        elif roll < 0.77:
            self.free()
        elif roll < 0.81:
            self.free_many()
        elif roll < 0.84:
            self.pin()
        elif roll < 0.90:
            self.lookup()
        elif roll < 0.92:
            n = self.rng.randint(0, 5)
            assert self.cache.evict(n) == self.model.evict(n)
            self.count("evict")
        elif roll < 0.93:
            assert self.cache.compact().tolist() == [list(m) for m in self.model.compact()]
            for handle in self.objects:
                self.same_table(handle)
            self.count("compact")
        else:
            self.drain(self.rng.choice((None, 1, 2, 5)))
        self.same_state(f"operation {op}")

    def close(self) -> None:
        for handle in list(self.objects):
            seq = self.objects[handle]
            if seq is None:
                self.cache.free_many([handle])
            else:
                (seq.unpin if self.model.seqs[handle].pin else seq.free)()
            self.finish(handle)
            self.model.free_seq(handle)
        self.drain()
        self.same_state("the end")
        self.cache.close()


@pytest.mark.parametrize("seed, num_blocks, event_capacity", [(1, 40, 24), (2, 160, 4096)])
def test_random_streams_match_the_model(seed: int, num_blocks: int, event_capacity: int) -> None:
    harness = Harness(seed, num_blocks, event_capacity)
    for op in range(OPERATIONS // 2):
        harness.step(op)
    harness.close()
    counts = harness.counts
    every = ("admit", "admit_many", "extend", "extend_many", "commit", "cow", "fork", "free",
             "free_many", "pin", "lookup", "evict", "compact", "events")
    assert all(counts.get(what, 0) > OPERATIONS // 2000 for what in every), counts
    if num_blocks == 40:  # small enough to run out, in single calls and mid-batch
        assert counts.get("nomem", 0) and counts.get("extend_many_short", 0) + counts.get(
            "admit_many_short", 0), counts


def test_decode_filled_blocks_are_hit_by_the_next_turn() -> None:
    # Each content kind: a first turn decodes 2.5 blocks told what they hold; the next turn's
    # prompt, the first turn's prompt and output and more, hits every full block of it.
    for kind in KINDS:
        cache = pykvalloc.KVCache(num_blocks=32, block_tokens=BT, layers=1, kv_heads=1,
                                  head_dim=1, dtype="uint8", max_key_bytes=KEY_LEN, events=64)
        rng = random.Random(7)
        first = Content(kind, 1 << 63)
        first.grow(rng, [11, 12], 2 if kind == "tokens" else 0)
        if kind != "tokens":
            first.tokens += 2
        seq = cache.allocate(first.tokens, namespace=first.namespace, **call_args(kind, first.items))
        assert seq.num_cached_tokens == 0
        for _ in range(10):  # one token at a time, as decoding goes
            before = first.tokens
            if kind == "tokens":
                added = first.grow(rng, [], 1)
            else:
                added = first.grow(rng, [rng.randrange(1 << 40)], 0) if (before + 1) % BT == 0 else []
                first.tokens = before + 1
            seq.append(1, **call_args(kind, added))
        assert first.tokens == 20
        stats = cache.stats()
        assert stats.registered_blocks == 5  # 2 of the prompt, 3 its decoding filled
        seq.free()
        second = first.copy()
        second.grow(rng, [21], 3 if kind == "tokens" else 0)
        if kind != "tokens":
            second.tokens += 3
        turn = cache.allocate(second.tokens, namespace=second.namespace,
                              **call_args(kind, second.items))
        assert turn.num_cached_tokens == 20
        other = cache.allocate(second.tokens, namespace=0, **call_args(kind, second.items))
        assert other.num_cached_tokens == 0  # another namespace shares nothing
        events = cache.take_events().events
        # Registrations that extend one chain are one event, whichever call made them: the
        # prompt's 2 blocks, the 3 its decoding filled, turn two's new one; then the other
        # namespace's chain.
        assert [type(e).__name__ for e in events] == ["BlockStored"] * 2
        assert [len(e.block_hashes) for e in events] == [6, 6]
        assert [e.first_token for e in events] == [0, 0]
        assert [e.namespace for e in events] == [1 << 63, 0]
        assert events[0].parent_block_hash is None
        if kind == "bytes":
            assert list(events[0].block_hashes) == second.items[:6]
        turn.free()
        other.free()
        cache.check()
        cache.close()


def watch_own_path(monkeypatch, name: str) -> list:
    """Replaces KVCache's method ``name`` (an arrays-as-they-are path that answers None to hand
    the call to the general path) by one that records each outcome: True (it answered), False
    (it handed the call on) or "refused" (it raised)."""
    taken: list = []
    own_path = getattr(pykvalloc.KVCache, name)

    def spy(self, *args):
        try:
            result = own_path(self, *args)
        except pykvalloc.KvallocError:
            taken.append("refused")
            raise
        taken.append(result is not None)
        return result

    monkeypatch.setattr(pykvalloc.KVCache, name, spy)
    return taken


def test_a_decode_step_of_arrays_is_checked_as_any_other(monkeypatch) -> None:
    # The engine's decode step (handles, keys of the blocks filled and their offsets, each an
    # array as the library reads it) takes a path of its own in the wrapper: it commits what it
    # is told, beside sequences keyed by token ids on the same cache, and an argument it does not
    # take as it is (a dtype, a shape, offsets past the keys) is refused as on the general path,
    # with nothing changed.
    taken = watch_own_path(monkeypatch, "_append_keyed")
    cache = pykvalloc.KVCache(num_blocks=64, block_tokens=4, layers=1, kv_heads=1, head_dim=1,
                              dtype="int8", max_key_bytes=KEY_LEN)
    keys = np.frombuffer(b"".join(engine_key(b"", i) for i in range(3)),
                         dtype=np.uint8).reshape(3, KEY_LEN)
    keyed = cache.allocate(3, keys=keys[:0])
    by_tokens = cache.allocate(3, tokens=[1, 2, 3])
    handles = np.array([keyed.handle], dtype=np.uint64)
    one = np.array([0, 1], dtype=np.uint64)
    for bad, why in (({"keys": keys.astype(np.uint16), "offsets": one}, "uint8"),
                     ({"keys": keys[:, ::2], "offsets": one}, "key_len"),
                     ({"keys": keys[:0], "offsets": one}, "beyond"),
                     ({"keys": keys, "offsets": np.array([0, 1, 1], dtype=np.uint64)}, "offsets")):
        with pytest.raises(pykvalloc.InvalidArgument):
            cache.append_many(handles, 1, **bad)
        assert keyed.num_tokens == 3, why
    assert taken == [False] * 4  # each was converted or refused by the general path
    # Arrays the library reads as they are: refused by the library, or by the cache's state,
    # on the arrays' own path, with nothing changed.
    with pytest.raises(pykvalloc.InvalidArgument, match="key_len"):
        cache.append_many(handles, 1, keys=keys[:1, :10].copy(), offsets=one)
    table = keyed.block_table
    with pytest.raises(pykvalloc.TableInUseError):
        cache.append_many(handles, 1, keys=keys[:1], offsets=one)
    del table
    assert keyed.num_tokens == 3 and taken[4:] == ["refused", "refused"]
    assert cache.append_many(handles, 1, keys=keys[:1], offsets=one).done == 1
    assert taken[-1]
    cache.append_many(np.array([by_tokens.handle], dtype=np.uint64), 1, tokens=[4])
    assert cache.append_many(handles, 4, keys=keys[1:2], offsets=one).done == 1
    assert cache.lookup(keys[:2]).hits == 2
    assert cache.lookup(tokens=[1, 2, 3, 4]).hits == 1
    assert keyed.num_tokens == 8
    cache.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.append_many(handles, 1, keys=keys[2:3], offsets=one)


def test_events_merge_a_chain_and_split_where_it_breaks() -> None:
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=BT, layers=1, kv_heads=1, head_dim=1,
                              dtype="uint8", max_key_bytes=8, events=True, event_medium="CPU")
    keys = [bytes([i]) * 8 for i in range(1, 7)]
    a = cache.allocate(3 * BT, keys=keys[:3])
    b = cache.allocate(5 * BT, keys=keys[:2] + keys[3:6])  # hits 2, stores 3 more
    b.free()  # its own blocks reach the LRU last first; the shared head stays with a
    a.free()
    assert cache.evict(2) == 2
    cache.reset_prefix_cache()
    events, dropped = cache.take_events()
    assert dropped == 0
    assert events[0] == pykvalloc.kvcache.BlockStored(
        block_hashes=tuple(keys[:3]), parent_block_hash=None, token_ids=(), block_size=BT,
        lora_id=None, medium="CPU", block_ids=(0, 1, 2), namespace=0, first_token=0)
    assert events[1].block_hashes == tuple(keys[3:6])
    assert events[1].parent_block_hash == keys[1] and events[1].first_token == 2 * BT
    # Released last block first: b's tail (keys 6, 5) is the least recently used.
    assert [e.block_hashes for e in events[2:4]] == [(keys[5],), (keys[4],)]
    assert all(isinstance(e, pykvalloc.kvcache.BlockRemoved) for e in events[2:4])
    assert isinstance(events[4], pykvalloc.kvcache.AllBlocksCleared) and len(events) == 5
    # vLLM's default event form of a hash: its last 8 bytes, big-endian, unsigned.
    c = cache.allocate(BT, keys=[b"\x00" * 7 + b"\x05"])
    (stored,), _ = cache.take_events(hashes="int")
    assert stored.block_hashes == (5,)
    c.free()
    cache.close()


def test_a_small_ring_keeps_the_oldest_and_counts_the_rest() -> None:
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=BT, layers=1, kv_heads=1, head_dim=1,
                              dtype="uint8", events=3)
    seq = cache.allocate(5 * BT, block_keys=[1, 2, 3, 4, 5])  # 5 stored events: 2 dropped
    first, dropped = cache.take_event_records(2)
    assert len(first) == 2 and dropped == 2
    rest, dropped = cache.take_event_records()
    assert len(rest) == 1 and dropped == 0  # the third stayed for this take
    assert [int(r["first_token"]) for r in (*first, *rest)] == [0, BT, 2 * BT]
    assert len(cache.take_event_records()[0]) == 0
    seq.free()
    cache.close()


def mooncake() -> list[dict]:
    with TRACE.open() as lines:
        return [json.loads(line) for line in lines]


def next_turn_keys(trace: list[dict], count: int, block: int) -> list[list[int]]:
    """For each of the first count requests, the ids its next turn gives the blocks its
    decoding fills: the next turn is the first later request whose prompt starts with all of
    its full blocks and reaches past its output. The ids form a prefix tree (an id names its
    whole prefix), so a request's prefix of k blocks is found by its k-th id."""
    holders: dict[int, list[int]] = {}  # id -> the requests whose prompts hold it, in order
    for j, record in enumerate(trace):
        for block_id in record["hash_ids"]:
            holders.setdefault(block_id, []).append(j)
    keys = []
    for i, record in enumerate(trace[:count]):
        full = record["input_length"] // block
        end = (record["input_length"] + record["output_length"]) // block
        j = None
        if full and end > full:
            candidates = holders[record["hash_ids"][full - 1]]
            j = next((j for j in candidates[bisect.bisect_right(candidates, i):]
                      if trace[j]["input_length"] // block >= end), None)
        keys.append([] if j is None else trace[j]["hash_ids"][full:end])
    return keys


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} "
                    "(../shared beside the repository)")
@pytest.mark.parametrize("num_blocks", [None, 3000])
def test_mooncake_conversations_hit_their_decoded_blocks(num_blocks: int | None) -> None:
    # 512 tokens a block, as the trace's hash ids. A request's prompt is keyed by the ids of its
    # full blocks; its decoding fills the blocks after them, keyed by the ids its next turn
    # gives them (next_turn_keys). Requests run in batches of 64: admitted together
    # (allocate_many), decoded together 64 tokens a step (one append_many, the keys of the
    # blocks each fills), freed as they finish (free_many).
    block, count, step = 512, 2000, 64
    trace = mooncake()
    decode_keys = next_turn_keys(trace, count, block)
    capacity = num_blocks or sum(-(-(r["input_length"] + r["output_length"]) // block)
                                 for r in trace[:count])
    cache = pykvalloc.KVCache(num_blocks=capacity, block_tokens=block, layers=1, kv_heads=1,
                              head_dim=1, dtype="uint8")
    model = KVModel(capacity, block)
    decoded_hits = 0
    for start in range(0, count, 64):
        batch = range(start, min(start + 64, count))
        keys = [trace[i]["hash_ids"][:trace[i]["input_length"] // block] for i in batch]
        content, offsets = flat("key", keys)
        admitted = cache.allocate_many([trace[i]["input_length"] for i in batch],
                                       block_keys=content, offsets=offsets)
        assert admitted.done == len(batch)
        left = {}
        for n, i in enumerate(batch):
            handle = int(admitted.handles[n])
            seq = model.admit(handle, trace[i]["input_length"], "key", keys[n], 0, 0)
            assert int(admitted.cached_tokens[n]) == seq.cached_tokens
            names = model.prefixes(model.contents(block_keys=keys[n]), 0)
            decoded_hits += sum(name in model.decoded for name in names[:seq.cached_tokens // block])
            left[handle] = (i, trace[i]["output_length"])
        while left:
            running = list(left)
            grow, given = [], []
            for h in running:
                i, remaining = left[h]
                n = min(remaining, step)
                tokens = model.seqs[h].tokens
                first = tokens // block - trace[i]["input_length"] // block
                fills = (tokens + n) // block - tokens // block
                ids = decode_keys[i][first:first + fills]
                ids = ids if len(ids) == fills else []  # none known: the chain ends
                model.extend(h, n, "key" if ids else None, ids)
                grow.append(n)
                given.append(ids)
                left[h] = (i, remaining - n)
            content, offsets = flat("key", given)
            result = cache.append_many(running, np.array(grow, dtype=np.uint32),
                                       block_keys=content, offsets=offsets)
            assert result.done == len(running) and not len(result.copies)
            finished = [h for h in running if left[h][1] <= 0]
            if finished:
                cache.free_many(finished)
                for h in finished:
                    model.free_seq(h)
                    del left[h]
        stats = cache.stats()
        assert (stats.hit_tokens, stats.evictions, stats.registered_blocks) == (
            model.hit_tokens, model.evictions, len(model.registry)), start
        cache.check()
    assert decoded_hits > 0  # later turns hit blocks that decoding filled
    if num_blocks is None:
        assert cache.stats().evictions == 0
    cache.close()


def test_what_the_engine_calls_return_is_exported() -> None:
    # The types an engine names in its own annotations come from the package itself.
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=4, layers=1, kv_heads=1, head_dim=1,
                              dtype="int8", max_key_bytes=KEY_LEN, events=64)
    keys = np.frombuffer(engine_key(b"", 7), dtype=np.uint8).reshape(1, KEY_LEN)
    admitted = cache.allocate_many([4], keys=keys)
    assert type(admitted) is pykvalloc.Admitted
    assert type(cache.append_many(admitted.handles, 1)) is pykvalloc.Extended
    assert type(cache.lookup(keys)) is pykvalloc.Lookup
    assert type(cache.lookup_many(keys=keys, offsets=[0, 1])) is pykvalloc.LookupMany
    assert type(cache.blocks) is pykvalloc.Blocks
    cache.free_many(admitted.handles)
    cache.reset_prefix_cache()
    events = cache.take_events()
    assert type(events) is pykvalloc.KVEvents
    assert [type(e) for e in events.events] == [pykvalloc.BlockStored, pykvalloc.AllBlocksCleared]
    assert {"Blocks", "KVEvents", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Lookup",
            "LookupMany", "Admitted", "Extended", "KVEvent"} <= set(pykvalloc.__all__)


@pytest.mark.parametrize("kind", ["tokens", "bytes"])
def test_a_long_prompt_is_committed_as_one_chain(kind: str) -> None:
    # Admission commits a prompt's new blocks 32 at a time: 70 new blocks after a 5-block hit
    # run across three rounds that do not start at block 0, and must still be one chain, each
    # block under its own key and parent, that lookups, the next turn and the events all see.
    bt = 4
    cache = pykvalloc.KVCache(num_blocks=256, block_tokens=bt, layers=1, kv_heads=1, head_dim=1,
                              dtype="int8", max_key_bytes=KEY_LEN, events=1024)
    tokens = list(range(1, 77 * bt + 1))
    keys = np.frombuffer(b"".join(engine_key(b"", i) for i in range(77)),
                         dtype=np.uint8).reshape(77, KEY_LEN)

    def content(blocks: int, extra: int = 0) -> dict:
        return ({"tokens": tokens[:blocks * bt + extra]} if kind == "tokens"
                else {"keys": keys[:blocks]})

    cache.allocate(5 * bt, **content(5)).free()
    cache.take_events()
    seq = cache.allocate(75 * bt + 2, **content(75, 2))
    assert seq.num_cached_tokens == 5 * bt
    cache.check()
    assert cache.lookup(**content(75)).hits == 75
    stored = [e for e in cache.take_events().events if isinstance(e, pykvalloc.BlockStored)]
    assert [(e.first_token, len(e.block_hashes)) for e in stored] == [(5 * bt, 70)]
    assert list(stored[0].block_ids) == list(seq.block_table[5:75])
    if kind == "bytes":
        assert stored[0].parent_block_hash == keys[4].tobytes()
        assert [bytes(h) for h in stored[0].block_hashes] == [k.tobytes() for k in keys[5:75]]
    # The next block chains on the last round's last block.
    seq.append(2, **({"tokens": tokens[75 * bt + 2:76 * bt]} if kind == "tokens"
                     else {"keys": keys[75:76]}))
    assert cache.lookup(**content(76)).hits == 76
    cache.check()


def test_an_admission_by_key_array_is_checked_as_any_other(monkeypatch) -> None:
    # allocate(n, keys=array) takes a path of its own in the wrapper (nothing converted, one C
    # call): it must refuse what the general path refuses, with nothing changed.
    taken = watch_own_path(monkeypatch, "_admit_keyed")
    cache = pykvalloc.KVCache(num_blocks=8, block_tokens=4, layers=1, kv_heads=1, head_dim=1,
                              dtype="int8", max_key_bytes=KEY_LEN)
    keys = np.frombuffer(b"".join(engine_key(b"", i) for i in range(3)),
                         dtype=np.uint8).reshape(3, KEY_LEN)
    before = cache.stats()
    with pytest.raises(pykvalloc.InvalidArgument, match="key_len"):
        cache.allocate(12, keys=np.zeros((3, KEY_LEN + 1), dtype=np.uint8))
    with pytest.raises(pykvalloc.InvalidArgument, match="priority"):
        cache.allocate(12, keys=keys, priority=9)
    # Every bit of a 32-bit argument reaches C (ctypes converts none of them on this path).
    for priority in (1 << 31, (1 << 32) - 1):
        with pytest.raises(pykvalloc.InvalidArgument, match=f"priority {priority} "):
            cache.allocate(12, keys=keys, priority=priority)
    with pytest.raises(pykvalloc.OutOfMemory, match=f"{((1 << 32) - 1) // 4 + 1} new blocks"):
        cache.allocate((1 << 32) - 1, keys=keys)
    with pytest.raises(pykvalloc.InvalidArgument, match="block keys"):
        cache.allocate(4, keys=keys)  # three keys for one block
    with pytest.raises(pykvalloc.OutOfMemory):
        cache.allocate(40, keys=keys)
    assert taken == ["refused"] * 7
    after = cache.stats()
    assert (after.free_blocks, after.registered_blocks, after.sequences) == \
        (before.free_blocks, before.registered_blocks, before.sequences)
    with pytest.raises(pykvalloc.InvalidArgument):  # not an int: the general path says so
        cache.allocate(12.0, keys=keys)  # type: ignore[arg-type]
    assert taken == ["refused"] * 7
    seq = cache.allocate(13, keys=keys, namespace=(1 << 64) - 1, priority=7)
    assert taken[-1] is True and seq.num_tokens == 13 and seq.num_cached_tokens == 0
    assert cache.lookup(keys, namespace=(1 << 64) - 1).hits == 3
    again = cache.allocate(13, keys=keys, namespace=(1 << 64) - 1)
    assert again.num_cached_tokens == 12
    cache.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.allocate(4, keys=keys[:1])
