"""pykvalloc's vLLM offloading manager against vLLM's own CPUOffloadingManager (LRU), op by op
on seeded random streams: every lookup result, whether prepare_store returns None, the keys it
stores, the keys it evicts in order, and the events (removed, medium, metadata_only, keys).

One request at a time, the two agree exactly. With requests interleaved, vLLM's LRU ranks a
running request's chunks provisionally (all of a request share the rank it got first), where
the manager's recency is release order: the named cases at the end pin down where the two
differ and why, and check that the difference is only that."""

from __future__ import annotations

import hashlib
import random

import pytest

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from pykvalloc.integrations.vllm import KvallocOffloadingManager

CHUNK_TOKENS = 16


def chain(seeds: list[int], group: int = 0) -> list[bytes]:
    keys, digest = [], b""
    for seed in seeds:
        digest = hashlib.sha256(digest + seed.to_bytes(8, "little")).digest()
        keys.append(make_offload_key(digest, group))
    return keys


def events(manager) -> list[tuple]:
    return [(e.removed, e.medium.value, e.metadata_only, tuple(sorted(e.keys)))
            for e in manager.take_events()]


class Pair:
    """vLLM's manager and ours, driven with the same calls; every result compared."""

    def __init__(self, num_chunks: int) -> None:
        self.vllm = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru",
                                         enable_events=True)
        self.ours = KvallocOffloadingManager(num_chunks=num_chunks, enable_events=True)
        self.calls = 0

    def contexts(self, name: str, keys: list[bytes]) -> tuple[ReqContext, ReqContext]:
        pair = (ReqContext(req_id=name), ReqContext(req_id=name))
        for ctx in pair:
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
        self.same("on_new_request", pair, lambda m, c: type(m.on_new_request(c)).__name__)
        return pair

    def same(self, what: str, contexts, call):
        self.calls += 1
        theirs = call(self.vllm, contexts[0])
        mine = call(self.ours, contexts[1])
        assert mine == theirs, f"call {self.calls} {what}: vLLM {theirs!r}, pykvalloc {mine!r}"
        assert events(self.ours) == events(self.vllm), f"call {self.calls} {what}: events"
        return theirs


def store_result(output):
    return None if output is None else (list(output.keys_to_store), list(output.evicted_keys))


def run_request(pair: Pair, rng: random.Random, name: str, keys: list[bytes]) -> None:
    ctx = pair.contexts(name, keys)
    hits = []
    for key in keys:  # the connector's maximal prefix lookup
        result = pair.same("lookup", ctx, lambda m, c, k=key: m.lookup(k, c))
        if result != LookupResult.HIT:
            break
        hits.append(key)
    if hits:
        pair.same("prepare_load", ctx, lambda m, c: len(m.prepare_load(hits, c).block_ids))
        if rng.random() < 0.3:
            pair.same("complete_load", ctx, lambda m, c: m.complete_load(hits, c))
            touched = rng.sample(hits, rng.randint(1, len(hits)))
            pair.same("touch", ctx, lambda m, c: m.touch(touched, c))
        else:
            pair.same("complete_load", ctx, lambda m, c: m.complete_load(hits, c))
    rest = keys[len(hits):]
    while rest:  # chunked prefill: stores in pieces, each completed before the next
        piece = rest[:rng.randint(1, len(rest))]
        offered = piece if rng.random() < 0.8 else keys[:len(keys) - len(rest)][-1:] + piece
        result = pair.same("prepare_store", ctx, lambda m, c: store_result(m.prepare_store(offered, c)))
        if result is None:
            break
        stored = result[0]
        if stored:
            pair.same("lookup pending", ctx, lambda m, c: m.lookup(stored[0], c))
        ok = rng.random() < 0.9
        pair.same("complete_store", ctx, lambda m, c: m.complete_store(stored, c, success=ok))
        rest = rest[len(piece):]
    pair.same("on_request_finished", ctx, lambda m, c: m.on_request_finished(c))


@pytest.mark.parametrize("seed, num_chunks", [(1, 6), (2, 12), (3, 40)])
def test_one_request_at_a_time_matches_vllm_exactly(seed: int, num_chunks: int) -> None:
    rng = random.Random(seed)
    families = [[rng.randrange(1 << 40) for _ in range(12)] for _ in range(5)]
    pair = Pair(num_chunks)
    for i in range(600):
        family = rng.choice(families)
        seeds = family[:rng.randint(0, len(family))] + [rng.randrange(1 << 40) for _ in range(
            rng.randint(0, 3))]
        if not seeds:
            continue
        run_request(pair, rng, f"r{i}", chain(seeds, group=rng.choice((0, 0, 1))))
        if rng.random() < 0.01:
            pair.same("reset_cache", (None, None), lambda m, c: m.reset_cache())
    assert pair.calls > 3000


def named_case(num_chunks: int):
    """Both managers and a way to run one call on both, returning (vLLM's, ours)."""
    vllm = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru", enable_events=True)
    ours = KvallocOffloadingManager(num_chunks=num_chunks, enable_events=True)

    def request(keys: list[bytes]) -> tuple[ReqContext, ReqContext]:
        contexts = (ReqContext(req_id="x"), ReqContext(req_id="x"))
        for ctx in contexts:
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
        vllm.on_new_request(contexts[0])
        ours.on_new_request(contexts[1])
        return contexts

    def both(call, contexts):
        return call(vllm, contexts[0]), call(ours, contexts[1])

    def store(keys, contexts):
        out = both(lambda m, c: store_result(m.prepare_store(keys, c)), contexts)
        both(lambda m, c: m.complete_store(keys, c), contexts)
        return out

    return vllm, ours, request, both, store


def test_divergence_interleaved_requests_rank_a_running_request_by_its_start() -> None:
    # vLLM's LRU gives all of a running request's chunks the rank the request got first (its
    # tail evicted first within it), so a chunk A stores after B's stays older than B's. The
    # manager's recency is release order: A's late chunk, and A's whole prefix released again
    # tail first with it, are newer than B's. Next eviction: vLLM takes A's last chunk, the
    # manager B's. Everything before agrees.
    vllm, ours, request, both, store = named_case(4)
    a1, a2, a3, b1, c1 = chain([1, 2, 3]) + chain([4]) + chain([5])
    a = request([a1, a2, a3])
    b = request([b1])
    assert store([a1, a2], a) == (([a1, a2], []), ([a1, a2], []))
    assert store([b1], b) == (([b1], []), ([b1], []))
    assert store([a3], a) == (([a3], []), ([a3], []))
    assert events(vllm) == events(ours)
    c = request([c1])
    theirs, mine = store([c1], c)
    assert theirs == ([c1], [a3]) and mine == ([c1], [b1])
    # Once both requests finish (each released whole, head newest), the orders agree again.
    for ctx in (a, b, c):
        both(lambda m, x: m.on_request_finished(x), ctx)


def test_divergence_touching_a_pinned_chunk() -> None:
    # vLLM re-ranks a touched chunk even while a load pins it, and the chunk keeps that rank
    # when the load completes; here a pinned chunk is out of the LRU, and it is as recent as
    # the completion that releases it. Touching k3 (pinned) then k2 leaves vLLM with k3 older
    # than k2; the manager has k2 older than k3.
    vllm, ours, request, both, store = named_case(3)
    k1, k2, k3, n1, n2 = chain([1, 2, 3]) + chain([7, 8])
    x = request([k1, k2, k3])
    assert store([k1, k2, k3], x) == (([k1, k2, k3], []),) * 2
    both(lambda m, c: m.on_request_finished(c), x)
    y = request([k3])
    both(lambda m, c: m.prepare_load([k3], c), y)
    both(lambda m, c: m.touch([k3], c), y)
    both(lambda m, c: m.touch([k2], c), y)
    both(lambda m, c: m.complete_load([k3], c), y)
    theirs, mine = both(lambda m, c: store_result(m.prepare_store([n1, n2], c)), y)
    assert theirs == ([n1, n2], [k1, k3]) and mine == ([n1, n2], [k1, k2])

