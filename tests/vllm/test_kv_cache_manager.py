"""pykvalloc's KVCache against vLLM's own KVCacheManager (its GPU prefix cache), in lockstep on
one request stream, through the benchmark's own drivers (kvalloc_cli/bench_engines.py): prefills,
decode steps (vLLM's allocate_slots per request, pykvalloc's one append_many), frees. After
every call: the same hit tokens (vLLM's capped at num_tokens - 1, in whole blocks: it recomputes
a fully cached prompt's last token), the same free-or-evictable block count, the same
evictions in the same order, the same blocks stored (decode-filled ones included), whether a
call fits. pykvalloc gets the engine's keys; vLLM hashes its tokens its own way: the two keys
of a block are matched the first time they are seen and must stay matched.

Prompt lengths are never whole blocks, so the cap never binds: where it does (a prompt of whole
blocks, all cached), vLLM computes the last block again in a new block holding the same hash
(it keeps duplicates), where KVCache reuses the cached one; test_a_fully_cached_prompt shows that
difference and that it is the only one."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cli"))
from kvalloc_cli import bench_engines as bench  # noqa: E402

BLOCK = bench.BLOCK


def as_int(h) -> int:
    return h if isinstance(h, int) else int.from_bytes(h[-8:], "big")


class Matcher:
    """vLLM's hash of a block and pykvalloc's key of it: matched once, kept."""

    def __init__(self) -> None:
        self.ours: dict[int, int] = {}
        self.theirs: dict[int, int] = {}

    def same(self, theirs, ours, where: str) -> None:
        t, o = as_int(theirs), as_int(ours)
        assert self.ours.setdefault(t, o) == o, f"{where}: vLLM block {t:#x} was matched to another"
        assert self.theirs.setdefault(o, t) == t, f"{where}: pykvalloc key {o:#x} matched twice"


def flatten(events) -> tuple[list, list]:
    """(stored blocks as (hash, parent), removed hashes), in order."""
    stored, removed = [], []
    for event in events:
        kind = type(event).__name__
        if kind == "BlockStored":
            parent = event.parent_block_hash
            for h in event.block_hashes:
                stored.append((h, parent))
                parent = h
        elif kind == "BlockRemoved":
            removed.extend(event.block_hashes)
        else:
            removed.append("cleared")
    return stored, removed


class Lockstep:
    """Both sides driven by one scheduler (bench.run): each call made on both and compared."""

    def __init__(self, num_blocks: int, max_model_len: int) -> None:
        self.vllm = bench.VllmSide(num_blocks, max_model_len, events=True)
        self.ours = bench.PykvallocSide(num_blocks, keys="engine", events=True)
        self.ours.cache.take_events()  # the warm-up's
        self.matcher = Matcher()
        self.calls = 0
        self.counts = {"hit": 0, "evicted": 0, "stored": 0, "nomem": 0, "decode": 0}

    @property
    def produced(self):
        return self.ours.produced

    @produced.setter
    def produced(self, value) -> None:
        self.ours.produced = value
        self.vllm.produced = value

    @property
    def timings(self):
        return self.ours.timings

    @timings.setter
    def timings(self, value) -> None:
        self.ours.timings = value
        self.vllm.timings = bench.Timings()

    def compare(self, what: str) -> None:
        self.calls += 1
        where = f"call {self.calls} ({what})"
        free_theirs = self.vllm.manager.block_pool.get_num_free_blocks()
        stats = self.ours.cache.stats()
        assert free_theirs == stats.free_blocks + stats.cached_blocks, where
        theirs = flatten(self.vllm.manager.take_events())
        ours = flatten(self.ours.cache.take_events().events)
        assert len(theirs[0]) == len(ours[0]), f"{where}: stored {theirs[0]} / {ours[0]}"
        for (th, tp), (oh, op) in zip(theirs[0], ours[0]):
            self.matcher.same(th, oh, where)
            assert (tp is None) == (op is None), where
            if tp is not None:
                self.matcher.same(tp, op, where)
        assert len(theirs[1]) == len(ours[1]), f"{where}: removed {theirs[1]} / {ours[1]}"
        for th, oh in zip(theirs[1], ours[1]):
            self.matcher.same(th, oh, where)
        self.counts["stored"] += len(ours[0])
        self.counts["evicted"] += len(ours[1])

    def admit(self, request):
        theirs = self.vllm.admit(request)
        ours = self.ours.admit(request)
        assert (theirs is None) == (ours is None), f"request {request.index}: fits?"
        if theirs is not None:
            assert theirs == bench.capped(ours, len(request.prompt)), f"request {request.index}"
            self.counts["hit"] += theirs > 0
        else:
            self.counts["nomem"] += 1
        self.compare(f"admit {request.index}")
        return ours

    def decode(self, running, tokens):
        theirs = self.vllm.decode(running, tokens)
        ours = self.ours.decode(running, tokens)
        assert theirs == ours, f"decode of {running}: vLLM did {theirs}, pykvalloc {ours}"
        self.counts["decode"] += 1
        self.compare("decode")
        return ours

    def free(self, index):
        self.vllm.free(index)
        self.ours.free(index)
        self.compare(f"free {index}")

    def evictions(self):
        return self.ours.evictions()

    def room(self) -> int:
        theirs, ours = self.vllm.room(), self.ours.room()
        assert theirs == ours, f"free or evictable blocks: vLLM {theirs}, pykvalloc {ours}"
        return ours


def random_stream(seed: int, count: int) -> list[bench.Request]:
    """Prompts sharing heads (families of blocks), outputs of 0-40 tokens, and next turns of
    conversations: an earlier request's prompt and output and more, admitted once that request
    is done. No prompt is whole blocks."""
    rng = random.Random(seed)
    families = [[rng.randrange(1 << 30) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    stream: list[bench.Request] = []
    for index in range(count):
        after: tuple[int, ...] = ()
        if stream and rng.random() < 0.3:  # a next turn, once its previous one is done
            before = rng.choice(stream[-8:])
            head = list(before.prompt) + list(before.output)
            after = (before.index,)
        else:
            family = rng.choice(families)
            head = [t for seed_ in family[:rng.randint(0, len(family))]
                    for t in range(seed_, seed_ + BLOCK)]
        tail = [rng.randrange(1 << 30) for _ in range(rng.randint(1, 2 * BLOCK))]
        prompt = head + tail
        if len(prompt) % BLOCK == 0:
            prompt.append(rng.randrange(1 << 30))
        output = [rng.randrange(1 << 30) for _ in range(rng.randint(0, 40))]
        tokens = np.array(prompt + output, dtype=np.uint32)
        stream.append(bench.Request(index, tokens[:len(prompt)], tokens[len(prompt):],
                                    bench.engine_keys(tokens), after))
    return stream


@pytest.mark.parametrize("seed, num_blocks, running", [(1, 60, 3), (2, 200, 6), (3, 2000, 8)])
def test_lockstep_with_vllms_kv_cache_manager(seed: int, num_blocks: int, running: int) -> None:
    stream = random_stream(seed, 400)
    max_len = max(len(r.prompt) + len(r.output) for r in stream) + BLOCK
    pair = Lockstep(num_blocks, max_len)
    outcome = bench.run(pair, stream, running)
    assert outcome.hits
    counts = pair.counts
    assert counts["hit"] and counts["stored"] and counts["decode"], counts
    if num_blocks < 1000:
        assert counts["evicted"], counts
    pair.vllm.close()
    pair.ours.close()


def test_the_mooncake_trace_in_lockstep() -> None:
    if not bench.TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {bench.TRACE} (../shared beside the repository)")
    stream = bench.load_stream(bench.TRACE, 200)
    for r in stream:
        r.keys = bench.engine_keys(np.concatenate([r.prompt, r.output]))
    max_len = max(len(r.prompt) + len(r.output) for r in stream) + BLOCK
    pair = Lockstep(12000, max_len)
    bench.run(pair, stream, 16, reserve=True)
    assert pair.counts["evicted"] and pair.counts["hit"], pair.counts


def test_a_fully_cached_prompt() -> None:
    # A prompt of whole blocks whose every block is cached: vLLM reports num_tokens - 1 hit
    # tokens in whole blocks and computes the last block again in a new block under the same
    # hash; KVCache reuses every cached block. The hits agree once capped; vLLM holds one block
    # more.
    tokens = np.arange(3 * BLOCK, dtype=np.uint32)
    first = bench.Request(0, tokens, tokens[:0], bench.engine_keys(tokens))
    again = bench.Request(1, tokens, tokens[:0], bench.engine_keys(tokens))
    vllm = bench.VllmSide(16, 256)
    ours = bench.PykvallocSide(16)
    for side in (vllm, ours):
        assert side.admit(first) == 0
    assert vllm.admit(again) == 2 * BLOCK
    assert ours.admit(again) == 3 * BLOCK and bench.capped(3 * BLOCK, len(tokens)) == 2 * BLOCK
    assert vllm.manager.block_pool.get_num_free_blocks() == 16 - 4
    stats = ours.cache.stats()
    assert stats.free_blocks + stats.cached_blocks == 16 - 3
