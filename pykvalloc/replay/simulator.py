"""A continuous-batching engine, simulated, driving a real KV cache.

The model is the scheduler of a vLLM-style engine, one step at a time:
- requests arrive at their trace times (divided by ``time_scale``) and wait in FIFO order; one
  that could never complete on this cache even alone (its prompt and answer beyond what the
  cache holds) is rejected, as an engine rejects it, and counted;
- each step, every running request past its prefill decodes one token; one that needs a new KV
  block and finds none preempts the most recently admitted request (freed and requeued, to be
  recomputed); a request that must preempt itself with nothing else running can never grow on
  this cache, and is rejected;
- the rest of the step's token budget goes to prefill, chunked as vLLM's chunked prefill does:
  the requests already prefilling continue in admission order, then waiting requests are
  admitted in arrival order while budget and KV cache allow. Only a prompt's uncached tokens
  count, and a prompt longer than what is left is split over the following steps. The whole
  prompt's KV is allocated on admission, in one call, so that its prefix is looked up at once;
- a step lasts ``step_base_s + step_token_s * tokens`` of simulated time.
Nothing of the model runs: the point is the allocator's behaviour under real traffic.

Prefix reuse comes from the trace's hash ids, each covering 512 tokens: for a block size B that
divides 512, a full prompt block is keyed by the id it falls in and its position inside that
id; for a multiple of 512, by the ids it covers. Other block sizes cannot be keyed, and their
prefix hit rate is not measured.

Two things a multi-tenant engine does, off unless asked (paged mode):
- tenants (``ReplayConfig.tenants`` = N): each conversation goes to namespace hash(its id) % N
  (``tenant_of``), and the KV cache shares a prefix only within a namespace. A conversation is
  named by its first hash id past the system prompt, which all its turns repeat; a request
  without one (no hash ids, as in the Azure trace, or a prompt no longer than the system
  prompt) is a conversation of its own. Turns of one conversation still hit each other; what
  all conversations share (the system prompt) is cached once per tenant, so the hit rate is
  lower than with one namespace;
- a pinned system prompt (``pin_system_prompt``): the prefix most requests open with
  (``system_prompt``: Mooncake's hash id 0, 512 tokens) is pinned in each tenant's namespace
  once a request has cached it there, until the end of the run, as an engine keeps its system
  prompt resident: eviction never takes it, and each pin holds its blocks out of the rest of
  the traffic's reach.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..errors import InvalidArgument
from ..kvcache import DEFAULT_BLOCK_TOKENS
from .backends import ContiguousBackend, Geometry, MallocBackend, PagedBackend, Timings, require_counts
from .traces import MOONCAKE_BLOCK_TOKENS, Request, Trace


@dataclass
class ReplayConfig:
    mode: str = "paged"                 # paged | contiguous | malloc-glibc | malloc-jemalloc
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    capacity_tokens: int = 65536        # KV capacity in tokens (8 GiB for the default model)
    geometry: Geometry = field(default_factory=Geometry)
    max_batch_tokens: int = 8192        # token budget of one step
    max_running: int = 256
    time_scale: float = 1.0             # trace seconds per simulated second
    step_base_s: float = 0.010
    step_token_s: float = 0.00002
    prefix_caching: bool = True
    pool_name: Optional[str] = None     # publish live stats under this name
    sample_every: int = 1               # steps between usage samples
    # Paged: the engine's per-step buffers beside the KV cache, in the same pool (engine.py).
    engine_buffers: bool = False
    # Paged: conversations spread over this many namespaces (tenant_of); None: all in namespace 0.
    tenants: Optional[int] = None
    # Paged, prefix caching: the system prompt pinned in each tenant once cached (system_prompt).
    pin_system_prompt: bool = False

    def __post_init__(self) -> None:
        # A zero or NaN time scale divides by zero or never lets a request arrive; a zero block
        # or budget never makes progress: refused before a backend is made.
        require_counts(self, "block_tokens", "capacity_tokens", "max_batch_tokens", "max_running",
                       "sample_every")
        for name, zero_allowed in (("time_scale", False), ("step_base_s", True), ("step_token_s", True)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                    or (value == 0 and not zero_allowed):
                bound = "of at least 0" if zero_allowed else "above 0"
                raise InvalidArgument(f"{name} must be a finite number {bound}, not {value!r}")
        if self.tenants is not None:
            require_counts(self, "tenants")
            if self.tenants > MAX_TENANTS:
                raise InvalidArgument(f"tenants must be at most {MAX_TENANTS:,}, not {self.tenants:,}")
        if not isinstance(self.pin_system_prompt, bool):
            raise InvalidArgument(f"pin_system_prompt must be True or False, not {self.pin_system_prompt!r}")


#: The most tenants a replay spreads conversations over: each is a namespace (64 bits wide), and
#: the report keeps a row of figures for each one that had a request.
MAX_TENANTS = 1 << 16


@dataclass
class _Running:
    request: Request
    index: int
    handle: Any
    context: int          # tokens the KV holds (prompt + generated so far)
    generated: int
    synced: int           # tokens already announced to the backend
    capacity: int         # token slots the backend gave it
    prefill: int          # uncached prompt tokens still to compute; it decodes once this is 0


@dataclass
class Sample:
    time_s: float
    kv_use: float
    hit_rate: float
    running: int
    waiting: int


@dataclass
class ReplayResult:
    config: ReplayConfig
    source: str
    requests: int
    finished: int
    rejected: int                     # could never complete on this cache, even alone
    preemptions: int
    kv_use_at_first_preemption: Optional[float]
    peak_kv_use: float
    mean_kv_use: float
    internal_waste: float
    fragmentation: float
    # Prompt tokens found in the prefix cache over those looked up, at each request's first
    # admission: the trace's reuse that the cache kept. None where no request had prefix keys.
    prefix_hit_rate: Optional[float]
    # The same at re-admissions after a preemption, which find their own blocks of a moment
    # ago: counted apart, or a cache too small for the load (more preemptions) would seem to
    # hit more. None where nothing keyed was re-admitted.
    readmission_hit_rate: Optional[float]
    alloc_ns_p50: float
    alloc_ns_p99: float
    alloc_ns_p999: float
    allocator_share: float
    timing: str                       # where the allocator's calls were timed
    wall_s: float
    simulated_s: float
    steps: int
    samples: list[Sample] = field(default_factory=list)
    stopped: bool = False             # stopped before the end of the trace, as asked (should_stop)
    # What the engine's buffers around the KV cache cost, per kind (engine.py); None without them.
    engine_buffers: Optional[dict[str, dict[str, Any]]] = None
    # Why the prefix hit rates are None, when they are (``unmeasured_hits``); None when measured.
    hits_unmeasured: Optional[str] = None
    # The KV cache's own counters at the end (kva_kv_stats: hit_tokens, query_tokens and their
    # readmit_* parts, re-admissions being marked again=True); None for malloc. The two hit
    # rates above are these figures' ratios.
    kv_hit_counters: Optional[dict[str, int]] = None
    # With tenants: one row per namespace that had a request, in namespace order: namespace,
    # requests, and the first admissions' hit_tokens and query_tokens there. None without.
    tenants: Optional[list[dict[str, int]]] = None
    # With pin_system_prompt: what was pinned and whether it held (system_prompt_report). None
    # without.
    system_prompt: Optional[dict[str, Any]] = None

    def as_dict(self, samples: bool = False) -> dict[str, Any]:
        """The JSON form of the result; ``samples`` adds the usage samples, as rows of
        [time_s, kv_use, hit_rate, running, waiting] (a replay in a child process brings its
        samples to the parent's plot this way)."""
        keys = ("requests", "finished", "rejected", "preemptions", "kv_use_at_first_preemption", "peak_kv_use",
                "mean_kv_use", "internal_waste", "fragmentation", "prefix_hit_rate", "readmission_hit_rate",
                "alloc_ns_p50",
                "alloc_ns_p99", "alloc_ns_p999", "allocator_share", "timing", "wall_s", "simulated_s", "steps",
                "stopped", "engine_buffers", "hits_unmeasured", "tenants", "system_prompt")
        out: dict[str, Any] = {key: getattr(self, key) for key in keys}
        out["mode"] = self.config.mode
        out["block_tokens"] = self.config.block_tokens
        out["tenant_count"] = self.config.tenants
        out["capacity_tokens"] = self.config.capacity_tokens
        out["capacity_bytes"] = self.config.capacity_tokens * self.config.geometry.bytes_per_token
        out["source"] = self.source
        if samples:
            out["samples"] = [[s.time_s, s.kv_use, s.hit_rate, s.running, s.waiting] for s in self.samples]
        return out


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit values that spreads every input bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def _key(ids: tuple[int, ...], position: int) -> int:
    # A chain of bijective mixes: distinct (ids, position) give distinct keys but for 64-bit
    # collisions (about n^2 / 2^65 for n keys, none in practice). Shifting the id left to make
    # room for the position overflowed 64 bits for ids of 2^56 and more.
    key = _mix64((position + 0x9E3779B97F4A7C15) & _MASK64)
    for block_id in ids:
        key = _mix64(key ^ block_id)
    return key


def keyable(block_tokens: int) -> bool:
    """Whether blocks of ``block_tokens`` can be keyed from the trace's 512-token hash ids."""
    return MOONCAKE_BLOCK_TOKENS % block_tokens == 0 or block_tokens % MOONCAKE_BLOCK_TOKENS == 0


def block_keys(request: Request, block_tokens: int) -> Optional[list[int]]:
    """Content keys of the request's full prompt blocks, from its 512-token hash ids; None
    without ids or for a block size that cannot be keyed from them (see ``keyable``)."""
    ids = request.hash_ids
    if not ids or not keyable(block_tokens):
        return None
    if block_tokens >= MOONCAKE_BLOCK_TOKENS:
        per_block = block_tokens // MOONCAKE_BLOCK_TOKENS
        full = min(request.input_tokens // block_tokens, len(ids) // per_block)
        return [_key(ids[j * per_block:(j + 1) * per_block], 0) for j in range(full)]
    per_id = MOONCAKE_BLOCK_TOKENS // block_tokens
    full = min(request.input_tokens // block_tokens, len(ids) * per_id)
    return [_key((ids[j // per_id],), j % per_id) for j in range(full)]


def system_prompt(trace: Trace) -> tuple[int, ...]:
    """The hash ids of the prefix most requests open with: the longest run of leading ids that
    more than half of the requests with ids share (Mooncake's id 0, the system prompt, which
    every request opens with; the embedded workload's too). Empty when no id opens most of them
    or the trace has none."""
    candidates = [request.hash_ids for request in trace.requests if request.hash_ids]
    total = len(candidates)
    prefix: tuple[int, ...] = ()
    while candidates:
        counts: dict[int, int] = {}
        for ids in candidates:
            if len(ids) > len(prefix):
                counts[ids[len(prefix)]] = counts.get(ids[len(prefix)], 0) + 1
        best = max(counts.items(), key=lambda item: item[1], default=None)
        if best is None or 2 * best[1] <= total:
            break
        prefix += (best[0],)
        candidates = [ids for ids in candidates if len(ids) >= len(prefix) and ids[len(prefix) - 1] == best[0]]
    return prefix


def system_prompt_keys(config: ReplayConfig, trace: Trace, shared: tuple[int, ...]) -> list[int]:
    """The block keys of the system prompt ``shared`` (its whole blocks of config.block_tokens);
    InvalidArgument saying why when there is nothing to pin."""
    why = unmeasured_hits(config, trace)
    if why is not None:
        raise InvalidArgument(f"no system prompt to pin: {why}")
    if not shared:
        raise InvalidArgument("no system prompt to pin: no prefix of hash ids opens more than half "
                              "of the requests")
    tokens = len(shared) * MOONCAKE_BLOCK_TOKENS
    keys = block_keys(Request(0.0, tokens, 1, shared), config.block_tokens)
    if not keys:
        raise InvalidArgument(f"no system prompt to pin: the shared prefix of {tokens:,} tokens fills no "
                              f"block of {config.block_tokens:,} tokens")
    return keys


_REQUEST_SALT = 0xA5A55A5AC3C33C3C  # a request's own index, hashed apart from conversation ids


def tenant_of(request: Request, index: int, tenants: int, shared: tuple[int, ...]) -> int:
    """The namespace of request ``index`` among ``tenants``: hash(its conversation) % tenants.
    Its conversation is its first hash id past the system prompt ``shared`` (every later turn
    repeats it), or, without one, the request itself."""
    ids = request.hash_ids or ()
    if len(ids) > len(shared) and ids[:len(shared)] == shared:
        return _mix64(ids[len(shared)]) % tenants
    return _mix64(index ^ _REQUEST_SALT) % tenants


def unmeasured_hits(config: ReplayConfig, trace: Trace) -> Optional[str]:
    """Why a replay of ``trace`` under ``config`` measures no prefix hit rate, or None when it
    does: the report says so beside its dashes."""
    if config.mode.startswith("malloc-"):
        return "malloc has no prefix cache"
    if config.mode == "contiguous":
        return "contiguous buffers are private to their request: no prefix sharing"
    if not config.prefix_caching:
        return "prefix caching was turned off (--no-prefix-caching)"
    if not any(request.hash_ids for request in trace.requests):
        return "the trace carries no prefix ids (hash ids) to key blocks by"
    if not keyable(config.block_tokens):
        return (f"blocks of {config.block_tokens} tokens neither divide nor are a multiple of the trace's "
                f"512-token hash blocks")
    return None


def check_tenancy(config: ReplayConfig) -> None:
    """InvalidArgument for tenants or a pinned system prompt where no prefix cache has them."""
    if (config.tenants is not None or config.pin_system_prompt) and config.mode != "paged":
        raise InvalidArgument(f"tenants and a pinned system prompt need a paged KV cache's prefix cache, "
                              f"not mode {config.mode!r}")


def make_backend(config: ReplayConfig, timings: Timings) -> Any:
    if config.mode == "paged":
        return PagedBackend(config.capacity_tokens, config.block_tokens, config.geometry, config.pool_name,
                            config.prefix_caching, timings, config.engine_buffers)
    if config.engine_buffers:
        raise InvalidArgument(f"engine buffers go beside a paged KV cache, not with mode {config.mode!r}")
    check_tenancy(config)
    if config.mode == "contiguous":
        return ContiguousBackend(config.capacity_tokens, config.block_tokens, config.geometry, config.pool_name,
                                 config.prefix_caching, timings)
    if config.mode.startswith("malloc-"):
        return MallocBackend(config.capacity_tokens, config.geometry, config.mode[len("malloc-"):], timings)
    raise ValueError(f"unknown mode {config.mode!r} (paged, contiguous, malloc-glibc, malloc-jemalloc)")


def _bucket_percentile(histogram: list[int], fraction: float) -> int:
    """The upper bound (ns) of the log2 bucket holding the ``fraction`` quantile."""
    total = sum(histogram)
    if not total:
        return 0
    seen = 0
    for bucket, count in enumerate(histogram):
        seen += count
        if seen >= fraction * total:
            return 2 << bucket
    return 2 << (len(histogram) - 1)


def _percentile(sorted_values: list[int], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    return float(sorted_values[min(len(sorted_values) - 1, int(math.ceil(fraction * len(sorted_values))) - 1)])


def check_arrivals(trace: Trace, time_scale: float) -> None:
    """InvalidArgument for an arrival time that, divided by ``time_scale``, is not a finite
    number: the simulated clock would read inf, and every figure over time with it."""
    for request in trace.requests:
        if not math.isfinite(request.arrival_s / time_scale):
            raise InvalidArgument(f"the arrival at {request.arrival_s:g} s divided by the time scale "
                                  f"{time_scale:g} is beyond a float's range")


def replay(trace: Trace, config: ReplayConfig,
           progress: Optional[Callable[[int, int], None]] = None,
           on_step: Optional[Callable[[float], None]] = None,
           should_stop: Optional[Callable[[], bool]] = None) -> ReplayResult:
    """Runs the whole trace; ``progress(finished, total)`` is called now and then, and
    ``on_step(simulated_seconds)`` after every step. When ``should_stop()`` says so (asked
    before each step) the replay stops there: the requests under way give their blocks back, and
    the result covers the simulated time so far (``stopped``)."""
    check_arrivals(trace, config.time_scale)
    check_tenancy(config)
    requests = trace.requests
    shared = system_prompt(trace) if config.tenants is not None or config.pin_system_prompt else ()
    # The system prompt's block keys, pinned in a tenant by the first admission there that
    # cached them; InvalidArgument before anything is made when there is none to pin.
    pin_keys = (np.array(system_prompt_keys(config, trace, shared), dtype=np.uint64)
                if config.pin_system_prompt else None)
    namespace_of = ([tenant_of(request, index, config.tenants, shared) for index, request in enumerate(requests)]
                    if config.tenants is not None else None)
    tenant_rows: dict[int, list[int]] = {}               # namespace: [requests, hit, looked-up tokens]
    pins: dict[int, Any] = {}                            # namespace: its pin of the system prompt
    # First admissions that open with the system prompt in a tenant where it is pinned already,
    # and those of them that found it cached whole.
    prompt_seen = prompt_found = 0
    pin_figures: dict[str, int] = {}
    timings = Timings()
    backend = make_backend(config, timings)
    total = len(requests)
    waiting: deque[tuple[Request, int, int]] = deque()   # (request, index, tokens generated before)
    running: list[_Running] = []                         # in admission order
    next_arrival = 0
    now = 0.0
    steps = preemptions = finished = rejected = 0
    stopped = False
    keyed = False                                        # whether any request had prefix keys
    admitted_before: set[int] = set()                    # requests admitted at least once
    # [hit tokens, looked-up tokens] of first admissions and of re-admissions (ReplayResult).
    first_lookups, again_lookups = [0, 0], [0, 0]
    # Each request's keys, made once: a prompt the full cache turns away is offered again
    # every step, and rebuilding its keys each time dominated the run.
    key_cache: dict[int, Optional[np.ndarray]] = {}

    def keys_of(request: Request, index: int) -> Optional[np.ndarray]:
        if index not in key_cache:
            keys = block_keys(request, config.block_tokens) if backend.prefix_caching else None
            key_cache[index] = np.array(keys, dtype=np.uint64) if keys else None
        return key_cache[index]
    first_preemption_use: Optional[float] = None
    buffer_costs: Optional[dict[str, dict[str, Any]]] = None
    peak_use = use_time = waste_time = frag_time = elapsed = frag_now = 0.0
    samples: list[Sample] = []
    wall_start = time.perf_counter()

    def preempt_latest() -> None:
        nonlocal preemptions, first_preemption_use, peak_use
        victim = running.pop()
        use = backend.usage()[0]
        peak_use = max(peak_use, use)  # a preemption comes at the fullest moment of its step
        if first_preemption_use is None:
            first_preemption_use = use
        backend.release(victim.handle)
        waiting.appendleft((victim.request, victim.index, victim.generated))
        preemptions += 1

    try:
        while finished + rejected < total:
            if should_stop is not None and should_stop():
                stopped = True
                for r in running:
                    backend.release(r.handle)
                running = []
                break
            while next_arrival < total and requests[next_arrival].arrival_s / config.time_scale <= now:
                request = requests[next_arrival]
                if backend.never_fits(request.input_tokens, request.input_tokens + request.output_tokens):
                    rejected += 1
                else:
                    waiting.append((request, next_arrival, 0))
                next_arrival += 1
            if not running and not waiting:
                if next_arrival < total:
                    now = requests[next_arrival].arrival_s / config.time_scale
                continue

            step_tokens = 0
            # Decode one token for each running request past its prefill. One whose slots are
            # used up asks the backend for more, announcing every token since its last call;
            # when none is left, the most recently admitted request is preempted, possibly
            # this one.
            at = 0
            while at < len(running):
                r = running[at]
                if r.prefill:
                    at += 1
                    continue
                if r.context >= r.capacity:
                    need = r.context + 1 - r.synced
                    capacity = backend.extend(r.handle, need)
                    while capacity is None and running[-1] is not r:
                        preempt_latest()
                        capacity = backend.extend(r.handle, need)
                    if capacity is None:
                        if len(running) == 1:
                            # Alone and still out of room: it can never grow here.
                            backend.release(running.pop().handle)
                            key_cache.pop(r.index)
                            rejected += 1
                        else:
                            preempt_latest()      # r itself: it was the latest
                        continue
                    r.capacity, r.synced = capacity, r.context + 1
                r.context += 1
                r.generated += 1
                step_tokens += 1
                at += 1
            # The fullest moment of the step's decodes: before the requests that finished give
            # their blocks back (the last token of one may have taken a block of its own).
            peak_use = max(peak_use, backend.usage()[0])
            still = []
            for r in running:
                if not r.prefill and r.generated >= r.request.output_tokens:
                    backend.release(r.handle)
                    key_cache.pop(r.index)
                    finished += 1
                else:
                    still.append(r)
            running = still
            # The rest of the budget prefills: first the prompts already under way, then new
            # ones in arrival order, each taking what is left of the budget.
            for r in running:
                if step_tokens >= config.max_batch_tokens:
                    break
                chunk = min(r.prefill, config.max_batch_tokens - step_tokens)
                r.prefill -= chunk
                step_tokens += chunk
            while waiting and len(running) < config.max_running and step_tokens < config.max_batch_tokens:
                request, index, generated = waiting[0]
                prompt = request.input_tokens + generated
                keys = keys_of(request, index)
                keyed = keyed or keys is not None
                namespace = namespace_of[index] if namespace_of is not None else 0
                admitted = backend.admit(prompt, keys, request.input_tokens + request.output_tokens,
                                         again=index in admitted_before, namespace=namespace)
                if admitted is not None and backend.prefix_caching:
                    # What the KV manager adds to its hit and query counts for this allocation
                    # (a prompt shorter than a block has no keys, and counts as looked up too).
                    lookups = again_lookups if index in admitted_before else first_lookups
                    cached = backend.cached_tokens(admitted[0])
                    lookups[0] += cached
                    lookups[1] += prompt
                    if namespace_of is not None and index not in admitted_before:
                        row = tenant_rows.setdefault(namespace, [0, 0, 0])
                        row[0] += 1
                        row[1] += cached
                        row[2] += prompt
                    if pin_keys is not None and keys is not None and len(keys) >= len(pin_keys) \
                            and np.array_equal(keys[:len(pin_keys)], pin_keys):
                        if namespace in pins:
                            if index not in admitted_before:
                                prompt_seen += 1
                                prompt_found += cached >= len(pin_keys) * config.block_tokens
                        else:  # cached in this tenant now: pinned from here to the end
                            pin = backend.pin(pin_keys, namespace)
                            if pin is not None:
                                pins[namespace] = pin
                if admitted is None:
                    if running:
                        break
                    waiting.popleft()      # alone in the cache and it does not fit: never will
                    key_cache.pop(index)
                    rejected += 1
                    continue
                handle, capacity = admitted
                waiting.popleft()
                admitted_before.add(index)
                todo = prompt - backend.cached_tokens(handle)
                chunk = min(todo, config.max_batch_tokens - step_tokens)
                step_tokens += chunk
                running.append(_Running(request, index, handle, prompt, generated, prompt, capacity, todo - chunk))

            if backend.buffers is not None:
                backend.buffers.step(step_tokens)
            step_s = config.step_base_s + config.step_token_s * step_tokens
            use, slots = backend.usage()
            slack = sum(r.capacity - r.context for r in running)
            peak_use = max(peak_use, use)
            use_time += use * step_s
            waste_time += (slack / slots if slots else 0.0) * step_s
            elapsed += step_s
            # Measured every 16th step (it walks the pool), each measure standing for the
            # steps until the next one.
            if steps % 16 == 0:
                frag_now = backend.fragmentation()
            frag_time += frag_now * step_s
            now += step_s
            steps += 1
            if steps % config.sample_every == 0:
                hits, queries = first_lookups
                samples.append(Sample(now, use, hits / queries if queries else 0.0, len(running), len(waiting)))
            if on_step is not None:
                on_step(now)
            if progress is not None and steps % 256 == 0:
                progress(finished, total)
        if pin_keys is not None:
            pin_figures = backend.pin_figures()  # before the pins go, with the run
            for pin in pins.values():
                backend.unpin(pin)
        library = backend.library_time()
        kv_hit_counters = backend.hit_counters()
        if backend.buffers is not None:
            backend.buffers.close()
            buffer_costs = backend.buffers.report()
        backend.verify_empty()
    finally:
        backend.close()
    wall = time.perf_counter() - wall_start
    ordered = sorted(timings.samples)
    if library is not None:
        # Timed inside the library: the share is exact; the percentiles are log2-bucket bounds.
        library_ns, histogram = library
        share = library_ns / 1e9 / wall if wall else 0.0
        p50, p99, p999 = (float(_bucket_percentile(histogram, q)) for q in (0.5, 0.99, 0.999))
        timing = "inside the library"
    else:
        share = sum(ordered) / 1e9 / wall if wall else 0.0
        p50, p99, p999 = (_percentile(ordered, q) for q in (0.5, 0.99, 0.999))
        timing = "around the ctypes call"

    return ReplayResult(
        config=config, source=trace.source, requests=total, finished=finished, rejected=rejected,
        preemptions=preemptions,
        kv_use_at_first_preemption=first_preemption_use, peak_kv_use=peak_use,
        mean_kv_use=use_time / elapsed if elapsed else 0.0,
        internal_waste=waste_time / elapsed if elapsed else 0.0,
        fragmentation=frag_time / elapsed if elapsed else 0.0,
        prefix_hit_rate=first_lookups[0] / first_lookups[1] if keyed and first_lookups[1] else None,
        # Without keys nothing can hit: a re-admission's 0.0 % would be a figure never measured.
        readmission_hit_rate=again_lookups[0] / again_lookups[1] if keyed and again_lookups[1] else None,
        alloc_ns_p50=p50, alloc_ns_p99=p99, alloc_ns_p999=p999, allocator_share=share, timing=timing,
        wall_s=wall, simulated_s=now, steps=steps, samples=samples, stopped=stopped,
        engine_buffers=buffer_costs, kv_hit_counters=kv_hit_counters, hits_unmeasured=None if keyed else (
            unmeasured_hits(config, trace) or "no prompt filled a whole block to key"),
        tenants=None if namespace_of is None else [
            {"namespace": namespace, "requests": row[0], "hit_tokens": row[1], "query_tokens": row[2]}
            for namespace, row in sorted(tenant_rows.items())],
        system_prompt=None if pin_keys is None else {
            "hash_ids": len(shared), "tokens": len(shared) * MOONCAKE_BLOCK_TOKENS,
            "requests_opening": sum(1 for r in requests if r.hash_ids and r.hash_ids[:len(shared)] == shared),
            "blocks": len(pin_keys), "pins": len(pins), "pinned_blocks": pin_figures.get("pinned_blocks", 0),
            "capacity_blocks": backend.capacity_blocks, "evictions": pin_figures.get("evictions", 0),
            "admissions_after_pin": prompt_seen, "found_whole": prompt_found})


#: The longest a paced replay waits between two steps, in wall seconds. A busy step is a fraction
#: of a simulated second, so a longer wait is a gap between arrivals (or a pace slower than
#: anyone watches): a trace 10^10 s long would otherwise hold the replay for centuries, and
#: such a wait overflows what a lock's timeout holds. kvalloc top refreshes at most every 10 s,
#: so a watcher still sees the idle pool.
LONGEST_PACED_WAIT_S = 10.0


def pacer(speed: float, stop: Optional[threading.Event] = None,
          longest_wait_s: float = LONGEST_PACED_WAIT_S) -> Callable[[float], None]:
    """An on_step that holds the replay to ``speed`` simulated seconds per wall second, so that a
    person watching it live (kvalloc top) sees it unfold. The simulated time a step adds is held
    for at most ``longest_wait_s`` and the rest of it skipped: the steps after a long gap keep
    the pace from where the gap ended. A wait ends early once ``stop`` is set."""
    last_simulated_s = 0.0
    due = time.perf_counter()         # when the replay may take its next step

    def hold(simulated_s: float) -> None:
        nonlocal last_simulated_s, due
        # min() also takes a step whose simulated time divided by the speed is inf.
        due += min((simulated_s - last_simulated_s) / speed, longest_wait_s)
        last_simulated_s = simulated_s
        ahead = due - time.perf_counter()
        if ahead > 0.001:
            if stop is not None:
                stop.wait(ahead)
            else:
                time.sleep(ahead)

    return hold
