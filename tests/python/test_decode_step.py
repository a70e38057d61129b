"""KVCache.decode_step: the engine's decode step written into buffers the cache reads in place.
Two caches take the same random stream, one through append_many and one through a DecodeStep,
and must agree call by call; bad input is refused with nothing changed."""

from __future__ import annotations

import hashlib
import random
import threading

import numpy as np
import pytest

import pykvalloc

BT = 4
KEY_LEN = 20


def make_cache() -> pykvalloc.KVCache:
    return pykvalloc.KVCache(num_blocks=96, block_tokens=BT, layers=1, kv_heads=1, head_dim=1,
                             dtype="int8", max_key_bytes=32)


def key(seed: int) -> bytes:
    return hashlib.sha256(seed.to_bytes(8, "little")).digest()[:KEY_LEN]


def rows(keys: list[bytes]) -> np.ndarray:
    if not keys:
        return np.zeros((0, KEY_LEN), dtype=np.uint8)
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), KEY_LEN)


@pytest.mark.parametrize("seed", range(6))
def test_a_step_through_the_buffers_does_what_append_many_does(seed: int) -> None:
    rng = random.Random(seed)
    plain, stepped = make_cache(), make_cache()
    step = stepped.decode_step(8, content="keys", content_capacity=64, key_len=KEY_LEN)
    live: list[tuple[pykvalloc.Sequence, pykvalloc.Sequence]] = []
    counter = 0
    copies_seen = 0
    for _ in range(300):
        if len(live) < 6 and rng.random() < 0.3:  # a new request, or a fork of a running one
            if live and rng.random() < 0.4:
                a, b = rng.choice(live)
                live.append((a.fork(), b.fork()))
            else:
                blocks = rng.randint(0, 3)
                prompt = rows([key(rng.randrange(8)) for _ in range(blocks)])
                tokens = blocks * BT + rng.randint(1, BT - 1)
                try:
                    a = plain.allocate(tokens, keys=prompt)
                except pykvalloc.OutOfMemory:
                    with pytest.raises(pykvalloc.OutOfMemory):
                        stepped.allocate(tokens, keys=prompt)
                    continue
                live.append((a, stepped.allocate(tokens, keys=prompt)))
                assert a.num_cached_tokens == live[-1][1].num_cached_tokens
            continue
        if not live:
            continue
        chosen = rng.sample(range(len(live)), rng.randint(1, len(live)))
        counts = [rng.randint(0, 6) for _ in chosen]
        filled: list[list[bytes]] = []
        for i, n in zip(chosen, counts):
            length = live[i][0].num_tokens
            fills = (length + n) // BT - length // BT
            filled.append([key(1000 + (counter := counter + 1)) for _ in range(fills)])
        offsets = np.zeros(len(chosen) + 1, dtype=np.uint64)
        offsets[1:] = np.cumsum([len(f) for f in filled])
        content = rows([k for f in filled for k in f])
        expected = plain.append_many(np.array([live[i][0].handle for i in chosen], dtype=np.uint64),
                                     np.array(counts, dtype=np.uint32), keys=content,
                                     offsets=offsets)
        n = len(chosen)
        step.handles[:n] = [live[i][1].handle for i in chosen]
        step.num_tokens[:n] = counts
        step.offsets[:n + 1] = offsets
        step.keys[:len(content)] = content
        assert step.run(n) == expected.done
        assert step.copies.tolist() == expected.copies.tolist()
        copies_seen += len(expected.copies)
        for i in chosen:
            a, b = live[i]
            assert a.num_tokens == b.num_tokens
            assert list(a.block_table) == list(b.block_table)
        for i in sorted(chosen[expected.done:], reverse=True):  # did not fit: preempted
            a, b = live.pop(i)
            a.free()
            b.free()
        if rng.random() < 0.2:
            a, b = live.pop(rng.randrange(len(live)))
            a.free()
            b.free()
    sa, sb = plain.stats(), stepped.stats()
    assert (sa.free_blocks, sa.cached_blocks, sa.used_blocks, sa.hit_tokens) == \
        (sb.free_blocks, sb.cached_blocks, sb.used_blocks, sb.hit_tokens)
    everything = rows([key(1000 + c) for c in range(1, counter + 1)])
    for r in range(len(everything)):
        assert plain.lookup(everything[r:r + 1]).hits == stepped.lookup(everything[r:r + 1]).hits
    assert copies_seen or seed  # the forks made copies on write in at least one stream


def test_a_step_is_refused_with_nothing_changed() -> None:
    cache = make_cache()
    step = cache.decode_step(2, content="keys", content_capacity=1, key_len=KEY_LEN)
    seq = cache.allocate(BT - 1, keys=rows([]))
    step.handles[0] = seq.handle
    step.offsets[:2] = [0, 1]
    step.keys[0] = np.frombuffer(key(1), dtype=np.uint8)
    with pytest.raises(pykvalloc.InvalidArgument, match="capacity"):
        step.run(3)
    step.offsets[:2] = [0, 2]
    with pytest.raises(pykvalloc.InvalidArgument, match="beyond"):
        step.run(1)
    step.offsets[:2] = [1, 1]  # offsets must start at 0: the library's check
    with pytest.raises(pykvalloc.InvalidArgument):
        step.run(1)
    step.offsets[:2] = [0, 0]  # the request fills a block but is given no key for it: it stops
    step.handles[1] = seq.handle  # keeping its chain, which is allowed; listing it twice is not
    with pytest.raises(pykvalloc.InvalidArgument, match="twice"):
        step.run(2)
    step.handles[1] = seq.handle ^ 1  # no sequence of this cache
    with pytest.raises(pykvalloc.InvalidArgument):
        step.run(2)
    assert seq.num_tokens == BT - 1
    step.offsets[:2] = [0, 1]
    table = seq.block_table  # a view of the tables: a step would move them
    with pytest.raises(pykvalloc.TableInUseError):
        step.run(1)
    del table
    assert step.run(1) == 1 and seq.num_tokens == BT
    assert cache.lookup(rows([key(1)])).hits == 1
    assert step.run(0) == 0
    cache.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        step.run(1)


def test_the_buffers_stay_where_the_library_reads_them() -> None:
    # The library keeps each buffer's address: an array the engine could swap or resize would
    # leave it reading freed memory.
    cache = make_cache()
    step = cache.decode_step(4, content="keys", key_len=KEY_LEN)
    for name in ("handles", "num_tokens", "offsets", "keys"):
        with pytest.raises(AttributeError):
            setattr(step, name, np.zeros(4, dtype=np.uint64))
        with pytest.raises(ValueError):
            getattr(step, name).resize(1000)
    seq = cache.allocate(1, keys=rows([]))
    step.handles[0] = seq.handle
    step.num_tokens[0] = 2
    for bad in (1.0, "1", None, True, -1, 5):
        with pytest.raises(pykvalloc.InvalidArgument, match="count"):
            step.run(bad)  # type: ignore[arg-type]
    assert seq.num_tokens == 1
    assert step.run(np.int64(1)) == 1 and seq.num_tokens == 3


def test_a_refused_step_leaves_no_copies_behind() -> None:
    cache = make_cache()
    step = cache.decode_step(2)
    parent = cache.allocate(BT + 1, keys=rows([key(1)]))
    child = parent.fork()  # shares the partial last block: the next append copies it
    step.handles[0] = child.handle
    assert step.run(1) == 1 and step.copies.shape == (1, 4)
    step.handles[1] = child.handle
    with pytest.raises(pykvalloc.InvalidArgument, match="twice"):
        step.run(2)
    assert step.copies.shape == (0, 4)


def test_the_content_of_a_step_is_of_one_kind() -> None:
    cache = make_cache()
    tokens = cache.decode_step(4, content="tokens", content_capacity=16)
    assert tokens.tokens.shape == (16,) and tokens.tokens.dtype == np.uint32
    with pytest.raises(AttributeError):
        tokens.keys
    seq = cache.allocate(2, tokens=[1, 2])
    tokens.handles[0] = seq.handle
    tokens.num_tokens[0] = 2
    tokens.offsets[:2] = [0, 2]
    tokens.tokens[:2] = [3, 4]
    assert tokens.run(1) == 1
    assert cache.lookup(tokens=[1, 2, 3, 4]).hits == 1  # the block it filled, committed
    none = cache.decode_step(1)
    none.handles[0] = seq.handle
    assert none.run(1) == 1 and seq.num_tokens == 5
    assert none.copies.shape == (0, 4)
    for bad in ({"capacity": 0}, {"capacity": 1.5}, {"capacity": 1, "content": "blocks"},
                {"capacity": 1, "content": "keys", "key_len": 33},
                {"capacity": 1, "content": "tokens", "key_len": 4},
                {"capacity": 1, "content": "tokens", "content_capacity": 0}):
        with pytest.raises(pykvalloc.InvalidArgument):
            cache.decode_step(**bad)
    plain = pykvalloc.KVCache(num_blocks=8, block_tokens=BT, layers=1, kv_heads=1, head_dim=1,
                              dtype="int8")
    with pytest.raises(pykvalloc.InvalidArgument, match="max_key_bytes"):
        plain.decode_step(1, content="keys")


def test_a_step_over_a_callers_pool_waits_for_its_lock_as_append_many_does() -> None:
    pool = pykvalloc.Pool(64 << 20, pages="small")
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=BT, layers=1, kv_heads=1, head_dim=8,
                              pool=pool)
    step = cache.decode_step(1)
    seq = cache.allocate(1)
    step.handles[0] = seq.handle
    done = threading.Event()

    def run() -> None:
        step.run(1)
        done.set()

    with pool._lock:  # another call into the pool is under way
        runner = threading.Thread(target=run)
        runner.start()
        assert not done.wait(0.5)  # the step waits for the pool's lock (never sooner)
    runner.join(60)
    assert done.is_set(), "hung"
    assert seq.num_tokens == 2
    seq.free()
    cache.close()
    pool.close()
