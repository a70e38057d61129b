"""KVCache.compact(): the blocks that hold data move to the lowest ids, the engine applies the
moves to the real KV memory (here host memory, through a numpy view), and afterwards every
sequence, pin and cached prefix still finds its own KV; the free blocks are the top ids."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import pykvalloc

NUM_BLOCKS = 64
BLOCK_TOKENS = 4


def make(**kw) -> pykvalloc.KVCache:
    kw.setdefault("layout", "layers")
    return pykvalloc.KVCache(num_blocks=NUM_BLOCKS, block_tokens=BLOCK_TOKENS, layers=2, kv_heads=1,
                             head_dim=4, dtype="uint8", pages="small", **kw)


def kv_memory(cache: pykvalloc.KVCache) -> np.ndarray:
    """The KV memory as [layer][block][K|V bytes] u32 words (layers layout)."""
    info = cache.info
    raw = (ctypes.c_uint8 * info.kv_bytes).from_address(info.base)
    words = np.frombuffer(raw, dtype=np.uint32)
    return words.reshape(info.layers, info.num_blocks, -1)


def tags(memory: np.ndarray, seq: pykvalloc.Sequence) -> list[int]:
    table = np.array(seq.block_table)
    return memory[1, table, -1].tolist()  # the last word of the last layer's V: any word would do


def request(family: int, own: int, blocks: int) -> list[int]:
    return [1000 * family + j if j < 2 else 100_000 * own + j for j in range(blocks)]


def fragmented(cache: pykvalloc.KVCache, memory: np.ndarray):
    """Sequences with shared prefixes, forks with copies on write, a pin; every other request
    freed (its keyed blocks cached, its partial ones free) and the oldest cached ones evicted.
    Each block's KV is tagged with a value of its own as it is taken, as a prefill would."""
    counter = iter(range(7_000_000, 8_000_000))

    def prefill(seq: pykvalloc.Sequence, start: int) -> None:
        for b in np.array(seq.block_table)[start:].tolist():
            memory[:, b, :] = next(counter)

    seqs = []
    for i in range(16):
        keys = request(i % 4, i, 2 + i % 4)
        seq = cache.allocate(len(keys) * BLOCK_TOKENS + i % 3, block_keys=keys, priority=i % 3)
        prefill(seq, seq.num_cached_tokens // BLOCK_TOKENS)
        seqs.append((seq, keys))
    forks = []
    for parent in (3, 5):
        child = seqs[parent][0].fork()
        old_len = child.num_blocks
        copy = child.append(1 + 2 * parent)
        if copy is not None:  # the engine's copy on write
            memory[:, copy.dst, :] = memory[:, copy.src, :]
        prefill(child, old_len)
        forks.append(child)
    for seq, _ in seqs[::2]:
        seq.free()
    assert cache.evict(6) == 6
    pin = cache.pin(block_keys=request(1, 1, 2))
    assert pin.num_tokens == 2 * BLOCK_TOKENS
    live = [s for s, _ in seqs[1::2]] + forks + [pin]
    freed_keys = [k for _, k in seqs[::2]]
    return live, freed_keys


@pytest.mark.parametrize("layout", ["layers", "blocks"])
def test_compact_moves_data_to_the_low_ids(layout: str) -> None:
    cache, twin = make(layout=layout), make(layout=layout)
    memory = kv_memory(cache) if layout == "layers" else None
    if memory is None:  # the blocks layout: [block][layer][K|V]; the same view, axes swapped
        info = cache.info
        raw = (ctypes.c_uint8 * info.kv_bytes).from_address(info.base)
        memory = np.frombuffer(raw, dtype=np.uint32).reshape(info.num_blocks, info.layers, -1)
        memory = memory.transpose(1, 0, 2)
    memory[...] = 0
    live, freed_keys = fragmented(cache, memory)
    twin_live, _ = fragmented(twin, np.zeros_like(memory))
    before = {s.handle: tags(memory, s) for s in live}
    stats = cache.stats()
    n = stats.used_blocks + stats.cached_blocks
    high = sorted({b for s in live for b in np.array(s.block_table).tolist() if b >= n})
    assert high and stats.cached_blocks

    moves = cache.compact()
    assert moves.dtype == np.uint32 and moves.shape[1] == 2 and len(moves) >= len(high)
    src, dst = moves[:, 0], moves[:, 1]
    assert (src >= n).all() and (dst < n).all()
    assert len(set(src.tolist())) == len(src) and len(set(dst.tolist())) == len(dst)
    assert set(high) <= set(src.tolist())
    memory[:, dst, :] = memory[:, src, :]  # all at once: no block is both src and dst
    cache.check()

    after = cache.stats()
    for name in ("free_blocks", "used_blocks", "cached_blocks", "registered_blocks"):
        assert getattr(after, name) == getattr(stats, name), name
    assert after.moves == len(moves) and after.moved_bytes == len(moves) * cache.block_bytes
    for s in live:
        assert tags(memory, s) == before[s.handle]
        assert (np.array(s.block_table) < n).all()
    assert len(cache.compact()) == 0  # nothing left to move

    # Prefix hits survive on the moved blocks: the same cached tokens as the twin that never
    # compacted, and the hit blocks hold the KV written before.
    for keys in freed_keys:
        a = cache.allocate(len(keys) * BLOCK_TOKENS, block_keys=keys)
        b = twin.allocate(len(keys) * BLOCK_TOKENS, block_keys=keys)
        assert a.num_cached_tokens == b.num_cached_tokens
        hits = a.num_cached_tokens // BLOCK_TOKENS
        assert all(t >= 7_000_000 for t in tags(memory, a)[:hits])
        live.append(a)
        twin_live.append(b)

    # The free blocks are the top ids: new blocks come from n up, in order.
    free = cache.stats().free_blocks
    first_free = NUM_BLOCKS - free
    if free:
        tail = cache.allocate(free * BLOCK_TOKENS)
        assert np.array(tail.block_table).tolist() == list(range(first_free, NUM_BLOCKS))
        tail.free()
    cache.check()
    for s in live:
        s.free()
    cache.check()
    cache.close()
    twin.close()


def test_a_live_view_refuses_compaction() -> None:
    cache = make()
    seqs = [cache.allocate(2 * BLOCK_TOKENS) for _ in range(6)]
    for s in seqs[::2]:
        s.free()
    view = seqs[3].block_table
    before = view.tolist()
    with pytest.raises(pykvalloc.TableInUseError):
        cache.compact()
    assert view.tolist() == before and cache.stats().moves == 0
    del view
    gc.collect()
    moves = cache.compact()
    assert len(moves) == 4
    assert np.array(seqs[3].block_table).tolist() == [0, 1]
    cache.check()
    cache.close()


def test_compact_needs_paged_mode_and_an_open_cache() -> None:
    cache = pykvalloc.KVCache(capacity_bytes=1 << 20, block_tokens=4, layers=2, kv_heads=1,
                              head_dim=4, dtype="uint8", mode="contiguous", pages="small")
    with pytest.raises(pykvalloc.InvalidArgument):
        cache.compact()
    cache.close()
    cache = make()
    assert cache.compact().shape == (0, 2)  # a fresh cache is compact
    cache.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        cache.compact()


def test_trim_after_compaction_and_blocks_come_back() -> None:
    cache = make()
    seqs = [cache.allocate(8 * BLOCK_TOKENS) for _ in range(8)]  # all 64 blocks
    assert cache.trim() == 0
    for s in seqs[::2]:
        s.free()
    assert cache.trim() == 0  # the top blocks still hold data
    cache.compact()
    assert cache.trim() == 32 and cache.stats().trimmed_blocks == 32
    assert cache.stats().free_blocks == 0
    cache.check()
    more = [cache.allocate(8 * BLOCK_TOKENS) for _ in range(4)]  # the trimmed blocks again
    assert cache.stats().trimmed_blocks == 0 and cache.stats().free_blocks == 0
    assert sorted(b for s in more for b in np.array(s.block_table).tolist()) == list(range(32, 64))
    cache.check()
    cache.close()
    contiguous = pykvalloc.KVCache(capacity_bytes=1 << 20, block_tokens=4, layers=2, kv_heads=1,
                                   head_dim=4, dtype="uint8", mode="contiguous", pages="small")
    with pytest.raises(pykvalloc.InvalidArgument):
        contiguous.trim()
    contiguous.close()
