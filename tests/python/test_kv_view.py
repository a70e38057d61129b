"""What a KV cache shows of itself beyond its block counts, from Python: pinned blocks,
re-admissions counted apart (``again``), each namespace's share (``KVCache.namespaces()``), and
the same figures in the statistics segment, read by another process than the engine's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from kv_model import KVModel, check_namespaces
from stats_writer import unique_name
from support import clean_env

import pykvalloc
from pykvalloc import stats

BT = 4


def small_cache(num_blocks: int = 256, **kwargs) -> pykvalloc.KVCache:
    return pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BT, layers=1, kv_heads=1,
                             head_dim=4, dtype="uint8", pages="small", **kwargs)


def test_namespaces_past_the_slots_share_one_row_and_match_the_model() -> None:
    model = KVModel(256, BT)
    with small_cache() as cache:
        seqs = []
        for i in range(40):
            keys = [1000 + i, 2000 + i]
            model.allocate(-1, 10, model.contents(block_keys=keys), 100 + i, 0)
            seq = cache.allocate(10, block_keys=keys, namespace=100 + i)
            model.seqs[seq.handle] = model.seqs.pop(-1)
            seqs.append(seq)
        rows = cache.namespaces()
        assert len(rows) == pykvalloc.kvcache.NAMESPACE_SLOTS + 1
        # In slot order: namespace 0's slot, empty, went to the 32nd namespace.
        assert [row.namespace for row in rows[:32]] == [131, *range(100, 131)]
        assert rows[-1] == pykvalloc.NamespaceShare(None, 8, 0, 24, 16)
        check_namespaces(rows, model.namespace_totals())
        pin = cache.pin(block_keys=[1000, 2000], namespace=100)
        model.pin(pin.handle, model.contents(block_keys=[1000, 2000]), 100)
        assert cache.namespaces()[1] == pykvalloc.NamespaceShare(100, 1, 1, 5, 2)
        check_namespaces(cache.namespaces(), model.namespace_totals())
        assert cache.stats().pinned_blocks == model.stats()["pinned_blocks"] == 2
        pin.unpin()
        for seq in seqs:
            seq.free()
        cache.reset_prefix_cache()
        assert cache.namespaces() == []
        cache.check()


def test_readmissions_are_counted_apart() -> None:
    with small_cache() as cache:
        first = cache.allocate(16, block_keys=[1, 2, 3, 4], priority=2)
        first.free()
        again = cache.allocate(18, block_keys=[1, 2, 3, 4], priority=2, again=True)
        assert again.num_cached_tokens == 16 and again.priority == 2
        s = cache.stats()
        assert (s.readmit_hit_tokens, s.readmit_query_tokens) == (16, 18)
        assert (s.hit_tokens, s.query_tokens) == (16, 34)
        assert s.readmission_hit_rate == 16 / 18 and s.first_admission_hit_rate == 0.0
        # allocate_many: one bool for all, or one a request; the caller's arrays are not written.
        priorities = np.array([1, 3], dtype=np.uint8)
        done = cache.allocate_many([8, 8], block_keys=[1, 2, 1, 9], priorities=priorities,
                                   again=np.array([False, True]))
        assert done.done == 2 and priorities.tolist() == [1, 3]
        assert cache.stats().readmit_query_tokens == 18 + 8
        cache.allocate_many([4], again=True)
        assert cache.stats().readmit_query_tokens == 18 + 8 + 4
        cache.allocate_many([4, 4], again=[True, False])
        assert cache.stats().readmit_query_tokens == 18 + 8 + 4 + 4


@pytest.mark.parametrize("call", [
    lambda c: c.allocate(4, again=1),
    lambda c: c.allocate(4, again="yes"),
    lambda c: c.allocate_many([4, 4], again=[True]),
    lambda c: c.allocate_many([4, 4], again=[1, 0]),
    lambda c: c.allocate_many([4, 4], again=np.ones((2, 1), dtype=bool)),
    lambda c: c.allocate_many([4], again=None),
    lambda c: c.allocate(4, priority=0x40, again=True),
    lambda c: c.allocate_many([4], priorities=[0x40]),
])
def test_a_bad_again_changes_nothing(call) -> None:
    with small_cache() as cache:
        cache.allocate(8, block_keys=[5, 6])
        before = (cache.stats().readmit_query_tokens, cache.stats().sequences, cache.namespaces())
        with pytest.raises(pykvalloc.InvalidArgument):
            call(cache)
        assert (cache.stats().readmit_query_tokens, cache.stats().sequences,
                cache.namespaces()) == before
        cache.check()


ENGINE = r"""
import dataclasses, json, sys
import pykvalloc

name = sys.argv[1]
cache = pykvalloc.KVCache(num_blocks=2048, block_tokens=4, layers=1, kv_heads=1, head_dim=4,
                          dtype="uint8", pages="small", name=name)
held = []
for i in range(40):
    held.append(cache.allocate(4 * (i + 1) + 1, block_keys=list(range(i + 1)), namespace=i % 36))
held.append(cache.pin(block_keys=[0, 1, 2], namespace=2))
held.append(cache.allocate(4 * 140, namespace=1))  # a table longer than an entry holds
first = cache.allocate(8, block_keys=[0, 1])
first.free()
held.append(cache.allocate(9, block_keys=[0, 1], again=True))
cache.publish()
s = cache.stats()
print(json.dumps({
    "namespaces": [dataclasses.asdict(row) for row in cache.namespaces()],
    "stats": {k: getattr(s, k) for k in ("pinned_blocks", "readmit_hit_tokens",
                                          "readmit_query_tokens", "sequences", "pins")},
    "tables": {str(seq.handle): seq.block_table.tolist() for seq in held},
    "tokens": {str(seq.handle): seq.num_tokens for seq in held},
}), flush=True)
sys.stdin.read()
"""


def test_another_process_reads_the_same_figures_the_engine_has() -> None:
    name = unique_name("kvview")
    process = subprocess.Popen([sys.executable, "-c", ENGINE, name], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, "the engine died"
        engine = json.loads(line)
        with stats.open_segment(name) as segment:
            snap = segment.snapshot()
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=60)
        process.stdout.close()  # type: ignore[union-attr]
    assert snap.kv is not None and snap.abi == (1, stats.ABI_MINOR)
    for field, value in engine["stats"].items():
        if field in stats.KV_ADDED_1_5:
            assert int(snap.kv[field]) == value, field
    assert engine["stats"]["readmit_query_tokens"] == 9
    assert snap.hit_rates is not None and snap.hit_rates[1] == 8 / 9
    assert [row.to_dict() for row in snap.kv_namespaces] == engine["namespaces"]
    assert snap.kv_namespaces[-1].namespace is None  # 36 namespaces: 4 pooled
    sequences = snap.kv_sequences
    assert sequences is not None
    assert (sequences.live, sequences.pins) == (engine["stats"]["sequences"],
                                                engine["stats"]["pins"])
    longest = max(engine["tokens"].items(), key=lambda item: item[1])
    assert (sequences.longest_handle, sequences.longest_tokens) == (int(longest[0]), longest[1])
    assert len(sequences.entries) == 16
    tokens = [entry.num_tokens for entry in sequences.entries]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] == longest[1]
    assert tokens[-1] == sorted(engine["tokens"].values(), reverse=True)[15]
    assert not sequences.entries[0].table_complete and sequences.entries[0].blocks == 140
    for entry in sequences.entries:
        table = engine["tables"][str(entry.handle)]
        assert entry.blocks == len(table) and not entry.pin
        assert entry.table.tolist() == table[:stats.KV_SEQ_TABLE]
        assert entry.table_complete == (len(table) <= stats.KV_SEQ_TABLE)


KEY_BYTES = 8


@pytest.mark.parametrize("call", [
    lambda c, k: c.allocate(4, priority=0x80),
    lambda c, k: c.allocate(4, priority=0x85),
    lambda c, k: c.allocate(4, priority=0x85, again=True),
    lambda c, k: c.allocate(8, keys=k, priority=0x80),
    lambda c, k: c.allocate(8, keys=k, priority=0x83, again=True),
    lambda c, k: c.allocate_many([4], priorities=[0x80]),
    lambda c, k: c.allocate_many([4, 4], priorities=np.array([1, 0x87], dtype=np.uint8)),
    lambda c, k: c.allocate_many([4, 4], priorities=[0x81, 0], again=True),
])
def test_the_readmission_bit_in_a_priority_is_refused_with_nothing_changed(call) -> None:
    # KVA_KV_AGAIN is C's way of saying again=True; the package's priorities are 0..7, so a
    # priority carrying bit 7 is refused as priority 9 is, not taken as a re-admission.
    keys = np.arange(2 * KEY_BYTES, dtype=np.uint8).reshape(2, KEY_BYTES)
    with small_cache(max_key_bytes=KEY_BYTES) as cache:
        cache.allocate(8, block_keys=[5, 6])
        before = (cache.stats().readmit_query_tokens, cache.stats().query_tokens,
                  cache.stats().sequences, cache.namespaces())
        with pytest.raises(pykvalloc.InvalidArgument, match=r"priority 1[23]\d "):
            call(cache, keys)
        assert (cache.stats().readmit_query_tokens, cache.stats().query_tokens,
                cache.stats().sequences, cache.namespaces()) == before
        cache.check()


def test_an_empty_step_takes_an_empty_list_of_again_marks() -> None:
    # A scheduler step with no admission passes its (empty) list of marks, as it passes an
    # empty list of priorities: nothing is admitted, nothing refused.
    with small_cache() as cache:
        for again in ([], (), np.array([], dtype=bool)):
            done = cache.allocate_many([], priorities=[], again=again)
            assert done.done == 0 and done.handles.size == 0
        with pytest.raises(pykvalloc.InvalidArgument):
            cache.allocate_many([4], again=[])
        assert cache.stats().sequences == 0


def test_long_pins_leave_the_list_to_the_sequences() -> None:
    # An engine pins a long system prompt per tenant: the published list is the sequences'
    # (longest first), and pins fill only the room they leave, however long the pins are.
    name = unique_name("kvpins")
    with pykvalloc.Pool(4 << 20, name=name, pages="small") as pool, \
            pykvalloc.KVCache(num_blocks=512, block_tokens=BT, layers=1, kv_heads=1, head_dim=4,
                              dtype="uint8", pool=pool) as cache:
        prompts = [list(range(1000 * t, 1000 * t + 20)) for t in range(18)]
        for keys in prompts:
            cache.allocate(len(keys) * BT, block_keys=keys).free()
        pins = [cache.pin(block_keys=keys) for keys in prompts]  # 18 pins of 80 tokens
        held = [cache.allocate(4 * (i + 1)) for i in range(3)]  # 3 sequences of 4 to 12
        cache.publish()
        with stats.open_segment(name) as segment:
            sequences = segment.snapshot().kv_sequences
        assert sequences is not None and (sequences.live, sequences.pins) == (3, 18)
        assert [e.pin for e in sequences.entries] == [False] * 3 + [True] * 13
        assert [e.handle for e in sequences.entries[:3]] == [s.handle for s in reversed(held)]
        assert (sequences.longest_tokens, sequences.longest_handle) == (12, held[-1].handle)
        assert {e.num_tokens for e in sequences.entries[3:]} == {80}
        for seq in held + pins:
            seq.free()
