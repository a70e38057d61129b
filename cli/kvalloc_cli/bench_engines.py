#!/usr/bin/env python3
"""vLLM's KV-cache manager against pykvalloc's on the Mooncake conversation trace.

Both sides serve one stream of requests with one scheduler (run): a request arrives in trace
order, a conversation's next turn once its previous turn is done; arrived requests are admitted
in order while at most --running run (a prefill each) and, with a limited cache, while the
blocks the running requests will still fill stay free or evictable; then every running request decodes one
token a step (vLLM: one allocate_slots per request; pykvalloc: one DecodeStep.run for all of
them), and a request that has produced its output_length tokens is freed. Both caches have the
same blocks of 16 tokens: --blocks 0 is enough for every request of the run at once (no
eviction), else that many (vLLM's pool holds one more: its null block).

The tokens: a block of the trace (512 tokens, a hash id) becomes 512 token ids of its own. A
request whose next turn (the first later request whose prompt starts with all of its full
blocks and reaches past its output) exists decodes the tokens that next turn's prompt holds
there, so the next turn hits the blocks decoding filled; others decode tokens of their own.
No prompt is whole blocks (one token moves from its output): a prompt of whole blocks that is
all cached is where vLLM computes its last block again in a new block under the same hash and
keeps both, where pykvalloc reuses the cached one, and from there the two caches hold
different blocks (tests/vllm/test_kv_cache_manager.py::test_a_fully_cached_prompt).

Timed: vLLM's get_computed_blocks + allocate_slots per prefill and allocate_slots per decoded
token (the Request, its block hashes included, is built and grown outside the timed region);
pykvalloc's allocate per prefill and one DecodeStep.run per step (blocks filled committed). With
--keys engine (the default) pykvalloc is given the engine's block keys, computed outside the
timed region as vLLM's hashes are; with --keys tokens it is given the token ids, which it
hashes and chains inside the timed calls. A pykvalloc cache has every block registered once and
evicted before the run, untimed, so that its host metadata is in memory as vLLM's block
objects are. Hit tokens are asserted identical request by request, vLLM's capped at
num_tokens - 1 (it recomputes a fully cached prompt's last token), and so are the
preemptions; tests/vllm/test_kv_cache_manager.py holds evictions and events to vLLM's too.
Each side runs --repeat times (3), the two in turn, and each figure is the median of its runs.

Run with a Python that has pykvalloc (and vLLM, for the comparison; without it only pykvalloc
runs, said in one line): .venv-vllm/bin/python tools/bench_engines.py
"""

from __future__ import annotations

import argparse
import bisect
import gc
import hashlib
import heapq
import json
import os
import platform
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

# The source checkout this module runs from (cli/kvalloc_cli/ in it), with ../shared beside it.
REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK = 512
BLOCK = 16


# -- the stream -----------------------------------------------------------------------------

@dataclass
class Request:
    index: int
    prompt: np.ndarray  # uint32 token ids
    output: np.ndarray  # uint32: the tokens it decodes, one a step
    keys: np.ndarray | None = None  # engine keys of its full blocks, prompt and output: (n, 32)
    after: tuple[int, ...] = ()  # earlier requests it comes after, once they are done


def engine_keys(tokens: np.ndarray) -> np.ndarray:
    """The chained keys an engine gives its full blocks (sha256 of the parent's key and the
    block's token ids), as rows of 32 bytes."""
    digest = b""
    rows = []
    raw = tokens.astype("<u4").tobytes()
    for start in range(0, len(tokens) // BLOCK * BLOCK * 4, BLOCK * 4):
        digest = hashlib.sha256(digest + raw[start:start + BLOCK * 4]).digest()
        rows.append(digest)
    keys: np.ndarray = np.frombuffer(bytearray(b"".join(rows)), dtype=np.uint8)
    return keys.reshape(len(rows), 32)


def trace_tokens(block_id: int) -> np.ndarray:
    """The 512 token ids of a trace block: its own, for every block id."""
    tokens: np.ndarray = np.arange(TRACE_BLOCK, dtype=np.uint64) + np.uint64(block_id) * TRACE_BLOCK
    return tokens.astype(np.uint32)


def load_stream(path: Path, count: int) -> list[Request]:
    records = []
    with path.open() as lines:
        for line in lines:
            records.append(json.loads(line))
    holders: dict[int, list[int]] = {}  # an id names its whole prefix: the trace is a tree
    for j, record in enumerate(records):
        for block_id in record["hash_ids"]:
            holders.setdefault(block_id, []).append(j)

    def prompt_of(record: dict[str, Any]) -> np.ndarray:
        tokens = np.concatenate([trace_tokens(b) for b in record["hash_ids"]])
        return tokens[:record["input_length"]]

    stream: list[Request] = []
    claimed: set[int] = set()  # next turns that continue an earlier request already
    waits: dict[int, set[int]] = {}  # request -> the earlier ones whose decoding its prompt holds
    for i, record in enumerate(records[:count]):
        full = record["input_length"] // TRACE_BLOCK
        need = record["input_length"] + record["output_length"]
        nxt = None
        if full:
            candidates = holders[record["hash_ids"][full - 1]]
            nxt = next((j for j in candidates[bisect.bisect_right(candidates, i):]
                        if records[j]["input_length"] >= need and j not in claimed), None)
        if nxt is None:  # tokens of its own, beyond every trace block's
            prompt = prompt_of(record)
            output = (np.arange(record["output_length"], dtype=np.uint64)
                      + np.uint64(1 << 31) + np.uint64(i) * 4096).astype(np.uint32)
        else:  # its next turn's tokens: its partial block and its output as the next turn says
            following = prompt_of(records[nxt])
            prompt = following[:record["input_length"]]
            output = following[record["input_length"]:need]
            claimed.add(nxt)
            # Every later request whose prompt holds the blocks this one's decoding fills (the
            # next turn among them) comes once this one is done, as a next turn would: two
            # requests filling one block at once are where vLLM keeps both blocks under one
            # hash and pykvalloc one.
            for k in holders[records[nxt]["hash_ids"][full]]:
                if k > i:
                    waits.setdefault(k, set()).add(i)
        if len(prompt) % BLOCK == 0:  # whole blocks: one token moves from the output (or goes)
            prompt, output = ((np.concatenate([prompt, output[:1]]), output[1:]) if len(output)
                              else (prompt[:-1], output))
        stream.append(Request(i, prompt, output, after=tuple(sorted(waits.get(i, ())))))
    return stream


# -- the two sides --------------------------------------------------------------------------

@dataclass
class Timings:
    prefill_ns: int = 0
    prefills: int = 0
    decode_ns: int = 0
    decoded: int = 0
    steps: int = 0


@dataclass
class Outcome:
    """What a run did: per request its hit tokens (None: never admitted), the evictions."""

    hits: dict[int, int] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)
    evictions: int | None = 0
    timings: Timings = field(default_factory=Timings)


class Side(ABC):
    """One KV manager as the scheduler (run) drives it: the timings it adds to, and how many
    tokens each running request has decoded (the scheduler's own count, shared)."""

    name = ""

    def __init__(self) -> None:
        self.timings = Timings()
        self.produced: dict[int, int] = {}

    @abstractmethod
    def admit(self, request: Request) -> int | None:
        """Prefills a request: its hit tokens, or None when it does not fit."""

    @abstractmethod
    def decode(self, running: list[int], tokens: np.ndarray) -> int:
        """One token for each running request; how many were done (in order)."""

    @abstractmethod
    def free(self, index: int) -> None: ...

    @abstractmethod
    def evictions(self) -> int | None: ...

    @abstractmethod
    def room(self) -> int:
        """Blocks free or evictable."""

    @abstractmethod
    def close(self) -> None: ...


class PykvallocSide(Side):
    """pykvalloc's sequence calls: with keys="engine", the engine's own keys of each block
    (computed outside the timed region, as vLLM's Request computes its block hashes); with
    keys="tokens", the token ids, hashed and chained by the library inside the timed calls.
    A decode step is written into a DecodeStep's buffers (the engine's bookkeeping, as vLLM's
    Request grows its token list, untimed) and run in one call (timed)."""

    name = "pykvalloc"

    def __init__(self, num_blocks: int, keys: str = "engine", events: bool = False) -> None:
        import pykvalloc
        super().__init__()
        self.engine = keys == "engine"
        self.cache = pykvalloc.KVCache(num_blocks=num_blocks, block_tokens=BLOCK, layers=1,
                                       kv_heads=1, head_dim=1, dtype="int8",
                                       max_key_bytes=32 if self.engine else 0,
                                       events=(1 << 20) if events else 0)
        self.seqs: dict[int, Any] = {}
        self.requests: dict[int, Request] = {}
        self.OutOfMemory = pykvalloc.OutOfMemory
        self.step = self._step_for(256)
        self._warm_up(num_blocks)

    def _step_for(self, running: int) -> Any:
        # One block filled a request at most, with one token a step.
        return (self.cache.decode_step(running, content="keys", key_len=32) if self.engine
                else self.cache.decode_step(running, content="tokens"))

    def _warm_up(self, num_blocks: int) -> None:
        """Registers every block once and evicts it, untimed: the cache's host metadata (block
        records, prefix table, keys, LRU) is then in memory, as vLLM's block objects are once
        its pool is built; a first touch costs a page fault each, milliseconds for a request on
        a loaded machine."""
        rng = np.random.default_rng(0)
        if self.engine:
            keys = rng.integers(0, 256, size=(num_blocks, 32), dtype=np.uint8)
            seq = self.cache.allocate(num_blocks * BLOCK, keys=keys)
        else:
            seq = self.cache.allocate(num_blocks * BLOCK,
                                      block_keys=rng.integers(0, 1 << 62, size=num_blocks,
                                                              dtype=np.uint64))
        seq.free()
        self.cache.evict()
        self._evicted_before = self.cache.stats().evictions

    def admit(self, request: Request) -> int | None:
        n = len(request.prompt)
        keys = tokens = None
        if self.engine:
            assert request.keys is not None, "engine keys are computed before the run"
            keys = request.keys[:n // BLOCK]
        else:
            tokens = request.prompt
        start = time.perf_counter_ns()
        try:
            seq = self.cache.allocate(n, tokens=tokens, keys=keys)
        except self.OutOfMemory:
            return None
        self.timings.prefill_ns += time.perf_counter_ns() - start
        self.timings.prefills += 1
        self.seqs[request.index] = seq
        self.requests[request.index] = request
        return int(seq.num_cached_tokens)

    def decode(self, running: list[int], tokens: np.ndarray) -> int:
        """One token for each running request, in one call; how many were done (in order)."""
        count = len(running)
        if count > self.step.capacity:
            self.step = self._step_for(count)
        step = self.step
        step.handles[:count] = self._handles(running)
        if self.engine:  # the key of each block this step fills
            lengths = [len(self.requests[i].prompt) + self.produced[i] + 1 for i in running]
            filling = [(i, n // BLOCK - 1) for i, n in zip(running, lengths) if n % BLOCK == 0]
            if filling:
                step.keys[:len(filling)] = np.stack([self.key_row(i, b) for i, b in filling])
            np.cumsum([n % BLOCK == 0 for n in lengths], out=step.offsets[1:count + 1])
        else:  # a token id each
            step.tokens[:count] = tokens
            step.offsets[:count + 1] = np.arange(count + 1, dtype=np.uint64)
        start = time.perf_counter_ns()
        done: int = step.run(count)
        self.timings.decode_ns += time.perf_counter_ns() - start
        self.timings.decoded += done
        self.timings.steps += 1
        return done

    def key_row(self, index: int, block: int) -> np.ndarray:
        keys = self.requests[index].keys
        assert keys is not None, "engine keys are computed before the run"
        row: np.ndarray = keys[block]
        return row

    def _handles(self, running: list[int]) -> np.ndarray:
        return np.fromiter((self.seqs[i].handle for i in running), dtype=np.uint64,
                           count=len(running))

    def free(self, index: int) -> None:
        self.seqs.pop(index).free()
        self.requests.pop(index)

    def evictions(self) -> int:
        return self.cache.stats().evictions - self._evicted_before

    def room(self) -> int:
        held = self.cache.gauges()
        return held.free_blocks + held.cached_blocks

    def close(self) -> None:
        for seq in self.seqs.values():
            seq.free()
        self.cache.close()


class VllmSide(Side):
    name = "vLLM"

    def __init__(self, num_blocks: int, max_model_len: int, events: bool = False) -> None:
        super().__init__()
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                                KVCacheGroupSpec)
        from vllm.v1.request import Request as VRequest

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self._VRequest, self._SamplingParams = VRequest, SamplingParams
        config = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                          head_size=1, dtype=torch.float32))])
        self.manager = KVCacheManager(config, max_model_len=max_model_len,
                                      scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                      enable_caching=True, enable_kv_cache_events=events)
        self.requests: dict[int, Any] = {}

    def make(self, request: Request) -> Any:
        params = self._SamplingParams(max_tokens=max(1, len(request.output)))
        params.update_from_generation_config({}, eos_token_id=None)
        return self._VRequest(request_id=str(request.index),
                              prompt_token_ids=request.prompt.tolist(),
                              sampling_params=params, pooling_params=None,
                              block_hasher=self._hasher)

    def admit(self, request: Request) -> int | None:
        req = self.make(request)  # hashes its blocks: not timed
        manager = self.manager
        start = time.perf_counter_ns()
        blocks, hit, *_ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        elapsed = time.perf_counter_ns() - start
        if new is None:
            return None
        self.timings.prefill_ns += elapsed
        self.timings.prefills += 1
        req.num_computed_tokens = req.num_tokens
        self.requests[request.index] = req
        return int(hit)

    def decode(self, running: list[int], tokens: np.ndarray) -> int:
        manager, done, elapsed = self.manager, 0, 0
        for index, token in zip(running, tokens.tolist()):
            req = self.requests[index]
            req.append_output_token_ids(token)  # the request's own work, hashing included
            start = time.perf_counter_ns()
            new = manager.allocate_slots(req, 1)
            elapsed += time.perf_counter_ns() - start
            if new is None:  # as pykvalloc's batch: the first that does not fit stops it;
                break  # the scheduler frees it (a preemption) and builds it again later
            req.num_computed_tokens += 1
            done += 1
        self.timings.decode_ns += elapsed
        self.timings.decoded += done
        self.timings.steps += 1
        return done

    def free(self, index: int) -> None:
        self.manager.free(self.requests.pop(index))

    def evictions(self) -> int | None:
        return None  # vLLM counts none without events (the differential test compares them)

    def room(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())

    def close(self) -> None:
        for req in self.requests.values():
            self.manager.free(req)


def run(side: Side, stream: list[Request], running_max: int, reserve: bool = False,
        watch: Callable[[str, int, int | None], None] | None = None) -> Outcome:
    """The scheduler. A request arrives in trace order, once the requests it comes after are
    done (a next turn after its previous turn); arrived requests are admitted in order while fewer than running_max run, then every
    running request decodes one token (one step) and those done are freed. With reserve, a
    request is admitted only if the cache keeps, beyond all the blocks it will hold, the free or
    evictable blocks every running request will still fill (the trace says how long each
    output is), so that no step runs out: vLLM's scheduler makes room by preempting, and a
    preempted request's prompt, whole blocks and all cached, is where vLLM computes a block
    again (a duplicate) and the two caches part; here the room is kept up front. Both caches hold the same blocks after every call (the
    differential test checks it), so they see the same decisions. A prefill that does not fit
    waits for running requests to finish; a decode step that runs out stops at a request, and
    that one and the rest are preempted (freed) and arrive again. watch(what, index, value)
    sees every decision (the differential tests compare them)."""
    outcome = Outcome()
    side.timings = outcome.timings
    produced: dict[int, int] = {}
    side.produced = produced
    arrived = [r.index for r in stream if not r.after]  # a heap of indices
    heapq.heapify(arrived)
    waiting_for = {r.index: len(r.after) for r in stream if r.after}
    next_turns: dict[int, list[int]] = {}
    for r in stream:
        for before in r.after:
            next_turns.setdefault(before, []).append(r.index)
    running: list[int] = []
    left = len(stream)

    def blocks(i: int, tokens: int) -> int:  # request i's blocks once it has decoded tokens
        return -(-(len(stream[i].prompt) + tokens) // BLOCK)

    def done_with(i: int) -> None:
        nonlocal left
        side.free(i)
        left -= 1
        for j in next_turns.pop(i, ()):
            waiting_for[j] -= 1
            if not waiting_for[j]:
                heapq.heappush(arrived, j)

    while left:
        while arrived and len(running) < running_max:
            request = stream[arrived[0]]
            if reserve and running and (side.room() - blocks(request.index, len(request.output))
                                        < sum(blocks(i, len(stream[i].output)) - blocks(
                                            i, produced[i]) for i in running)):
                break
            hit = side.admit(request)
            if watch:
                watch("admit", request.index, hit)
            if hit is None:
                if not running:
                    raise RuntimeError(f"request {request.index} of {len(request.prompt)} tokens "
                                       "does not fit in an empty cache")
                break
            heapq.heappop(arrived)
            outcome.hits.setdefault(request.index, hit)
            produced[request.index] = 0
            if len(stream[request.index].output) == 0:
                done_with(request.index)
                continue
            running.append(request.index)
        if not running:
            if arrived:
                continue
            raise RuntimeError("no request can run: a turn waits for one that never ends")
        tokens = np.fromiter((stream[i].output[produced[i]] for i in running), dtype=np.uint32,
                             count=len(running))
        done = side.decode(running, tokens)
        if watch:
            watch("decode", len(running), done)
        for i in running[done:]:  # preempted: freed, to arrive again
            side.free(i)
            outcome.preempted.append(i)
            heapq.heappush(arrived, i)
            stream[i] = Request(i, np.concatenate([stream[i].prompt,
                                                   stream[i].output[:produced[i]]]),
                                stream[i].output[produced[i]:], stream[i].keys, stream[i].after)
        still = []
        for i in running[:done]:
            produced[i] += 1
            if produced[i] == len(stream[i].output):
                done_with(i)
            else:
                still.append(i)
        running = still
    outcome.evictions = side.evictions()
    return outcome


def capped(hit: int, num_tokens: int) -> int:
    """pykvalloc's hit as vLLM reports it: at most num_tokens - 1, in whole blocks."""
    return min(hit, (num_tokens - 1) // BLOCK * BLOCK)


# -- the report ------------------------------------------------------------------------------

def per(ns: int, count: int) -> float:
    return ns / count / 1000 if count else float("nan")


def median_per(outcomes: list[Outcome], what: str) -> float:
    """The median over runs of µs per request (prefill) or per token decoded (decode)."""
    values = sorted(per(o.timings.prefill_ns, o.timings.prefills) if what == "prefill"
                    else per(o.timings.decode_ns, o.timings.decoded) for o in outcomes)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=2000,
                        help="the first N requests of the trace (default 2000)")
    parser.add_argument("--running", type=int, default=256,
                        help="requests decoding at once, at most (default 256: vLLM's "
                        "max_num_seqs on most GPUs; 1024 on H100 and H200)")
    parser.add_argument("--blocks", type=int, nargs="*", default=[0, 16000],
                        help="cache sizes in blocks of 16 tokens; 0: every request's blocks "
                        "(default 0 16000)")
    parser.add_argument("--keys", choices=("engine", "tokens"), default="engine",
                        help="what pykvalloc is given: the engine's block keys, computed "
                        "outside the timed region as vLLM's are (default), or the token ids, "
                        "hashed by the library inside it")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs of each side, in turn; the figures are their medians "
                        "(default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="the first 200 requests: a smoke run, not figures to keep")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 200)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1 or args.requests < 1 or args.running < 1:
        parser.error("--repeat, --requests and --running are at least 1")
    if not args.trace.is_file():
        print(f"the Mooncake trace is not at {args.trace} (../shared beside the repository); "
              "give --trace", file=sys.stderr)
        return 2
    try:
        import vllm
        have_vllm = True
        vllm_version = vllm.__version__
    except ImportError as exc:
        have_vllm, vllm_version = False, None
        print(f"vLLM is not importable here ({exc}): timing pykvalloc alone; run with "
              ".venv-vllm/bin/python for the comparison")
    import pykvalloc

    base = load_stream(args.trace, args.requests)
    if args.keys == "engine":
        for r in base:
            r.keys = engine_keys(np.concatenate([r.prompt, r.output]))
    total_blocks = sum(-(-(len(r.prompt) + len(r.output)) // BLOCK) for r in base)
    max_len = max(len(r.prompt) + len(r.output) for r in base) + BLOCK
    print(f"{len(base)} requests of the Mooncake conversation trace, {args.running} running at "
          f"once, blocks of {BLOCK} tokens; {sum(len(r.prompt) for r in base):,} prompt tokens, "
          f"{sum(len(r.output) for r in base):,} decoded; pykvalloc given "
          + ("the engine's block keys" if args.keys == "engine" else "token ids (hashed in C)"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or '?'}, "
          f"Python {platform.python_version()}, pykvalloc {pykvalloc.__version__}"
          + (f", vLLM {vllm_version}" if have_vllm else ""))
    figures = []
    for blocks in args.blocks:
        size = blocks or total_blocks
        label = f"{size:,} blocks" + (" (every request's)" if not blocks else "")
        sides: list[tuple[str, Callable[[], Side]]] = [
            ("pykvalloc", lambda: PykvallocSide(size, args.keys))]
        if have_vllm:
            sides.insert(0, ("vLLM", lambda: VllmSide(size, max_len)))
        runs: dict[str, list[Outcome]] = {name: [] for name, _ in sides}
        for _ in range(args.repeat):  # the sides in turn, so that a machine's load falls on both
            for name, make in sides:
                side = make()
                stream = [Request(r.index, r.prompt, r.output, r.keys, r.after) for r in base]
                gc.collect()
                outcome = run(side, stream, args.running, reserve=blocks != 0)
                side.close()
                if runs[name] and outcome.hits != runs[name][0].hits:
                    raise RuntimeError(f"{name} hit differently in its run {len(runs[name]) + 1}")
                runs[name].append(outcome)
        results = {name: outcomes[0] for name, outcomes in runs.items()}
        ours = results["pykvalloc"]
        row: dict[str, Any] = {"blocks": size, "runs": args.repeat,
                               "pykvalloc_prefill_us": median_per(runs["pykvalloc"], "prefill"),
                               "pykvalloc_decode_us_per_token": median_per(runs["pykvalloc"], "decode"),
                               "hit_tokens": sum(ours.hits.values()), "evictions": ours.evictions,
                               "preempted": len(ours.preempted)}
        row["running_per_step"] = ours.timings.decoded / max(ours.timings.steps, 1)
        print(f"\n{label}: {row['hit_tokens']:,} hit tokens, {ours.evictions:,} evictions, "
              f"{len(ours.preempted)} preemptions, {row['running_per_step']:.1f} requests "
              "decoding a step on average")
        if have_vllm:
            theirs = results["vLLM"]
            mismatched = [i for i in theirs.hits if theirs.hits[i] != capped(
                ours.hits[i], len(base[i].prompt))]
            assert not mismatched, f"hit tokens differ for requests {mismatched[:10]}"
            assert theirs.preempted == ours.preempted, "preemptions differ"
            row.update(vllm_prefill_us=median_per(runs["vLLM"], "prefill"),
                       vllm_decode_us_per_token=median_per(runs["vLLM"], "decode"))
            row["prefill_ratio"] = row["vllm_prefill_us"] / row["pykvalloc_prefill_us"]
            row["decode_ratio"] = (row["vllm_decode_us_per_token"]
                                   / row["pykvalloc_decode_us_per_token"])
            print("  hit tokens identical, request by request (vLLM's capped at num_tokens - 1)")
            print(f"  prefill per request:  vLLM {row['vllm_prefill_us']:9.2f} us   pykvalloc "
                  f"{row['pykvalloc_prefill_us']:7.2f} us   {row['prefill_ratio']:6.1f}x")
            print(f"  decode per token:     vLLM {row['vllm_decode_us_per_token']:9.3f} us   "
                  f"pykvalloc {row['pykvalloc_decode_us_per_token']:7.3f} us   "
                  f"{row['decode_ratio']:6.1f}x  (one DecodeStep.run a step)")
        else:
            print(f"  prefill per request: pykvalloc {row['pykvalloc_prefill_us']:.2f} us")
            print(f"  decode per token:    pykvalloc {row['pykvalloc_decode_us_per_token']:.3f} us")
        figures.append(row)
    if args.json:
        args.json.write_text(json.dumps({"requests": len(base), "running": args.running, "keys": args.keys,
                                         "vllm": vllm_version, "rows": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
