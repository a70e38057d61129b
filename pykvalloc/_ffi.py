"""The one place that knows libkvalloc's C ABI.

It finds the shared library once, mirrors the public structs of ``kvalloc.h`` field for field,
and declares every C function exactly once with its argument types, result type and error
check. Everything else in the package calls through ``load()``.

Where the library comes from, first match wins:

1. ``$PYKVALLOC_LIB``, the path of a library file. When it is set nothing else is tried: an
   explicit choice that silently fell back to another copy would hide the mistake.
2. A ``libkvalloc.so*`` inside the package directory, where the wheel puts it. Every entry of
   the package ``__path__`` is searched, because an editable install splits the package between
   the source tree (the .py files) and site-packages (the library CMake installed).
3. ``<repository>/build/libkvalloc.so``, for a run straight from a source checkout after
   ``cmake --build build``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterable
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint8,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import LibraryNotFoundError, error_for_status

ENV_VAR = "PYKVALLOC_LIB"

# Constants of kvalloc.h that shape the structs below.
KVA_MAX_ORDERS = 48
KVA_NUM_SIZE_CLASSES = 49
KVA_NAME_MAX = 63
KVA_SLAB_MIN_SIZE = 16
KVA_SLAB_MAX_SIZE = 65536
# And of kvalloc_kv.h.
KVA_KV_MAX_KEY_BYTES = 32
KVA_KV_PRIORITIES = 8
KVA_KV_AGAIN = 0x80            # ORed into an admission's priority: a re-admission
KVA_KV_NAMESPACE_SLOTS = 32
KVA_KV_CALL_KINDS = 6
KVA_KV_LATENCY_BUCKETS = 40
KVA_KV_CALL_SAMPLE_PERIOD = 128
# kva_kv_call_kind, by value: the kinds of KV call whose latencies are kept apart.
KV_CALL_KINDS = ("allocate", "append", "free", "lookup", "evict", "other")

# The C enums are plain ints on every ABI the library targets (System V x86-64 and AArch64).
c_enum = c_int


class KvaConfig(Structure):
    """struct kva_config."""

    _fields_ = [
        ("capacity", c_size_t),
        ("min_block", c_size_t),
        ("slab_chunk", c_size_t),
        ("name", c_char_p),
        ("pages", c_enum),
        ("prefault", c_int),
        ("trace", c_int),
        ("publish_interval_ms", c_uint),
        ("backend", c_enum),
        ("device", c_int),
        ("numa_node", c_int),
        ("numa_policy", c_enum),
        ("lock", c_int),
        ("pin", c_int),
        ("trim_watermark", c_size_t),
        ("checked", c_int),
        ("arenas", c_uint),
        ("external", c_void_p),
        ("shared", c_int),
    ]


class KvaStats(Structure):
    """struct kva_stats."""

    _fields_ = [
        ("capacity", c_size_t),
        ("min_block", c_size_t),
        ("slab_chunk", c_size_t),
        ("max_alloc_size", c_size_t),
        ("bytes_in_use", c_size_t),
        ("bytes_free", c_size_t),
        ("slab_bytes", c_size_t),
        ("slab_free_bytes", c_size_t),
        ("largest_free", c_size_t),
        ("fragmentation", c_double),
        ("num_orders", c_uint32),
        ("free_blocks", c_uint64 * KVA_MAX_ORDERS),
        ("live_allocations", c_uint64),
        ("alloc_count", c_uint64),
        ("free_count", c_uint64),
        ("alloc_failures", c_uint64),
        ("rejected_calls", c_uint64),
        ("slab_count", c_uint64),
        ("page_kind", c_enum),
        ("page_size", c_size_t),
        ("metadata_bytes", c_size_t),
        ("numa_node", c_int32),
        ("backend", c_uint32),
        ("mapped_bytes", c_size_t),
        ("pinned", c_int),
        ("locked", c_int),
        ("arenas", c_uint32),
        ("thread_caches", c_uint32),
        ("cached_bytes", c_size_t),
        ("remote_frees", c_uint64),
        ("peak_block_bytes", c_size_t),
        ("peak_bytes_in_use", c_size_t),
    ]


class KvaClassStats(Structure):
    """struct kva_class_stats."""

    _fields_ = [
        ("object_size", c_uint32),
        ("objects_per_slab", c_uint32),
        ("live_objects", c_uint64),
        ("slabs", c_uint64),
    ]


class KvaKvGroup(Structure):
    """struct kva_kv_group."""

    _fields_ = [
        ("layers", c_uint32),
        ("parts", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
    ]


class KvaKvLayer(Structure):
    """struct kva_kv_layer."""

    _fields_ = [
        ("group", c_uint32),
        ("parts", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("slot_bytes", c_size_t),
        ("part_bytes", c_size_t),
        ("block_stride", c_size_t),
        ("offset", c_size_t),
    ]


class KvaKvConfig(Structure):
    """struct kva_kv_config."""

    _fields_ = [
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("block_tokens", c_uint32),
        ("num_blocks", c_uint32),
        ("capacity_bytes", c_size_t),
        ("mode", c_enum),
        ("layout", c_enum),
        ("max_context", c_uint32),
        ("max_key_bytes", c_uint32),
        ("hash_seed", c_uint64),
        ("pages", c_enum),
        ("event_capacity", c_uint32),
        ("name", c_char_p),
        ("trace", c_int),
        ("event_medium", c_uint32),
        ("groups", POINTER(KvaKvGroup)),
        ("num_groups", c_uint32),
    ]


class KvaKvInfo(Structure):
    """struct kva_kv_info."""

    _fields_ = [
        ("mode", c_enum),
        ("layout", c_enum),
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("block_tokens", c_uint32),
        ("num_blocks", c_uint32),
        ("max_context", c_uint32),
        ("block_bytes", c_size_t),
        ("token_bytes", c_size_t),
        ("slot_bytes", c_size_t),
        ("part_bytes", c_size_t),
        ("block_stride", c_size_t),
        ("layer_stride", c_size_t),
        ("base", c_void_p),
        ("kv_bytes", c_size_t),
        ("pool", c_void_p),
    ]


class KvaKvCopy(Structure):
    """struct kva_kv_copy."""

    _fields_ = [
        ("src_block", c_uint32),
        ("dst_block", c_uint32),
        ("tokens", c_uint32),
        ("src_bucket", c_uint32),
        ("dst_bucket", c_uint32),
        ("src", c_void_p),
        ("dst", c_void_p),
    ]


class KvaKvSeqInfo(Structure):
    """struct kva_kv_seq_info."""

    _fields_ = [
        ("num_tokens", c_uint32),
        ("num_blocks", c_uint32),
        ("cached_tokens", c_uint32),
        ("namespace_id", c_uint32),
        ("priority", c_uint32),
        ("is_pin", c_uint32),
        ("bucket_tokens", c_uint32),
        ("namespace_hi", c_uint32),
        ("buffer", c_void_p),
    ]


class KvaKvStats(Structure):
    """struct kva_kv_stats."""

    _fields_ = [
        ("num_blocks", c_uint32),
        ("free_blocks", c_uint32),
        ("used_blocks", c_uint32),
        ("cached_blocks", c_uint32),
        ("registered_blocks", c_uint32),
        ("sequences", c_uint32),
        ("pins", c_uint32),
        ("trimmed_blocks", c_uint32),
        ("hit_tokens", c_uint64),
        ("query_tokens", c_uint64),
        ("evictions", c_uint64),
        ("cow_copies", c_uint64),
        ("forks", c_uint64),
        ("allocations", c_uint64),
        ("frees", c_uint64),
        ("appends", c_uint64),
        ("moves", c_uint64),
        ("moved_bytes", c_uint64),
        ("alloc_failures", c_uint64),
        ("rejected_calls", c_uint64),
        ("bytes_in_use", c_size_t),
        ("block_metadata_bytes", c_size_t),
        ("metadata_bytes", c_size_t),
        ("timed_calls", c_uint64),
        ("timed_ns", c_uint64),
        ("call_ns_log2", c_uint64 * KVA_KV_LATENCY_BUCKETS),
        ("peak_used_blocks", c_uint32),
        ("peak_cached_blocks", c_uint32),
        ("peak_bytes_in_use", c_size_t),
        ("call_sample_period", c_uint32),
        ("reserved", c_uint32),
        ("kind_timed_calls", c_uint64 * KVA_KV_CALL_KINDS),
        ("kind_timed_ns", c_uint64 * KVA_KV_CALL_KINDS),
        ("kind_ns_log2", (c_uint64 * KVA_KV_LATENCY_BUCKETS) * KVA_KV_CALL_KINDS),
        ("pinned_blocks", c_uint32),
        ("reserved2", c_uint32),
        ("readmit_hit_tokens", c_uint64),
        ("readmit_query_tokens", c_uint64),
    ]


class KvaKvNamespaceShare(Structure):
    """struct kva_kv_namespace_share."""

    _fields_ = [
        ("namespace_id", c_uint64),
        ("is_other", c_uint32),
        ("sequences", c_uint32),
        ("pins", c_uint32),
        ("reserved", c_uint32),
        ("blocks", c_uint64),
        ("registered_blocks", c_uint64),
    ]


class KvaKvContent(Structure):
    """struct kva_kv_content: how a request's blocks are named. The arrays are numpy buffers,
    passed by address."""

    _fields_ = [
        ("kind", c_uint32),
        ("key_len", c_uint32),
        ("tokens", c_void_p),
        ("keys", c_void_p),
        ("key_bytes", c_void_p),
    ]


class KvaKvStep(Structure):
    """struct kva_kv_step: a decode step's arrays (DecodeStep fills it once)."""

    _fields_ = [
        ("seqs", c_void_p),
        ("num_tokens", c_void_p),
        ("content", POINTER(KvaKvContent)),
        ("offsets", c_void_p),
        ("copies", c_void_p),
        ("num_copies", c_uint32),
        ("done", c_uint32),
    ]


class KvaKvBlockCopy(Structure):
    """struct kva_kv_block_copy (read as a numpy uint32 array of shape (n, 4))."""

    _fields_ = [
        ("request", c_uint32),
        ("src_block", c_uint32),
        ("dst_block", c_uint32),
        ("tokens", c_uint32),
    ]


class KvaKvEvent(Structure):
    """struct kva_kv_event (read as a numpy array of EVENT_DTYPE)."""

    _fields_ = [
        ("kind", c_uint32),
        ("block", c_uint32),
        ("namespace_id", c_uint64),
        ("first_token", c_uint32),
        ("num_tokens", c_uint32),
        ("medium", c_uint32),
        ("key_len", c_uint8),
        ("parent_len", c_uint8),
        ("library_key", c_uint8),
        ("reserved", c_uint8),
        ("key", c_uint8 * KVA_KV_MAX_KEY_BYTES),
        ("parent", c_uint8 * KVA_KV_MAX_KEY_BYTES),
    ]


class KvaVarConfig(Structure):
    """struct kva_var_config."""

    _fields_ = [
        ("capacity", c_size_t),
        ("alignment", c_size_t),
        ("policy", c_enum),
        ("pages", c_enum),
    ]


class KvaVarStats(Structure):
    """struct kva_var_stats."""

    _fields_ = [
        ("capacity", c_size_t),
        ("alignment", c_size_t),
        ("policy", c_uint32),
        ("reserved", c_uint32),
        ("bytes_used", c_size_t),
        ("bytes_requested", c_size_t),
        ("internal_waste", c_size_t),
        ("bytes_free", c_size_t),
        ("largest_free", c_size_t),
        ("fragmentation", c_double),
        ("free_ranges", c_uint64),
        ("live_allocations", c_uint64),
        ("alloc_count", c_uint64),
        ("free_count", c_uint64),
        ("alloc_failures", c_uint64),
        ("rejected_calls", c_uint64),
        ("metadata_bytes", c_size_t),
        ("peak_bytes_used", c_size_t),
    ]


# Each family of structs in the order of its sizeof query (kva_struct_size, kva_kv_struct_size,
# kva_var_struct_size: ids from 1 in header order), by C name.
POOL_STRUCTS = {"kva_config": KvaConfig, "kva_stats": KvaStats, "kva_class_stats": KvaClassStats}
KV_STRUCTS = {"kva_kv_config": KvaKvConfig, "kva_kv_info": KvaKvInfo, "kva_kv_copy": KvaKvCopy,
              "kva_kv_seq_info": KvaKvSeqInfo, "kva_kv_stats": KvaKvStats,
              "kva_kv_content": KvaKvContent, "kva_kv_block_copy": KvaKvBlockCopy,
              "kva_kv_event": KvaKvEvent, "kva_kv_group": KvaKvGroup, "kva_kv_layer": KvaKvLayer,
              "kva_kv_step": KvaKvStep, "kva_kv_namespace_share": KvaKvNamespaceShare}
VAR_STRUCTS = {"kva_var_config": KvaVarConfig, "kva_var_stats": KvaVarStats}
# Every mirrored struct, for the ABI test that compiles a probe against the header.
STRUCTS = {**POOL_STRUCTS, **KV_STRUCTS, **VAR_STRUCTS}

# int (*kva_walk_fn)(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx)
WALK_FN = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_enum, c_void_p)

if TYPE_CHECKING:
    from ctypes import _CArgObject, _CFunctionType, _Pointer
    from typing import Optional

    # What the declared functions take and return, as Python sees it. An opaque C object
    # (kva_pool *, kva_kv *, kva_var *) is the int its create function returned; an address may
    # be NULL (None); an out-parameter or a struct goes by reference (byref), and an optional
    # one may be NULL.
    Handle = int
    Address = Optional[int]
    Ref = _CArgObject
    OptRef = Optional[_CArgObject]
    Keys = Optional[_Pointer[c_uint64]]
    Tokens = Optional[_Pointer[c_uint32]]


class _Declaration:
    """One C function's signature, written once in KvaLib's body; KvaLib.__init__ looks the
    function up and applies it."""

    __slots__ = ("restype", "argtypes", "returns_status")

    def __init__(self, restype: Any, argtypes: tuple[Any, ...], returns_status: bool) -> None:
        self.restype = restype
        self.argtypes = list(argtypes)
        self.returns_status = returns_status


def _status(*argtypes: Any) -> Any:
    """A function returning a ``kva_status``: a failing status raises its KvallocError. Typed
    ``Any`` so that the attribute's annotation, the Python signature, is what mypy sees."""
    return _Declaration(c_enum, argtypes, True)


def _plain(restype: Any, *argtypes: Any) -> Any:
    """A function whose result is returned as it is."""
    return _Declaration(restype, argtypes, False)


_pool = c_void_p  # kva_pool *, kva_kv * and kva_var * are opaque: only passed back to the library
_kv = c_void_p
_var = c_void_p
_shared = c_void_p  # kva_shared_map *
_seq = c_uint64  # kva_kv_seq


class KvaLib:
    """The loaded library with every public function declared, each once, below: the Python
    signature mypy checks callers against, then the C one ctypes converts with.

    Functions that return a ``kva_status`` raise the matching ``KvallocError`` subclass instead
    of returning it, so callers never look at status codes.
    """

    # -- pools (kva_*) ------------------------------------------------------------------------
    kva_strerror: Callable[[int], bytes] = _plain(c_char_p, c_enum)
    kva_last_error: Callable[[], bytes] = _plain(c_char_p)
    kva_config_init: Callable[[Ref], None] = _plain(None, POINTER(KvaConfig))
    kva_pool_create: Callable[[Ref, Ref], int] = _status(POINTER(KvaConfig), POINTER(_pool))
    kva_pool_destroy: Callable[[Handle], None] = _plain(None, _pool)
    kva_alloc: Callable[[Handle, int, Ref], int] = _status(_pool, c_size_t, POINTER(c_void_p))
    kva_alloc_aligned: Callable[[Handle, int, int, Ref], int] = _status(
        _pool, c_size_t, c_size_t, POINTER(c_void_p))
    kva_alloc_exact: Callable[[Handle, int, Ref], int] = _status(_pool, c_size_t,
                                                                 POINTER(c_void_p))
    kva_alloc_array: Callable[[Handle, int, int, Ref], int] = _status(
        _pool, c_size_t, c_size_t, POINTER(c_void_p))
    kva_free: Callable[[Handle, Address], int] = _status(_pool, c_void_p)
    kva_usable_size: Callable[[Handle, Address], int] = _plain(c_size_t, _pool, c_void_p)
    kva_trim: Callable[[Handle], int] = _status(_pool)
    kva_thread_flush: Callable[[Handle], int] = _status(_pool)
    kva_check: Callable[[Handle], int] = _status(_pool)
    kva_reset_peaks: Callable[[Handle], int] = _status(_pool)
    kva_pool_base: Callable[[Handle, Ref], int] = _status(_pool, POINTER(c_void_p))
    kva_get_stats: Callable[[Handle, Ref], int] = _status(_pool, POINTER(KvaStats))
    kva_size_class_size: Callable[[int], int] = _plain(c_size_t, c_uint)
    kva_size_class_of: Callable[[int], int] = _plain(c_int, c_size_t)
    kva_get_class_stats: Callable[[Handle, int, Ref], int] = _status(
        _pool, c_uint, POINTER(KvaClassStats))
    kva_walk: Callable[[Handle, _CFunctionType, Address], int] = _status(_pool, WALK_FN, c_void_p)
    kva_version: Callable[[], bytes] = _plain(c_char_p)
    kva_struct_size: Callable[[int], int] = _plain(c_size_t, c_enum)
    kva_stats_publish: Callable[[Handle], int] = _status(_pool)
    kva_stats_segment_name: Callable[[Handle], bytes | None] = _plain(c_char_p, _pool)
    kva_pool_shared_fd: Callable[[Handle, Ref], int] = _status(_pool, POINTER(c_int))
    kva_shared_attach: Callable[[int, Ref], int] = _status(c_int, POINTER(_shared))
    kva_shared_attach_cuda: Callable[[int, int, int, Ref], int] = _status(c_int, c_int, c_size_t,
                                                                          POINTER(_shared))
    kva_shared_base: Callable[[Handle], int | None] = _plain(c_void_p, _shared)
    kva_shared_length: Callable[[Handle], int] = _plain(c_size_t, _shared)
    kva_shared_detach: Callable[[Handle], None] = _plain(None, _shared)

    # -- the KV-cache manager (kva_kv_*) ------------------------------------------------------
    kva_kv_config_init: Callable[[Ref], None] = _plain(None, POINTER(KvaKvConfig))
    kva_kv_block_bytes: Callable[[Ref, Ref], int] = _status(POINTER(KvaKvConfig),
                                                            POINTER(c_size_t))
    kva_kv_create: Callable[[Ref, Handle | None, Ref], int] = _status(
        POINTER(KvaKvConfig), _pool, POINTER(_kv))
    kva_kv_destroy: Callable[[Handle], None] = _plain(None, _kv)
    kva_kv_get_info: Callable[[Handle, Ref], int] = _status(_kv, POINTER(KvaKvInfo))
    kva_kv_block_address: Callable[[Handle, int, int, int, Ref], int] = _status(
        _kv, c_uint32, c_uint32, c_enum, POINTER(c_void_p))
    kva_kv_layer_info: Callable[[Handle, int, Ref], int] = _status(
        _kv, c_uint32, POINTER(KvaKvLayer))
    kva_kv_seq_allocate: Callable[[Handle, int, Keys, int, Tokens, int, int, int, Ref, Ref],
                                  int] = _status(
        _kv, c_uint32, POINTER(c_uint64), c_uint32, POINTER(c_uint32), c_uint32, c_uint32,
        c_uint32, POINTER(_seq), POINTER(c_uint32))
    kva_kv_seq_append: Callable[[Handle, int, int, Ref], int] = _status(
        _kv, _seq, c_uint32, POINTER(KvaKvCopy))
    kva_kv_seq_fork: Callable[[Handle, int, Ref], int] = _status(_kv, _seq, POINTER(_seq))
    kva_kv_seq_free: Callable[[Handle, int], int] = _status(_kv, _seq)
    kva_kv_seq_block_table: Callable[[Handle, int, Ref, Ref], int] = _status(
        _kv, _seq, POINTER(POINTER(c_uint32)), POINTER(c_uint32))
    kva_kv_seq_get_info: Callable[[Handle, int, Ref], int] = _status(_kv, _seq,
                                                                     POINTER(KvaKvSeqInfo))
    kva_kv_pin: Callable[[Handle, Keys, int, Tokens, int, int, Ref, Ref], int] = _status(
        _kv, POINTER(c_uint64), c_uint32, POINTER(c_uint32), c_uint32, c_uint32, POINTER(_seq),
        POINTER(c_uint32))
    kva_kv_unpin: Callable[[Handle, int], int] = _status(_kv, _seq)
    # The content calls: a kva_kv_content by reference, whose arrays are numpy buffers given by
    # address, as are the arrays of every call below (Address: a numpy array's ctypes.data).
    kva_kv_seq_admit: Callable[[Handle, int, int, int, OptRef, int, Ref, OptRef], int] = _status(
        _kv, c_uint32, c_uint64, c_uint32, POINTER(KvaKvContent), c_uint32, POINTER(_seq),
        POINTER(c_uint32))
    kva_kv_seq_extend: Callable[[Handle, int, int, OptRef, int, Ref], int] = _status(
        _kv, _seq, c_uint32, POINTER(KvaKvContent), c_uint32, POINTER(KvaKvCopy))
    kva_kv_pin_content: Callable[[Handle, int, OptRef, int, Ref, OptRef], int] = _status(
        _kv, c_uint64, POINTER(KvaKvContent), c_uint32, POINTER(_seq), POINTER(c_uint32))
    kva_kv_lookup: Callable[[Handle, int, OptRef, int, Address, Ref], int] = _status(
        _kv, c_uint64, POINTER(KvaKvContent), c_uint32, c_void_p, POINTER(c_uint32))
    # Batches: per-request arrays (u32 num_tokens, u64 namespaces, u8 priorities, u64 handles,
    # u64 offsets, kva_kv_block_copy rows) by address.
    kva_kv_seq_admit_many: Callable[[Handle, int, Address, Address, Address, OptRef, Address,
                                     Address, Address, Ref], int] = _status(
        _kv, c_uint32, c_void_p, c_void_p, c_void_p, POINTER(KvaKvContent), c_void_p, c_void_p,
        c_void_p, POINTER(c_uint32))
    kva_kv_seq_extend_many: Callable[[Handle, int, Address, Address, OptRef, Address, Address,
                                      Ref, Ref], int] = _status(
        _kv, c_uint32, c_void_p, c_void_p, POINTER(KvaKvContent), c_void_p, c_void_p,
        POINTER(c_uint32), POINTER(c_uint32))
    kva_kv_seq_extend_step: Callable[[Handle, Ref, int], int] = _status(
        _kv, POINTER(KvaKvStep), c_uint32)
    kva_kv_seq_free_many: Callable[[Handle, int, Address], int] = _status(_kv, c_uint32, c_void_p)
    kva_kv_lookup_many: Callable[[Handle, int, Address, OptRef, Address, Address, Address],
                                 int] = _status(
        _kv, c_uint32, c_void_p, POINTER(KvaKvContent), c_void_p, c_void_p, c_void_p)
    # The block calls: u32 block ids and engine keys (key_len bytes each) by address.
    kva_kv_block_take: Callable[[Handle, int, int, Address], int] = _status(
        _kv, c_uint32, c_uint32, c_void_p)
    kva_kv_block_unref: Callable[[Handle, Address, int], int] = _status(_kv, c_void_p, c_uint32)
    kva_kv_block_ref: Callable[[Handle, Address, int], int] = _status(_kv, c_void_p, c_uint32)
    kva_kv_block_commit: Callable[[Handle, int, Address, int, Address, int, bytes | None, int,
                                   Address], int] = _status(
        _kv, c_uint64, c_void_p, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32, c_void_p)
    kva_kv_evict_blocks: Callable[[Handle, Address, int, Ref], int] = _status(
        _kv, c_void_p, c_uint32, POINTER(c_uint32))
    kva_kv_evict_keys: Callable[[Handle, int, Address, int, int, Ref], int] = _status(
        _kv, c_uint64, c_void_p, c_uint32, c_uint32, POINTER(c_uint32))
    kva_kv_reset_prefix_cache: Callable[[Handle], int] = _status(_kv)
    # kva_kv_event rows: a numpy array of EVENT_DTYPE, by address.
    kva_kv_take_events: Callable[[Handle, Address, int, Ref, Ref], int] = _status(
        _kv, c_void_p, c_uint32, POINTER(c_uint32), POINTER(c_uint64))
    kva_kv_evict: Callable[[Handle, int, OptRef], int] = _status(_kv, c_uint32, POINTER(c_uint32))
    kva_kv_reset_peaks: Callable[[Handle], int] = _status(_kv)
    # kva_kv_move is two u32 (src_block, dst_block): passed as a numpy (n, 2) uint32 array.
    kva_kv_compact: Callable[[Handle, Address, int, Ref], int] = _status(
        _kv, c_void_p, c_uint32, POINTER(c_uint32))
    kva_kv_trim: Callable[[Handle, Ref], int] = _status(_kv, POINTER(c_uint32))
    kva_kv_get_stats: Callable[[Handle, Ref], int] = _status(_kv, POINTER(KvaKvStats))
    kva_kv_check: Callable[[Handle], int] = _status(_kv)
    kva_kv_namespaces: Callable[[Handle, Ref, int, Ref], int] = _status(
        _kv, POINTER(KvaKvNamespaceShare), c_uint32, POINTER(c_uint32))
    kva_kv_struct_size: Callable[[int], int] = _plain(c_size_t, c_enum)

    # -- variable-size pools (kva_var_*) ------------------------------------------------------
    kva_var_config_init: Callable[[Ref], None] = _plain(None, POINTER(KvaVarConfig))
    kva_var_backing_config: Callable[[Ref, Ref], int] = _status(POINTER(KvaVarConfig),
                                                                POINTER(KvaConfig))
    kva_var_create: Callable[[Ref, Handle | None, Ref], int] = _status(
        POINTER(KvaVarConfig), _pool, POINTER(_var))
    kva_var_destroy: Callable[[Handle], None] = _plain(None, _var)
    kva_var_alloc: Callable[[Handle, int, Ref], int] = _status(_var, c_size_t, POINTER(c_void_p))
    kva_var_free: Callable[[Handle, Address], int] = _status(_var, c_void_p)
    kva_var_usable_size: Callable[[Handle, Address], int] = _plain(c_size_t, _var, c_void_p)
    kva_var_base: Callable[[Handle, Ref], int] = _status(_var, POINTER(c_void_p))
    kva_var_get_stats: Callable[[Handle, Ref], int] = _status(_var, POINTER(KvaVarStats))
    kva_var_check: Callable[[Handle], int] = _status(_var)
    kva_var_reset_peaks: Callable[[Handle], int] = _status(_var)
    kva_var_struct_size: Callable[[int], int] = _plain(c_size_t, c_int)

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._dll = ctypes.CDLL(str(path))
        except OSError as exc:
            raise LibraryNotFoundError(f"cannot load libkvalloc from {path}: {exc}") from exc
        for name, declaration in vars(KvaLib).items():
            if isinstance(declaration, _Declaration):
                self._declare(name, declaration)
        self._check_struct_sizes(self.kva_struct_size, POOL_STRUCTS.values())
        self._check_struct_sizes(self.kva_kv_struct_size, KV_STRUCTS.values())
        self._check_struct_sizes(self.kva_var_struct_size, VAR_STRUCTS.values())

    def _check_struct_sizes(self, native_size: Callable[[int], int],
                            structs: Iterable[type[Structure]]) -> None:
        # The structs here are copies of the header's; a library of another version would read
        # or write past them. Refuse it before the first call instead. ``native_size`` is the
        # library's sizeof query for that family of structs, numbered from 1 in header order.
        for which, struct in enumerate(structs, start=1):
            native = native_size(which)
            if native != ctypes.sizeof(struct):
                raise LibraryNotFoundError(
                    f"{self.path} (version {self.kva_version().decode()}) has a "
                    f"{struct.__name__} of {native} bytes, this package expects "
                    f"{ctypes.sizeof(struct)}: set {ENV_VAR} to a matching build")

    def _declare(self, name: str, declaration: _Declaration) -> None:
        try:
            function = getattr(self._dll, name)
        except AttributeError as exc:
            raise LibraryNotFoundError(
                f"{self.path} does not export {name}: it is not a libkvalloc this package "
                f"matches (set {ENV_VAR} to the right build)") from exc
        function.restype = declaration.restype
        function.argtypes = declaration.argtypes
        if declaration.returns_status:
            function.errcheck = self._raise_on_failure
        setattr(self, name, function)

    def _raise_on_failure(self, status: int, function: Any, _args: object) -> int:
        # ctypes calls this on the thread that made the call, right after it, so
        # kva_last_error() still describes this very failure (it is per thread in C).
        if status != 0:
            self.raise_status(status, function.__name__)
        return status

    def raise_status(self, status: int, function_name: str) -> NoReturn:
        """The exception of a failed call's status, with kva_last_error()'s detail: called on
        the thread that made the call, before any other call of the library."""
        name = self.kva_strerror(status).decode("utf-8", "replace")
        detail = self.kva_last_error().decode("utf-8", "replace")
        raise error_for_status(status, name, detail, function_name)

    def untyped(self, name: str) -> Any:
        """A declared function as a function object without argument types, returning a C int
        (a status): ctypes then converts nothing, which halves the cost of a call of three
        arguments (about 200 ns against 450). The caller passes each argument as a ctypes
        object of its exact C type (``c_void_p`` for a handle, ``byref`` for a pointer) or as a
        Python int for a 32-bit integer (ctypes passes an int as a C int, whose 32 bits are the
        uint32's), and tests the status itself."""
        getattr(self, name)  # declared: the library exports it
        function = self._dll[name]
        function.restype = c_int
        return function


def candidate_paths() -> list[Path]:
    """Where ``load()`` looks, in order; see the module docstring."""
    override = os.environ.get(ENV_VAR)
    if override:
        return [Path(override)]
    candidates: list[Path] = []
    package = sys.modules[__package__]
    for directory in getattr(package, "__path__", [str(Path(__file__).parent)]):
        found = sorted(Path(directory).glob("libkvalloc.so*"), key=_prefer_plain_name)
        candidates.extend(found or [Path(directory) / "libkvalloc.so"])
    candidates.append(Path(__file__).resolve().parent.parent / "build" / "libkvalloc.so")
    return candidates


def _prefer_plain_name(path: Path) -> tuple[int, str]:
    # libkvalloc.so before libkvalloc.so.0 before libkvalloc.so.0.1.0: every name is the same
    # library, and the shortest is the one a symlinked install would point users at.
    return (len(path.name), path.name)


def find_library() -> Path:
    """The path ``load()`` would use; LibraryNotFoundError naming every path tried if none."""
    candidates = candidate_paths()
    for path in candidates:
        if path.is_file():
            return path
    tried = "\n  ".join(str(path) for path in candidates)
    hint = (f"{ENV_VAR} is set, so only that path is used"
            if os.environ.get(ENV_VAR) else
            f"install pykvalloc with pip, build with cmake, or set {ENV_VAR}")
    raise LibraryNotFoundError(f"libkvalloc not found; tried:\n  {tried}\n({hint})")


@functools.cache
def load() -> KvaLib:
    """The process-wide library handle, loaded on first use."""
    return KvaLib(find_library())
