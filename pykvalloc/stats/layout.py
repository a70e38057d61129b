"""The layout of a statistics segment, as kvalloc_stats.h declares it: the structs as numpy
dtypes, the section kinds and capability bits, and what a writer of an older minor version of the
layout did not write yet."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

MAGIC = 0x315441545341564B  # "KVASTAT1" as a little-endian u64
ABI_MAJOR = 1
ABI_MINOR = 5
MAX_SECTIONS = 16
LATENCY_BUCKETS = 40
STRIP_CELLS = 64
# The most of each a writer makes (segment.c, kvalloc_stats.h): a count above is corruption,
# and a reader must not expand it.
HEAPMAP_CELLS_MAX = 16384
SLABS_MAX = 65536             # KVA_SHM_SLABS_MAX
TRACE_RECORDS_MAX = 1 << 16   # the writer's ring holds 1,024; later layouts may hold more
KV_SEQ_ENTRIES_MAX = 1024     # the writer's sequences section has room for 16 (KVA_SHM_KV_SEQ_ENTRIES)
KV_SEQ_TABLE_MAX = 1 << 16    # and 128 block ids an entry (KVA_SHM_KV_SEQ_TABLE)
KV_NAMESPACE_ROWS_MAX = 1024  # and 33 namespace rows (KVA_SHM_KV_NAMESPACE_ROWS)

SECTION_SUMMARY, SECTION_HEAPMAP, SECTION_CLASSES, SECTION_SLABS = 1, 2, 3, 4
SECTION_ARENAS, SECTION_LATENCY, SECTION_KV, SECTION_TRACE = 5, 6, 7, 8
SECTION_KV_SEQUENCES, SECTION_KV_NAMESPACES = 9, 10  # 1.5
SECTION_NAMES = {SECTION_SUMMARY: "summary", SECTION_HEAPMAP: "heap map",
                 SECTION_CLASSES: "classes", SECTION_SLABS: "slabs", SECTION_ARENAS: "arenas",
                 SECTION_LATENCY: "latency", SECTION_KV: "kv", SECTION_TRACE: "trace",
                 SECTION_KV_SEQUENCES: "kv sequences", SECTION_KV_NAMESPACES: "kv namespaces"}

CAP_TRACE_ALL = 1 << 8        # trace on: every call recorded and timed
CAP_LIVENESS_LOCK = 1 << 9    # the writer holds a shared flock on the segment while alive

# Heap-map cell states (kvalloc_stats.h, KVA_SHM_CELL_*); CELL_KV_PINNED since 1.5. A state past
# these (a newer writer's) is read as CELL_MIXED.
CELL_FREE, CELL_BLOCK, CELL_SLAB, CELL_MIXED, CELL_KV_USED, CELL_KV_CACHED, CELL_KV_PINNED = range(7)
CELL_NAMES = ("free", "block", "slab", "mixed", "kv used", "kv cached", "kv pinned")
# The order that breaks a tie between in-use states when cells are merged: the KV bar's (pinned,
# used, cached), as the writer breaks ties between a cell's blocks.
CELL_TIE_ORDER = (CELL_BLOCK, CELL_SLAB, CELL_MIXED, CELL_KV_PINNED, CELL_KV_USED, CELL_KV_CACHED)

OP_NAMES = {1: "alloc", 2: "free", 3: "alloc_aligned", 4: "alloc_exact", 5: "trim"}
STATUS_NAMES = {0: "ok", 1: "out of memory", 2: "invalid", 3: "double free", 4: "bad pointer",
                5: "backend", 6: "corrupt"}
NO_OFFSET = (1 << 64) - 1

# align=True lays the fields out as a C compiler does; "<" because the segment is little-endian
# whatever machine reads it. tests/python/test_stats_layout.py checks every offset against the
# compiler's.
SECTION_DTYPE = np.dtype([("kind", "<u4"), ("reserved", "<u4"), ("offset", "<u8"),
                          ("size", "<u8")], align=True)
HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("abi_major", "<u2"), ("abi_minor", "<u2"), ("header_size", "<u4"),
    ("capabilities", "<u8"), ("sequence", "<u8"), ("segment_size", "<u8"),
    ("writer_pid", "<u4"), ("section_count", "<u4"), ("start_time_ns", "<u8"),
    ("heartbeat_ns", "<u8"), ("publish_count", "<u8"), ("pool_name", "S64"),
    ("sections", SECTION_DTYPE, (MAX_SECTIONS,)),
], align=True)
SUMMARY_COUNTERS = ("capacity", "min_block", "slab_chunk", "max_alloc_size", "bytes_in_use",
                    "bytes_free", "slab_bytes", "slab_free_bytes", "largest_free",
                    "live_allocations", "alloc_count", "free_count", "alloc_failures",
                    "rejected_calls", "slab_count", "metadata_bytes", "page_size")
SUMMARY_ADDED_1_1 = ("publish_interval_ms", "backend", "numa_node", "flags", "mapped_bytes")
SUMMARY_ADDED_1_4 = ("peak_block_bytes", "peak_bytes_in_use")
SUMMARY_DTYPE = np.dtype(
    [(name, "<u8") for name in SUMMARY_COUNTERS]
    + [("page_kind", "<u4"), ("num_orders", "<u4"), ("fragmentation", "<f8"),
       ("free_blocks", "<u8", (48,)), ("unusable_index", "<f8", (48,)),
       # 1.1
       ("publish_interval_ms", "<u4"), ("backend", "<u4"), ("numa_node", "<i4"), ("flags", "<u4"),
       ("mapped_bytes", "<u8"),
       # 1.4
       ("peak_block_bytes", "<u8"), ("peak_bytes_in_use", "<u8")], align=True)
HEAPMAP_DTYPE = np.dtype([("cells", "<u4"), ("cell_blocks", "<u4"), ("cell_bytes", "<u8")],
                         align=True)
COUNTED_DTYPE = np.dtype([("count", "<u4"), ("entry_size", "<u4")], align=True)  # classes, arenas
CLASS_DTYPE = np.dtype([("object_size", "<u4"), ("objects_per_slab", "<u4"),
                        ("live_objects", "<u8"), ("slabs", "<u8"), ("allocs", "<u8"),
                        ("frees", "<u8")], align=True)
SLABS_DTYPE = np.dtype([("count", "<u4"), ("capacity", "<u4")], align=True)
SLAB_DTYPE = np.dtype([("chunk", "<u4"), ("size_class", "<u2"), ("reserved", "<u2"),
                       ("inuse", "<u4"), ("objects", "<u4"), ("strip", "u1", (STRIP_CELLS,))],
                      align=True)
ARENA_DTYPE = np.dtype([("slabs", "<u8"), ("slab_bytes", "<u8"), ("spare_slabs", "<u8"),
                        ("word_claims", "<u8"), ("numa_node", "<i8")], align=True)
LATENCY_DTYPE = np.dtype([("alloc", "<u8", (LATENCY_BUCKETS,)),
                          ("free", "<u8", (LATENCY_BUCKETS,))], align=True)
KV_COUNTERS = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "hit_tokens",
               "query_tokens", "evictions", "cow_copies", "forks", "live_sequences",
               "block_bytes")
# 1.4: the peaks and bytes in use, and the latency of the cache's calls per kind (kvalloc_kv.h's
# kva_kv_call_kind), log2 histograms of a sample of the calls (one in call_sample_period).
KV_ADDED_1_4 = ("peak_used_blocks", "peak_cached_blocks", "peak_bytes_in_use", "bytes_in_use")
KV_CALL_KINDS = ("allocate", "append", "free", "lookup", "evict", "other")
# 1.5: distinct blocks held by live pins, and the part of hit_tokens / query_tokens that
# re-admissions (preempted requests admitted again) made.
KV_ADDED_1_5 = ("pinned_blocks", "readmit_hit_tokens", "readmit_query_tokens")
KV_DTYPE = np.dtype([("present", "<u4"), ("block_tokens", "<u4")]
                    + [(name, "<u8") for name in KV_COUNTERS]
                    + [(name, "<u8") for name in KV_ADDED_1_4]
                    + [("call_sample_period", "<u4"), ("call_kinds", "<u4"),
                       ("call_timed", "<u8", (len(KV_CALL_KINDS),)),
                       ("call_ns", "<u8", (len(KV_CALL_KINDS),)),
                       ("call_ns_log2", "<u8", (len(KV_CALL_KINDS), LATENCY_BUCKETS))]
                    + [(name, "<u8") for name in KV_ADDED_1_5], align=True)
# 1.5: the longest live sequences and pins, each with the start of its block table.
KV_SEQ_TABLE = 128            # KVA_SHM_KV_SEQ_TABLE: the ids an entry of this writer holds
KV_SEQ_PIN = 1 << 0           # KVA_SHM_KV_SEQ_PIN: the entry is a pin
KV_SEQUENCES_DTYPE = np.dtype([("count", "<u4"), ("entry_size", "<u4"), ("capacity", "<u4"),
                               ("table_capacity", "<u4"), ("live_sequences", "<u8"),
                               ("live_pins", "<u8"), ("longest_tokens", "<u8"),
                               ("longest_handle", "<u8")], align=True)
KV_SEQUENCE_DTYPE = np.dtype([("handle", "<u8"), ("namespace_id", "<u8"), ("num_tokens", "<u8"),
                              ("cached_tokens", "<u8"), ("blocks", "<u4"), ("priority", "<u4"),
                              ("flags", "<u4"), ("table_len", "<u4"),
                              ("table", "<u4", (KV_SEQ_TABLE,))], align=True)
# Every entry's fields before its table, at the same offsets in every minor version; the table
# starts at KV_SEQUENCE_TABLE_AT and holds the section's table_capacity ids.
KV_SEQUENCE_HEAD_DTYPE = np.dtype([("handle", "<u8"), ("namespace_id", "<u8"),
                                   ("num_tokens", "<u8"), ("cached_tokens", "<u8"),
                                   ("blocks", "<u4"), ("priority", "<u4"), ("flags", "<u4"),
                                   ("table_len", "<u4")], align=True)
KV_SEQUENCE_TABLE_AT = KV_SEQUENCE_HEAD_DTYPE.itemsize  # == offsetof(kva_shm_kv_sequence, table)
# 1.5: each namespace's share; the row flagged KV_NS_OTHER pools the untracked namespaces.
KV_NAMESPACE_SLOTS = 32       # KVA_SHM_KV_NAMESPACE_SLOTS
KV_NS_OTHER = 1 << 0          # KVA_SHM_KV_NS_OTHER
KV_NAMESPACES_DTYPE = np.dtype([("count", "<u4"), ("entry_size", "<u4"), ("capacity", "<u4"),
                                ("reserved", "<u4")], align=True)
KV_NAMESPACE_DTYPE = np.dtype([("namespace_id", "<u8"), ("flags", "<u4"), ("reserved", "<u4"),
                               ("sequences", "<u8"), ("pins", "<u8"), ("blocks", "<u8"),
                               ("registered_blocks", "<u8")], align=True)
TRACE_DTYPE = np.dtype([("capacity", "<u4"), ("entry_size", "<u4"), ("written", "<u8")],
                       align=True)
RECORD_DTYPE = np.dtype([("time_ns", "<u8"), ("offset", "<u8"), ("size", "<u8"),
                         ("thread", "<u4"), ("op", "u1"), ("status", "u1"),
                         ("reserved", "<u2")], align=True)

# The bytes of a struct that every writer of this major version writes, for the structs a later
# minor version grew at their end: an older writer's shorter struct lacks the fields after them.
# Layout 1.0 ends the summary before its 1.1 fields; the arena entry of 1.2 first lacked
# numa_node; the KV section before 1.4 ends at block_bytes. (Before 1.2 an arena entry held
# other counters under the same bytes, see Snapshot.__init__.)


def struct_fields(dtype: np.dtype[Any]) -> dict[str, tuple[np.dtype[Any], int]]:
    """The fields of one of the struct dtypes above, in order: name -> (its dtype, its offset)."""
    fields, names = dtype.fields, dtype.names
    if fields is None or names is None:
        raise TypeError(f"{dtype} is not a struct")
    return {name: (fields[name][0], fields[name][1]) for name in names}


OLDEST_SIZE = {SUMMARY_DTYPE: struct_fields(SUMMARY_DTYPE)["publish_interval_ms"][1],
               ARENA_DTYPE: struct_fields(ARENA_DTYPE)["numa_node"][1],
               KV_DTYPE: struct_fields(KV_DTYPE)["peak_used_blocks"][1]}
KV_SECTIONS_SINCE_MINOR = 5   # the KV sequences and namespaces sections
ARENAS_SINCE_MINOR = 2

# The header fields a reader takes on their own, from the live file, before or around a copy.
U64 = struct.Struct("<Q")
IDENTITY = struct.Struct("<QHH")  # magic, abi_major, abi_minor: where every version has them
SEQUENCE_AT = struct_fields(HEADER_DTYPE)["sequence"][1]
CAPABILITIES_AT = struct_fields(HEADER_DTYPE)["capabilities"][1]
CAPABILITIES_END = CAPABILITIES_AT + 8
SEGMENT_SIZE_AT = struct_fields(HEADER_DTYPE)["segment_size"][1]
