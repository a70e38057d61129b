"""The KV-cache manager: the Python face of ``kva_kv``.

What an engine's scheduler calls::

    cache = pykvalloc.KVCache(num_blocks=4096, block_tokens=16, layers=32, kv_heads=8,
                              head_dim=128, dtype="float16")
    seq = cache.allocate(len(prompt), tokens=prompt)     # prefix caching by token ids
    seq.num_cached_tokens                                 # tokens whose KV is already there
    seq.block_table                                       # numpy uint32, no copy
    copy = seq.append(1)                                  # decoding; a CopyOnWrite or None
    child = seq.fork()                                    # beam search, parallel sampling
    seq.free()
    moves = cache.compact()                               # (src, dst) rows: data to the low ids
    cache.stats()                                         # KVStats: free/used/cached blocks, hits

Lifetime rules, each there so that no Python call can crash the interpreter (the cache owns its
C handle as every owner does: ``HandleOwner``, _owner.py):

* ``seq.block_table`` is a read-only numpy view of the table the library keeps. The library
  may move or rewrite that table when the sequence changes, so ``append()`` and ``free()``
  refuse (``TableInUseError``) while a view of it is alive, and ``cache.compact()`` while
  any view of the cache is: copy it (``np.array(...)``) to keep it longer. A view keeps its
  sequence and its cache alive.
* A sequence nobody frees is freed when it becomes garbage; a cache nobody closes is destroyed
  when it becomes garbage and no sequence or view needs it. ``close()`` is idempotent; views
  are users of the cache: with views alive the C cache is destroyed when the last one goes.
* Handles of freed sequences are recognised by the library (a generation per slot), so a stale
  ``Sequence`` gets ``InvalidArgument`` (``DoubleFree`` for a second ``free()``), never another
  sequence's blocks.
* The C cache has its own lock; this module adds one per cache for its own bookkeeping, so a
  cache may be shared between threads.
"""

from __future__ import annotations

import enum
import operator
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from ctypes import POINTER, byref, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, SupportsIndex, TypeVar

import numpy as np

if TYPE_CHECKING:
    from ctypes import _Pointer
    from typing import Union

    import numpy.typing as npt  # annotations only: numpy.typing is missing from old numpy

    # What the key and token arguments take: any iterable of integers, or a numpy integer array.
    IntegerArray = Union[Iterable[int], npt.NDArray[np.integer[Any]]]

from . import _ffi, _locks
from ._owner import HandleOwner, refuse_copy
from .errors import InvalidArgument, KvallocError, OutOfMemory
from .pool import (
    PageMode,
    Pool,
    _enum_arg,
    _name_arg,
    _pages_arg,
    _returned_address,
    _size_arg,
    _snapshot,
)

__all__ = ["KVCache", "KVStats", "KVInfo", "Sequence", "Pin", "CopyOnWrite", "Move", "KVLayout",
           "KVMode", "TableInUseError", "dtype_bytes", "DEFAULT_BLOCK_TOKENS"]

#: Tokens per block when none is given: the default of the library's ``kva_kv_config_init``
#: (test_kv checks that the two agree). A constant, so that importing the package never needs
#: the library.
DEFAULT_BLOCK_TOKENS = 16

_U32_MAX = 0xFFFFFFFF
_NO_BLOCK = _U32_MAX
PRIORITIES = 8

# Element sizes of the dtypes a KV cache is kept in; names as numpy, torch ("torch.float16")
# and engines ("fp8", "bf16") spell them.
_DTYPE_BYTES = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e4m3": 1, "float8_e5m2": 1,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}


class KVLayout(enum.IntEnum):
    """Where (block, layer, K|V) lives (``kva_kv_layout``)."""

    BLOCKS = 0  # a block holds all its layers: [block][layer][K|V]
    LAYERS = 1  # one region per layer, indexed by block id: [layer][block][K|V]


class KVMode(enum.IntEnum):
    """``kva_kv_mode``."""

    PAGED = 0       # blocks, block tables, prefix caching, fork
    CONTIGUOUS = 1  # one buffer per sequence in a power-of-two bucket of tokens


class TableInUseError(KvallocError, BufferError):
    """A sequence cannot change while numpy views of its block table are alive: the library may
    move or rewrite the table they show. Copy the table to keep it (``np.array(view)``)."""


class CopyOnWrite(NamedTuple):
    """After ``append``: the last block was shared; copy its first ``tokens`` tokens, every
    layer's K and V, from block ``src`` to block ``dst`` (the sequence now holds ``dst``)."""

    src: int
    dst: int
    tokens: int


class Move(NamedTuple):
    """After ``append`` in contiguous mode: the sequence moved from the buffer at address
    ``src`` (a bucket of ``src_bucket`` tokens) to ``dst`` (``dst_bucket`` tokens). For each
    layer l and part p (0 K, 1 V), copy ``tokens`` slots of ``slot_bytes`` from
    ``src + (2l+p)*src_bucket*slot_bytes`` to ``dst + (2l+p)*dst_bucket*slot_bytes``. The old
    buffer stays allocated until the sequence's next append or free."""

    src: int
    dst: int
    tokens: int
    src_bucket: int
    dst_bucket: int


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a dtype given as a name, a numpy dtype or a torch dtype."""
    if dtype is None:  # numpy reads None as float64; a KV cache's element type is never implied
        raise InvalidArgument("dtype must be given (a name such as 'float16', or a numpy or torch dtype)")
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        name = str(dtype).lower().removeprefix("torch.")
        if name not in _DTYPE_BYTES:
            try:
                numpy_dtype = np.dtype(dtype)  # type: ignore[call-overload]  # any object is tried
            except TypeError:
                numpy_dtype = None
            if numpy_dtype is not None and numpy_dtype.kind in "fiu" and numpy_dtype.itemsize in (1, 2, 4, 8):
                return int(numpy_dtype.itemsize)
    if name not in _DTYPE_BYTES:
        raise InvalidArgument(f"unknown KV dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _u32(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name} must be an integer, not {type(value).__name__}")
    number = int(value)
    if not 0 <= number <= _U32_MAX:
        raise InvalidArgument(f"{name} {number} is outside 0 .. 2^32-1")
    return number


def _array_arg(name: str, values: IntegerArray | None, dtype: type[np.uint32] | type[np.uint64]
               ) -> npt.NDArray[np.unsignedinteger[Any]] | None:
    """A C-contiguous array of exactly dtype for a pointer argument (no copy when it is one).

    Anything but an array is read item by item: numpy would make a float64 array of a list that
    mixes 64-bit keys at or above 2**63 with smaller ones (and a 0-d object array of a
    generator), where every item is a valid key."""
    if values is None:
        return None
    if isinstance(values, np.ndarray):
        array = values
    else:
        try:
            items = list(values)
        except TypeError:
            raise InvalidArgument(f"{name} must be an iterable of integers, not "
                                  f"{type(values).__name__}") from None
        limit = int(np.iinfo(dtype).max)
        for item in items:
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                raise InvalidArgument(f"{name} must hold integers, not {type(item).__name__}")
            if not 0 <= item <= limit:
                raise InvalidArgument(f"{name} holds values outside {np.dtype(dtype)}")
        array = np.array(items, dtype=dtype)
    if array.size > 0xFFFFFFFF:  # the C counts are 32-bit
        raise InvalidArgument(f"{name} holds {array.size} values; at most {0xFFFFFFFF}")
    if array.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, not of shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, not {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
        raise InvalidArgument(f"{name} holds values outside {np.dtype(dtype)}")
    return np.ascontiguousarray(array, dtype=dtype)


_CType = TypeVar("_CType", c_uint32, c_uint64)


def _pointer(array: npt.NDArray[Any] | None, ctype: type[_CType]) -> _Pointer[_CType] | None:
    return None if array is None else array.ctypes.data_as(POINTER(ctype))


class _TableAnchor:
    """The numpy base object of a block-table view: it keeps its sequence alive."""

    __slots__ = ("sequence", "_interface", "__weakref__")

    def __init__(self, sequence: Sequence, address: int, length: int) -> None:
        self.sequence = sequence
        self._interface = {"version": 3, "shape": (length,), "typestr": "<u4",
                           "data": (address, True)}

    @property
    def __array_interface__(self) -> dict[str, object]:
        return self._interface


@dataclass(frozen=True)
class KVInfo:
    """The geometry of a KV cache (``kva_kv_info``; kvalloc.h describes each figure)."""

    mode: KVMode
    layout: KVLayout
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int
    num_blocks: int      # paged mode; 0 in contiguous mode
    max_context: int     # contiguous mode: the largest bucket; 0 in paged mode
    block_bytes: int     # all layers, K and V, of one block
    token_bytes: int     # all layers, K and V, of one token
    slot_bytes: int      # K (or V) of one token in one layer
    part_bytes: int      # K (or V) of one block in one layer
    block_stride: int
    layer_stride: int
    base: int            # paged mode: the address of the KV memory (block 0, layer 0, K)
    kv_bytes: int        # paged: num_blocks * block_bytes; contiguous: the pool's capacity

    @classmethod
    def _from_c(cls, raw: _ffi.KvaKvInfo) -> KVInfo:
        return _snapshot(cls, raw, mode=KVMode(raw.mode), layout=KVLayout(raw.layout),
                         base=raw.base or 0)


@dataclass(frozen=True)
class KVStats:
    """A snapshot of ``kva_kv_stats``; see kvalloc.h for the exact meaning of each figure."""

    num_blocks: int
    free_blocks: int           # hold nothing
    used_blocks: int           # referenced by live sequences or pins
    cached_blocks: int         # referenced by none, kept for prefix hits, evictable
    registered_blocks: int     # with a key in the prefix table
    sequences: int             # live sequences, pins excluded
    pins: int
    trimmed_blocks: int        # free, their memory given back (trim)
    hit_tokens: int            # cached tokens summed over allocations
    query_tokens: int          # tokens summed over allocations
    evictions: int
    cow_copies: int
    forks: int
    allocations: int
    frees: int
    appends: int
    moves: int                 # contiguous mode: bucket changes; paged mode: compaction moves
    moved_bytes: int
    alloc_failures: int
    rejected_calls: int
    bytes_in_use: int          # KV bytes held by sequences
    block_metadata_bytes: int
    metadata_bytes: int        # all host bytes of the cache's bookkeeping
    # A cache created with trace=True times every call, lock to lock; zero otherwise.
    timed_calls: int
    timed_ns: int
    call_ns_log2: tuple[int, ...]  # calls that took [2^i, 2^(i+1)) ns

    @property
    def hit_rate(self) -> float:
        """The share of the tokens asked for that the prefix cache held (0 before any)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @classmethod
    def _from_c(cls, raw: _ffi.KvaKvStats) -> KVStats:
        return _snapshot(cls, raw, call_ns_log2=tuple(raw.call_ns_log2))


class KVCache(HandleOwner):
    """A KV cache of ``num_blocks`` blocks of ``block_tokens`` tokens (or ``capacity_bytes``
    bytes' worth), for a model with ``layers`` layers of ``kv_heads`` KV heads of ``head_dim``
    elements of ``dtype`` (a name such as ``"float16"`` or ``"fp8"``, a numpy or a torch dtype).

    ``layout``: ``"layers"`` (default; one region per layer, a block id indexes each, what
    paged-attention kernels index) or ``"blocks"`` (all layers of a block together).
    ``mode="contiguous"`` gives each sequence one buffer in a power-of-two bucket of tokens (64
    .. ``max_context``) instead of blocks. ``hash_seed`` keys the prefix hashes (a secret random
    value keeps clients from precomputing them). The memory comes from a pool the cache creates
    (``pages`` as for ``Pool``, default transparent huge pages) or from ``pool``, an open
    ``pykvalloc.Pool``; closing that pool before the cache closes it to its own calls, and
    destroys it once the cache is gone. ``name`` names the pool the cache creates,
    which then publishes the pool's and the cache's statistics for ``kvalloc top`` (``trace``
    also times every call); a given ``pool`` brings its own name.
    """

    __slots__ = ("_lib", "_pool_lock", "_info", "_pool_handle")

    def __init__(self, num_blocks: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 dtype: object = "float16", *, capacity_bytes: int | None = None,
                 layout: str | KVLayout = "layers", mode: str | KVMode = "paged",
                 max_context: int | None = None, hash_seed: int = 0, pool: Pool | None = None,
                 pages: str | PageMode = "thp", name: str | None = None,
                 trace: bool = False) -> None:
        lib = _ffi.load()
        config = _ffi.KvaKvConfig()
        lib.kva_kv_config_init(byref(config))
        config.layers = _u32("layers", layers)
        config.kv_heads = _u32("kv_heads", kv_heads)
        config.head_dim = _u32("head_dim", head_dim)
        config.dtype_bytes = dtype_bytes(dtype)
        config.block_tokens = _u32("block_tokens", block_tokens)
        config.num_blocks = 0 if num_blocks is None else _u32("num_blocks", num_blocks)
        if capacity_bytes is not None:
            config.capacity_bytes = _size_arg("capacity_bytes", capacity_bytes)
        config.layout = _enum_arg("layout", layout, KVLayout)
        config.mode = _enum_arg("mode", mode, KVMode)
        config.max_context = 0 if max_context is None else _u32("max_context", max_context)
        try:
            seed = operator.index(hash_seed) if not isinstance(hash_seed, bool) else None
        except TypeError:
            seed = None
        if seed is None or not 0 <= seed < 1 << 64:
            raise InvalidArgument("hash_seed must be an integer in 0 .. 2^64-1")
        config.hash_seed = seed
        config.pages = _pages_arg(pages)
        config.name = _name_arg(name)  # C copies the name at creation
        config.trace = 1 if trace else 0
        if pool is not None and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be a pykvalloc.Pool, not {type(pool).__name__}")

        def create(pool_handle: int | None) -> int:
            handle = c_void_p()
            lib.kva_kv_create(byref(config), pool_handle, byref(handle))
            return _returned_address(handle, "kva_kv_create")

        handle = self._create_over(pool, create)
        self._own(handle, lib.kva_kv_destroy, pool)
        self._lib = lib
        # The lock of a caller's Pool, which serializes the Python calls into its C pool: the
        # cache takes it for its own (creation, destruction, contiguous buffers).
        self._pool_lock = pool._lock if pool is not None else None
        info = _ffi.KvaKvInfo()
        lib.kva_kv_get_info(handle, byref(info))
        self._info = KVInfo._from_c(info)
        # The C pool the memory comes from (a caller's, or the one C made for the cache).
        self._pool_handle: int = info.pool

    def _describe(self) -> str:
        info = self._info
        return (f"{info.mode.name.lower()} {info.num_blocks} blocks of {info.block_tokens} "
                f"tokens, {info.block_bytes} bytes each,")

    def _pool_guard(self) -> AbstractContextManager[object]:
        return self._pool_lock if self._pool_lock is not None else _NO_LOCK

    # -- the pool -----------------------------------------------------------------------------

    def pool_fragmentation(self) -> float:
        """The fragmentation (1 - largest free block / free bytes) of the pool the cache's
        memory comes from: what limits contiguous mode."""
        raw = _ffi.KvaStats()
        with self._lock, self._pool_guard():
            self._open_handle()
            self._lib.kva_get_stats(self._pool_handle, byref(raw))
        return float(raw.fragmentation)

    def publish(self) -> None:
        """Publishes the statistics of the cache's pool, the cache's own section included, now
        (a named cache; otherwise nothing happens). A named cache also publishes on its own from
        its calls, at most every ``publish_interval_ms`` of its pool."""
        with self._lock, self._pool_guard():
            self._open_handle()
            self._lib.kva_stats_publish(self._pool_handle)

    # -- sequences --------------------------------------------------------------------------

    def allocate(self, num_tokens: int, block_keys: IntegerArray | None = None,
                 tokens: IntegerArray | None = None, namespace: int = 0,
                 priority: int = 0) -> Sequence:
        """A sequence of ``num_tokens`` tokens. The content of its first full blocks is given as
        ``block_keys`` (one 64-bit key per block, such as a trace's hash ids) or as ``tokens``
        (token ids; their whole blocks are hashed); the longest cached prefix is reused
        (``num_cached_tokens``) and the other given blocks are cached for later requests.
        Blocks are shared only within one ``namespace``. ``priority`` (0..7): lower priorities'
        blocks are evicted first. ``OutOfMemory`` if the blocks are not there, with nothing
        changed."""
        n = _u32("num_tokens", num_tokens)
        keys = _array_arg("block_keys", block_keys, np.uint64)
        ids = _array_arg("tokens", tokens, np.uint32)
        ns = _u32("namespace", namespace)
        prio = _u32("priority", priority)
        seq = c_uint64()
        cached = c_uint32()
        with self._lock, self._pool_guard():
            self._lib.kva_kv_seq_allocate(
                self._open_handle(), n, _pointer(keys, c_uint64), 0 if keys is None else keys.size,
                _pointer(ids, c_uint32), 0 if ids is None else ids.size, ns, prio, byref(seq),
                byref(cached))
        return Sequence._new(self, seq.value, cached.value)

    def pin(self, block_keys: IntegerArray | None = None,
            tokens: IntegerArray | None = None, namespace: int = 0) -> Pin:
        """Pins the longest cached prefix of the given blocks: it is not evicted until
        ``unpin()``. ``Pin.num_tokens`` says how much was cached and is pinned now."""
        keys = _array_arg("block_keys", block_keys, np.uint64)
        ids = _array_arg("tokens", tokens, np.uint32)
        ns = _u32("namespace", namespace)
        handle = c_uint64()
        pinned = c_uint32()
        with self._lock:
            self._lib.kva_kv_pin(self._open_handle(), _pointer(keys, c_uint64),
                                 0 if keys is None else keys.size, _pointer(ids, c_uint32),
                                 0 if ids is None else ids.size, ns, byref(handle), byref(pinned))
        return Pin._new(self, handle.value, pinned.value)

    def evict(self, max_blocks: int | None = None) -> int:
        """Evicts up to ``max_blocks`` cached blocks now (all of them by default), least
        recently used and lowest priority first. Returns how many."""
        count = _U32_MAX if max_blocks is None else _u32("max_blocks", max_blocks)
        evicted = c_uint32()
        with self._lock:
            self._lib.kva_kv_evict(self._open_handle(), count, byref(evicted))
        return evicted.value

    def compact(self) -> npt.NDArray[np.uint32]:
        """Moves every block that holds data (used, or cached for prefix hits: those keep their
        hits; ``evict()`` first to drop them instead) to the lowest ids, so that afterwards the
        free blocks are the top ids, ``used_blocks + cached_blocks`` onwards: the tail of
        the KV memory (of each layer's region with the layers layout). Every sequence's and
        pin's block table is rewritten in place, so this refuses (``TableInUseError``) while any
        block-table view of the cache is alive.

        Returns the moves as a numpy uint32 array of shape (n, 2), rows (src, dst): copy every
        layer's K and V of block src to block dst. No block is both a source and a destination,
        so the copies may run in any order or as one batch (``kv[:, dst] = kv[:, src]``); they
        must all be done before the next forward pass, and any pending ``CopyOnWrite`` before
        this call. Paged mode only (``InvalidArgument`` otherwise)."""
        count = c_uint32()
        with self._lock:
            if self._users:  # the block-table views are the cache's users
                raise TableInUseError(
                    f"cannot compact: {self._users} block_table view(s) alive; copy the tables "
                    "(np.array(seq.block_table)) or drop the views first")
            handle = self._open_handle()
            capacity = 0
            while True:
                moves = np.empty((capacity, 2), dtype=np.uint32)
                try:
                    self._lib.kva_kv_compact(handle, moves.ctypes.data if capacity else None,
                                             capacity, byref(count))
                except OutOfMemory:
                    capacity = count.value  # the size the library asked for; nothing changed
                    continue
                return moves[:count.value]

    def trim(self) -> int:
        """Gives back the memory of the free blocks at the top ids: after ``compact()`` every
        free block is there, so compacting then trimming frees every whole GPU granule (or host
        page) of the KV memory that holds no data. Their content is gone: every copy
        ``compact()`` returned (its sources are free top blocks) and any kernel still reading a
        freed block must be finished, the device synchronized, before this call. The trimmed
        blocks still count as free for capacity: a call that needs them maps their memory again
        first (or evicts cached blocks if the memory cannot be had). A pool whose memory must
        stay (prefault, lock, pin, checked, hugetlb) gives nothing back. Returns the number of trimmed
        blocks (``stats().trimmed_blocks``). Paged mode only (``InvalidArgument``
        otherwise)."""
        trimmed = c_uint32()
        with self._lock:
            self._lib.kva_kv_trim(self._open_handle(), byref(trimmed))
        return trimmed.value

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> KVStats:
        """Counters and gauges: free_blocks, used_blocks, cached_blocks, hit_tokens,
        query_tokens, evictions, cow_copies, forks, ... and hit_rate."""
        raw = _ffi.KvaKvStats()
        with self._lock:
            self._lib.kva_kv_get_stats(self._open_handle(), byref(raw))
        return KVStats._from_c(raw)

    def check(self) -> None:
        """Walks every invariant of the cache; ``CorruptionError`` names the first broken one."""
        with self._lock, self._pool_guard():
            self._lib.kva_kv_check(self._open_handle())

    def block_address(self, block: int, layer: int, kind: str | int = "K") -> int:
        """The address of the K (``kind="K"``) or V part of one layer of one block."""
        part = None
        if isinstance(kind, str):
            part = {"k": 0, "v": 1}.get(kind.lower())
        elif isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and kind in (0, 1):
            part = int(kind)
        if part is None:
            raise InvalidArgument(f"kind must be 'K' or 'V', not {kind!r}")
        out = c_void_p()
        with self._lock:
            self._lib.kva_kv_block_address(self._open_handle(), _u32("block", block),
                                           _u32("layer", layer), part, byref(out))
        return out.value or 0

    @property
    def info(self) -> KVInfo:
        """The geometry: block_bytes, token_bytes, slot_bytes, part_bytes, block_stride,
        layer_stride, base (address), kv_bytes, num_blocks, max_context, mode, layout, ..."""
        return self._info

    @property
    def num_blocks(self) -> int:
        return self._info.num_blocks

    @property
    def block_tokens(self) -> int:
        return self._info.block_tokens

    @property
    def block_bytes(self) -> int:
        return self._info.block_bytes


_NO_LOCK = nullcontext()


def _free_forgotten(cache: KVCache, handle: int, pin: bool) -> None:
    """A finalizer: a sequence or pin became garbage without being freed."""
    locks = [cache._lock] + ([cache._pool_lock] if cache._pool_lock is not None else [])
    _locks.run_or_defer(locks, _free_forgotten_locked, cache, handle, pin)


def _free_forgotten_locked(cache: KVCache, handle: int, pin: bool) -> None:
    if cache._closed:
        return
    try:
        (cache._lib.kva_kv_unpin if pin else cache._lib.kva_kv_seq_free)(cache._handle, handle)
    except KvallocError:
        pass  # freed another way already; nothing to give back


_Seq = TypeVar("_Seq", bound="Sequence")


class Sequence:
    """One request's KV: a block table (paged) or a buffer (contiguous). Made by
    ``KVCache.allocate`` and ``Sequence.fork``."""

    __slots__ = ("_cache", "_handle", "_cached", "_views", "_freed", "_finalizer", "__weakref__")
    _is_pin = False

    _cache: KVCache
    _handle: int
    _cached: int
    _views: int  # block-table views alive: users of the cache
    _freed: bool
    _finalizer: weakref.finalize[..., Sequence]

    @classmethod
    def _new(cls: type[_Seq], cache: KVCache, handle: int, cached: int) -> _Seq:
        self = cls.__new__(cls)
        self._cache = cache
        self._handle = handle
        self._cached = cached
        self._views = 0
        self._freed = False
        self._finalizer = weakref.finalize(self, _free_forgotten, cache, handle, cls._is_pin)
        self._finalizer.atexit = False
        return self

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("sequences come from KVCache.allocate() and Sequence.fork()")

    @property
    def handle(self) -> int:
        """The library's handle (``kva_kv_seq``)."""
        return self._handle

    @property
    def num_cached_tokens(self) -> int:
        """Tokens found in the prefix cache when the sequence was allocated."""
        return self._cached

    def _seq_info(self) -> _ffi.KvaKvSeqInfo:
        raw = _ffi.KvaKvSeqInfo()
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_seq_get_info(cache._open_handle(), self._handle, byref(raw))
        return raw

    @property
    def num_tokens(self) -> int:
        return int(self._seq_info().num_tokens)

    @property
    def num_blocks(self) -> int:
        return int(self._seq_info().num_blocks)

    @property
    def namespace(self) -> int:
        return int(self._seq_info().namespace_id)

    @property
    def priority(self) -> int:
        return int(self._seq_info().priority)

    @property
    def buffer(self) -> tuple[int, int]:
        """Contiguous mode: (address, bucket_tokens) of the sequence's buffer."""
        raw = self._seq_info()
        return (raw.buffer or 0, raw.bucket_tokens)

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def block_table(self) -> npt.NDArray[np.uint32]:
        """The block ids, in order, as a read-only numpy uint32 view of the library's table (no
        copy). While it is alive, ``append()`` and ``free()`` refuse: see the module docs."""
        cache = self._cache
        table = POINTER(c_uint32)()
        length = c_uint32()
        with cache._lock:
            cache._lib.kva_kv_seq_block_table(cache._open_handle(), self._handle, byref(table),
                                              byref(length))
            address = c_void_p.from_buffer(table).value or 0
            anchor = _TableAnchor(self, address, length.value)
            # The view is a user of the cache: a close() leaves the C cache to the last view.
            released = weakref.finalize(anchor, cache._user_gone, self)
            released.atexit = False
            cache._add_user(self)
        view: npt.NDArray[np.uint32] = np.asarray(anchor)
        view.flags.writeable = False
        return view

    def _refuse_with_views(self, what: str) -> None:
        if self._views:
            raise TableInUseError(
                f"cannot {what} {self!r}: {self._views} block_table view(s) alive; copy the table "
                "(np.array(seq.block_table)) or drop the views first")

    def append(self, num_tokens: int = 1) -> CopyOnWrite | Move | None:
        """Grows the sequence by ``num_tokens`` (decoding). Returns what the engine must copy
        first (a ``CopyOnWrite`` of the shared last block, or in contiguous mode a ``Move``),
        else None. ``OutOfMemory`` with nothing changed if the blocks are not there."""
        n = _u32("num_tokens", num_tokens)
        copy = _ffi.KvaKvCopy()
        cache = self._cache
        with cache._lock, cache._pool_guard():
            self._refuse_with_views("append to")
            cache._lib.kva_kv_seq_append(cache._open_handle(), self._handle, n, byref(copy))
        if copy.src_block != _NO_BLOCK:
            return CopyOnWrite(copy.src_block, copy.dst_block, copy.tokens)
        if copy.src:
            return Move(copy.src, copy.dst or 0, copy.tokens, copy.src_bucket, copy.dst_bucket)
        return None

    def fork(self) -> Sequence:
        """A new sequence sharing every block of this one (reference counted); the first append
        into a shared, partly filled last block copies it (see ``append``)."""
        child = c_uint64()
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_seq_fork(cache._open_handle(), self._handle, byref(child))
        return Sequence._new(cache, child.value, self._cached)

    def free(self) -> None:
        """Releases the sequence: its blocks lose a reference; full prefix blocks stay cached
        until evicted. A second ``free()`` raises ``DoubleFree``."""
        cache = self._cache
        with cache._lock, cache._pool_guard():
            self._refuse_with_views("free")
            self._release_call(cache)(cache._open_handle(), self._handle)
            self._freed = True
            self._finalizer.detach()

    def _release_call(self, cache: KVCache) -> Callable[[int, int], int]:
        return cache._lib.kva_kv_seq_free

    def __enter__(self: _Seq) -> _Seq:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._freed:
            self.free()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"<pykvalloc.{type(self).__name__} {self._handle:#x} {state}>"


class Pin(Sequence):
    """A pinned prefix (``KVCache.pin``): never evicted until ``unpin()``."""

    __slots__ = ()
    _is_pin = True

    @property
    def num_tokens(self) -> int:
        """Tokens pinned."""
        return self._cached

    def unpin(self) -> None:
        self.free()

    def _release_call(self, cache: KVCache) -> Callable[[int, int], int]:
        return cache._lib.kva_kv_unpin

    def append(self, num_tokens: int = 1) -> NoReturn:
        raise InvalidArgument("a pin does not grow")

    def fork(self) -> Sequence:
        raise InvalidArgument("a pin cannot be forked")

