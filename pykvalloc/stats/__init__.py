"""Reading a named pool's live statistics segment, from any process (layout: kvalloc_stats.h).

A pool created with a name publishes its state in ``/dev/shm/kvalloc.<pid>.<name>``. This package
finds those files, opens one read-only and copies consistent snapshots out of it:

    >>> from pykvalloc import stats
    >>> with stats.open_segment("engine") as segment:       # a pid, a pool name or a path
    ...     snap = segment.snapshot()
    ...     print(snap.pool_name, snap.summary["bytes_in_use"], snap.latency_percentiles("alloc"))

The writer is another program that may be buggy, older, newer, killed half way, or not a kvalloc
at all, so nothing it wrote is trusted; each module keeps one part of that:

* ``layout``: the structs of kvalloc_stats.h as numpy dtypes, and what older minor versions lack.
* ``files``: opening what is at a segment's path: read-only, never through a symbolic link, never
  blocking, a regular file only.
* ``liveness``: whether the writer lives: its liveness lock, else its pid and start time (/proc);
  never the heartbeat.
* ``discovery``: the segment files of a directory, and the one a pid, a pool name or a path names.
* ``reader``: ``Segment``, which copies the file with ``pread`` (never a mapping) under the
  writer's sequence lock.
* ``snapshot``: ``Snapshot``, the copy parsed, every offset and count checked before use.
* ``figures``: what people read off a snapshot (percentiles, the heap map fitted to a width, ages).

Each way a segment can be wrong raises its own ``SegmentError`` subclass (``pykvalloc.errors``).
"""

from __future__ import annotations

from .discovery import SegmentFile, find_segment, list_segments
from .figures import downsample_cells, format_age, kv_shares, latency_percentiles, use_label
from .files import SHM_DIR
from .layout import (
    ABI_MAJOR,
    ABI_MINOR,
    ARENA_DTYPE,
    CAP_LIVENESS_LOCK,
    CAP_TRACE_ALL,
    CELL_BLOCK,
    CELL_FREE,
    CELL_KV_CACHED,
    CELL_KV_PINNED,
    CELL_KV_USED,
    CELL_MIXED,
    CELL_NAMES,
    CELL_SLAB,
    CLASS_DTYPE,
    COUNTED_DTYPE,
    HEADER_DTYPE,
    HEAPMAP_DTYPE,
    KV_ADDED_1_4,
    KV_ADDED_1_5,
    KV_CALL_KINDS,
    KV_COUNTERS,
    KV_DTYPE,
    KV_NAMESPACE_DTYPE,
    KV_NAMESPACE_SLOTS,
    KV_NAMESPACES_DTYPE,
    KV_NS_OTHER,
    KV_SEQ_PIN,
    KV_SEQ_TABLE,
    KV_SEQUENCE_DTYPE,
    KV_SEQUENCES_DTYPE,
    LATENCY_BUCKETS,
    LATENCY_DTYPE,
    MAGIC,
    MAX_SECTIONS,
    OP_NAMES,
    RECORD_DTYPE,
    SECTION_ARENAS,
    SECTION_CLASSES,
    SECTION_DTYPE,
    SECTION_HEAPMAP,
    SECTION_KV,
    SECTION_KV_NAMESPACES,
    SECTION_KV_SEQUENCES,
    SECTION_LATENCY,
    SECTION_NAMES,
    SECTION_SLABS,
    SECTION_SUMMARY,
    SECTION_TRACE,
    SLAB_DTYPE,
    SLABS_DTYPE,
    STATUS_NAMES,
    STRIP_CELLS,
    SUMMARY_ADDED_1_1,
    SUMMARY_ADDED_1_4,
    SUMMARY_COUNTERS,
    SUMMARY_DTYPE,
    TRACE_DTYPE,
)
from .liveness import (
    IDLE_AFTER_S,
    lock_abandoned,
    process_name,
    process_start_time,
    writer_alive,
    writer_holds_lock,
    writer_lives,
)
from .reader import MAX_SEGMENT_BYTES, SNAPSHOT_ATTEMPTS, Segment, open_segment
from .snapshot import KvNamespaceShare, KvSequenceEntry, KvSequences, Snapshot

__all__ = [
    # finding and opening segments
    "SHM_DIR",
    "SegmentFile",
    "Segment",
    "Snapshot",
    "KvSequences",
    "KvSequenceEntry",
    "KvNamespaceShare",
    "list_segments",
    "find_segment",
    "open_segment",
    "MAX_SEGMENT_BYTES",
    "SNAPSHOT_ATTEMPTS",
    # the writer's liveness
    "writer_alive",
    "writer_holds_lock",
    "lock_abandoned",
    "writer_lives",
    "process_name",
    "process_start_time",
    "IDLE_AFTER_S",
    # figures
    "latency_percentiles",
    "downsample_cells",
    "format_age",
    "kv_shares",
    "use_label",
    # the layout
    "MAGIC",
    "ABI_MAJOR",
    "ABI_MINOR",
    "MAX_SECTIONS",
    "LATENCY_BUCKETS",
    "STRIP_CELLS",
    "SECTION_SUMMARY",
    "SECTION_HEAPMAP",
    "SECTION_CLASSES",
    "SECTION_SLABS",
    "SECTION_ARENAS",
    "SECTION_LATENCY",
    "SECTION_KV",
    "SECTION_TRACE",
    "SECTION_KV_SEQUENCES",
    "SECTION_KV_NAMESPACES",
    "SECTION_NAMES",
    "CAP_TRACE_ALL",
    "CAP_LIVENESS_LOCK",
    "CELL_FREE",
    "CELL_BLOCK",
    "CELL_SLAB",
    "CELL_MIXED",
    "CELL_KV_USED",
    "CELL_KV_CACHED",
    "CELL_KV_PINNED",
    "CELL_NAMES",
    "OP_NAMES",
    "STATUS_NAMES",
    "SECTION_DTYPE",
    "HEADER_DTYPE",
    "SUMMARY_COUNTERS",
    "SUMMARY_ADDED_1_1",
    "SUMMARY_ADDED_1_4",
    "SUMMARY_DTYPE",
    "HEAPMAP_DTYPE",
    "COUNTED_DTYPE",
    "CLASS_DTYPE",
    "SLABS_DTYPE",
    "SLAB_DTYPE",
    "ARENA_DTYPE",
    "LATENCY_DTYPE",
    "KV_COUNTERS",
    "KV_ADDED_1_4",
    "KV_CALL_KINDS",
    "KV_DTYPE",
    "KV_ADDED_1_5",
    "KV_SEQUENCES_DTYPE",
    "KV_SEQUENCE_DTYPE",
    "KV_SEQ_TABLE",
    "KV_SEQ_PIN",
    "KV_NAMESPACES_DTYPE",
    "KV_NAMESPACE_DTYPE",
    "KV_NAMESPACE_SLOTS",
    "KV_NS_OTHER",
    "TRACE_DTYPE",
    "RECORD_DTYPE",
]
