"""Where the simulated engine keeps its KV cache: the three memory strategies compared.

- ``PagedBackend``: the libkvalloc KV manager in paged mode (fixed-size blocks, prefix cache).
- ``ContiguousBackend``: the KV manager in contiguous mode (one buddy block per request, in
  power-of-two token buckets; growth moves the request to the next bucket).
- ``MallocBackend``: a per-request malloc of the request's whole KV (prompt and answer) on
  admission, as engines did before paged attention; glibc's malloc, or jemalloc's when its
  library is installed. The allocator has no capacity, so the backend enforces the same budget.

Each backend also says which requests can never complete on it (``never_fits``), so that the
simulator rejects them, as an engine does, instead of preempting and readmitting them forever.

Every call into an allocator is timed, so the report can say what share of the replay the
allocator took: inside the library for the KV manager (a traced cache times each call in C, from
taking its lock to giving it up), and around the ctypes call for malloc, which cannot be timed
from inside (so its figures include the Python-to-C call).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..errors import InvalidArgument, OutOfMemory
from ..kvcache import KVGroup, dtype_bytes

if TYPE_CHECKING:
    from .engine import EngineBuffers


def require_counts(config: Any, *names: str) -> None:
    """InvalidArgument unless each field ``names`` of ``config`` is a whole number of at least
    1 (a bool is not one): a zero count divides by zero or never makes progress."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be a whole number of at least 1, not {value!r}")


@dataclass
class Geometry:
    """The model's KV shape (the default is a Llama-3-8B-like model: 32 layers, 8 KV heads of
    128, fp16: 128 KiB of KV per token). ``groups`` (``KVGroup``s: MLA, layers of different
    shapes) replaces layers, kv_heads and head_dim when given."""
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    groups: tuple[KVGroup, ...] = ()
    hidden_size: Optional[int] = None  # the model's width, when known (a model config's)

    def __post_init__(self) -> None:
        require_counts(self, "layers", "kv_heads", "head_dim")
        dtype_bytes(self.dtype)  # InvalidArgument naming the dtypes a KV cache knows
        for group in self.groups:
            require_counts(group, "layers", "kv_heads", "head_dim")
            if group.parts not in (1, 2):
                raise InvalidArgument(f"a group's parts must be 1 (one vector, MLA) or 2 (K and "
                                      f"V), not {group.parts!r}")

    @property
    def shapes(self) -> tuple[KVGroup, ...]:
        """The groups, or the one group of K and V that layers, kv_heads and head_dim make."""
        return self.groups or (KVGroup(self.layers, self.kv_heads, self.head_dim),)

    @property
    def bytes_per_token(self) -> int:
        # The KV cache's own table of dtypes, so that the replay sizes what the cache will hold.
        return sum(group.parts * group.layers * group.kv_heads * group.head_dim
                   for group in self.shapes) * dtype_bytes(self.dtype)

    def cache_shape(self) -> dict[str, Any]:
        """The KVCache keywords of this shape: layers, kv_heads and head_dim for one group of K
        and V (what contiguous mode takes), else groups."""
        shapes = self.shapes
        if len(shapes) == 1 and shapes[0].parts == 2:
            return {"layers": shapes[0].layers, "kv_heads": shapes[0].kv_heads,
                    "head_dim": shapes[0].head_dim, "dtype": self.dtype}
        return {"groups": shapes, "dtype": self.dtype}

    def describe(self) -> str:
        """The shape as --group options say it: LAYERS:KV_HEADS:HEAD_DIM[:PARTS] each."""
        return " ".join(f"{g.layers}:{g.kv_heads}:{g.head_dim}" + (":1" if g.parts == 1 else "")
                        for g in self.shapes)


@dataclass
class Timings:
    """Nanoseconds of every allocator call."""
    samples: list[int] = field(default_factory=list)

    def timed(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            self.samples.append(time.perf_counter_ns() - start)


class PagedBackend:
    name = "paged"
    #: The engine's per-step buffers around the KV cache (engine.py), when asked for.
    buffers: Optional[EngineBuffers] = None

    def __init__(self, capacity_tokens: int, block_tokens: int, geometry: Geometry,
                 pool_name: Optional[str], prefix_caching: bool, timings: Timings,
                 engine_buffers: bool = False) -> None:
        from ..kvcache import KVCache
        from ..pool import Pool
        from .engine import WORKSPACE_BYTES, EngineBuffers
        self.block_tokens = block_tokens
        self.timings = timings
        self.prefix_caching = prefix_caching
        num_blocks = max(1, capacity_tokens // block_tokens)
        self.pool: Optional[Pool] = None
        if engine_buffers:
            # One pool for the KV region and the engine's buffers beside it, as an engine's
            # two-level pool holds both; the pool publishes (and times its calls) for top.
            kv_bytes = num_blocks * block_tokens * geometry.bytes_per_token
            self.pool = Pool(kv_bytes + WORKSPACE_BYTES, name=pool_name, trace=True)
        try:
            self.cache = KVCache(num_blocks=num_blocks, block_tokens=block_tokens,
                                 name=None if self.pool else pool_name, trace=True, pool=self.pool,
                                 **geometry.cache_shape())
        except BaseException:
            if self.pool is not None:
                self.pool.close()
            raise
        if self.pool is not None:
            self.buffers = EngineBuffers(self.pool, geometry)
        self.capacity_blocks = self.cache.num_blocks

    def never_fits(self, prompt_tokens: int, final_tokens: int) -> Optional[str]:
        """Why a request of ``prompt_tokens`` that grows to ``final_tokens`` cannot complete even
        alone in this cache, or None when it can."""
        blocks = -(-final_tokens // self.block_tokens)
        if blocks > self.capacity_blocks:
            return f"{final_tokens:,} tokens need {blocks:,} blocks of the cache's {self.capacity_blocks:,}"
        return None

    def admit(self, tokens: int, keys: Optional[list[int]], final_tokens: int,
              again: bool = False, namespace: int = 0) -> Optional[tuple[Any, int]]:
        """(handle, token slots) for a request of `tokens` prompt tokens; None when full.
        ``again``: a preempted request admitted again (the cache counts it apart).
        ``namespace``: its tenant's, where its prefix is looked up and registered."""
        try:
            handle = self.timings.timed(self.cache.allocate, tokens,
                                        block_keys=keys if self.prefix_caching else None,
                                        namespace=namespace, again=again)
        except OutOfMemory:
            return None
        if self.buffers is not None:
            self.buffers.admitted(id(handle))
        return handle, self._slots(tokens)

    def pin(self, keys: Any, namespace: int) -> Optional[Any]:
        """Pins the cached blocks of ``keys`` in ``namespace`` (a system prompt) until unpin;
        None, and nothing pinned, unless every one of them was cached."""
        pin = self.timings.timed(self.cache.pin, block_keys=keys, namespace=namespace)
        if pin.num_tokens < len(keys) * self.block_tokens:
            self.timings.timed(pin.unpin)
            return None
        return pin

    def unpin(self, pin: Any) -> None:
        self.timings.timed(pin.unpin)

    def pin_figures(self) -> dict[str, int]:
        """The cache's pinned blocks now, and its evictions so far."""
        stats = self.cache.stats()
        return {"pinned_blocks": stats.pinned_blocks, "evictions": stats.evictions}

    def extend(self, handle: Any, tokens: int) -> Optional[int]:
        """Announces `tokens` more; the new token slots, or None when the cache is full."""
        try:
            self.timings.timed(handle.append, tokens)
        except OutOfMemory:
            return None
        return self._slots(handle.num_tokens)

    def _slots(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens) * self.block_tokens

    def release(self, handle: Any) -> None:
        if self.buffers is not None:
            self.buffers.released(id(handle))
        self.timings.timed(handle.free)

    def cached_tokens(self, handle: Any) -> int:
        return int(handle.num_cached_tokens)

    def usage(self) -> tuple[float, int]:
        """(share of KV memory in use, token slots allocated)."""
        used = self.cache.gauges().used_blocks  # every step: not the whole stats()
        return used / self.capacity_blocks, used * self.block_tokens

    def prefix(self) -> tuple[int, int]:
        stats = self.cache.stats()
        return stats.hit_tokens, stats.query_tokens

    def fragmentation(self) -> float:
        return 0.0  # every free block serves any request: paging has no external fragmentation

    def library_time(self) -> Optional[tuple[int, list[int]]]:
        """(ns spent inside the library, log2 histogram of call times), timed in C."""
        stats = self.cache.stats()
        return int(stats.timed_ns), list(stats.call_ns_log2)

    def hit_counters(self) -> Optional[dict[str, int]]:
        """The cache's own prefix counters: hit and queried tokens, and the part of each that
        re-admissions made."""
        stats = self.cache.stats()
        return {"hit_tokens": stats.hit_tokens, "query_tokens": stats.query_tokens,
                "readmit_hit_tokens": stats.readmit_hit_tokens,
                "readmit_query_tokens": stats.readmit_query_tokens}

    def verify_empty(self) -> None:
        """After the run: every invariant holds and no block is referenced any more."""
        self.cache.check()
        stats = self.cache.stats()
        if stats.used_blocks or stats.sequences or stats.bytes_in_use:
            raise AssertionError(f"the replay left {stats.used_blocks} blocks and {stats.sequences} "
                                 f"sequences live ({stats.bytes_in_use} bytes)")
        if self.pool is not None and self.pool.stats().live_allocations != 1:
            raise AssertionError(f"the engine's buffers left {self.pool.stats().live_allocations - 1} "
                                 "allocations live beside the KV region")

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
        self.cache.close()
        if self.pool is not None:
            self.pool.close()


#: The smallest bucket of contiguous mode, in tokens (KVA_KV_MIN_BUCKET in kvalloc.h).
CONTIGUOUS_MIN_BUCKET = 64


def contiguous_bucket(tokens: int) -> int:
    """The bucket contiguous mode gives a sequence of ``tokens``: the next power of two."""
    return max(CONTIGUOUS_MIN_BUCKET, 1 << (tokens - 1).bit_length())


class ContiguousBackend(PagedBackend):
    """The KV manager's contiguous mode: each request holds one buffer in a power-of-two bucket
    of tokens, moved to the next bucket as it grows."""
    name = "contiguous"

    def __init__(self, capacity_tokens: int, block_tokens: int, geometry: Geometry,
                 pool_name: Optional[str], prefix_caching: bool, timings: Timings) -> None:
        from ..kvcache import KVCache
        self.timings = timings
        self.prefix_caching = False       # contiguous buffers are private: no prefix sharing
        self.bytes_per_token = geometry.bytes_per_token
        self.capacity_bytes = capacity_tokens * geometry.bytes_per_token
        self.cache = KVCache(num_blocks=None, capacity_bytes=self.capacity_bytes, mode="contiguous",
                             name=pool_name, trace=True, **geometry.cache_shape())
        self.pool = None
        info = self.cache.info
        self.max_context = int(info.max_context)
        self.pool_tokens = int(info.kv_bytes) // self.bytes_per_token

    def never_fits(self, prompt_tokens: int, final_tokens: int) -> Optional[str]:
        if final_tokens > self.max_context:
            return f"{final_tokens:,} tokens exceed max_context {self.max_context:,}"
        # Growing into the next bucket allocates it while the current one is still held (the
        # data is copied across), so the last growth needs one and a half times its bucket.
        first, last = contiguous_bucket(prompt_tokens), contiguous_bucket(final_tokens)
        if last > first and last // 2 + last > self.pool_tokens:
            return (f"growing to {final_tokens:,} tokens holds buckets of {last // 2:,} and {last:,} tokens "
                    f"at once, beyond the cache's {self.pool_tokens:,}")
        return None

    def admit(self, tokens: int, keys: Optional[list[int]], final_tokens: int,
              again: bool = False, namespace: int = 0) -> Optional[tuple[Any, int]]:
        try:
            handle = self.timings.timed(self.cache.allocate, tokens, again=again)
        except OutOfMemory:
            return None
        return handle, handle.buffer[1]

    def extend(self, handle: Any, tokens: int) -> Optional[int]:
        try:
            self.timings.timed(handle.append, tokens)
        except OutOfMemory:
            return None
        return int(handle.buffer[1])

    def usage(self) -> tuple[float, int]:
        reserved = self.cache.gauges().bytes_in_use
        return reserved / self.capacity_bytes, reserved // self.bytes_per_token

    def fragmentation(self) -> float:
        return self.cache.pool_fragmentation()


class MallocBackend:
    """One malloc per request for its whole KV; budgeted to the same capacity."""
    buffers: Optional[EngineBuffers] = None  # only the library's pools carry the engine's buffers

    def __init__(self, capacity_tokens: int, geometry: Geometry, library: str, timings: Timings) -> None:
        self.name = f"malloc-{library}"
        self.prefix_caching = False
        self.timings = timings
        self.bytes_per_token = geometry.bytes_per_token
        self.capacity_tokens = capacity_tokens
        self.reserved_tokens = 0
        lib = _malloc_library(library)
        self._malloc = lib.malloc
        self._malloc.restype = ctypes.c_void_p
        self._malloc.argtypes = [ctypes.c_size_t]
        self._free = lib.free
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p]

    def never_fits(self, prompt_tokens: int, final_tokens: int) -> Optional[str]:
        need = max(prompt_tokens, final_tokens)
        if need > self.capacity_tokens:
            return f"{need:,} tokens exceed the budget of {self.capacity_tokens:,}"
        return None

    def admit(self, tokens: int, keys: Optional[list[int]], final_tokens: int,
              again: bool = False, namespace: int = 0) -> Optional[tuple[Any, int]]:
        need = max(tokens, final_tokens)
        if self.reserved_tokens + need > self.capacity_tokens:
            return None
        address = self.timings.timed(self._malloc, need * self.bytes_per_token)
        if not address:
            return None
        self.reserved_tokens += need
        return [address, need], need

    def extend(self, handle: Any, tokens: int) -> Optional[int]:
        reserved: int = handle[1]  # the whole answer was reserved on admission
        return reserved

    def release(self, handle: Any) -> None:
        self.timings.timed(self._free, handle[0])
        self.reserved_tokens -= handle[1]

    def cached_tokens(self, handle: Any) -> int:
        return 0

    def usage(self) -> tuple[float, int]:
        return self.reserved_tokens / self.capacity_tokens, self.reserved_tokens

    def prefix(self) -> tuple[int, int]:
        return 0, 0

    def fragmentation(self) -> float:
        return 0.0

    def library_time(self) -> Optional[tuple[int, list[int]]]:
        return None

    def hit_counters(self) -> Optional[dict[str, int]]:
        return None  # malloc cannot be timed from inside: the Python-side timings stand

    def verify_empty(self) -> None:
        if self.reserved_tokens:
            raise AssertionError(f"the replay left {self.reserved_tokens} tokens reserved")

    def close(self) -> None:
        pass


JEMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                      "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2")


def jemalloc_path() -> Optional[str]:
    """Where jemalloc's library is installed (Debian: libjemalloc2), or None."""
    found = ctypes.util.find_library("jemalloc")
    for path in (*JEMALLOC_CANDIDATES, found):
        if path and (path.startswith("/") and os.path.exists(path)):
            return path
    return None


def jemalloc_is_malloc() -> bool:
    """Whether jemalloc is this process's malloc (it was preloaded): its own mallocx is there."""
    return hasattr(ctypes.CDLL(None), "mallocx")


def _malloc_library(library: str) -> ctypes.CDLL:
    if library == "glibc":
        if library == "glibc" and jemalloc_is_malloc():
            raise RuntimeError("this process runs jemalloc (LD_PRELOAD): glibc's malloc is not reachable")
        return ctypes.CDLL(ctypes.util.find_library("c"))
    if library == "jemalloc":
        # jemalloc keeps its thread state in initial-exec TLS, so it cannot be dlopened into a
        # running process; it is measured in a process started with it in LD_PRELOAD, where the
        # C library's malloc is jemalloc's.
        if not jemalloc_is_malloc():
            raise FileNotFoundError("jemalloc must be preloaded (LD_PRELOAD) to be measured")
        return ctypes.CDLL(None)
    raise ValueError(f"unknown malloc library {library!r}")


def jemalloc_available() -> bool:
    return jemalloc_path() is not None
