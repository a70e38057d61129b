"""``Snapshot``: one consistent copy of a segment, parsed. No offset or count read from the copy
is used before it is checked against the copy's real size, and each way the copy can be wrong
raises its own ``SegmentError`` subclass. A writer of an older minor version (same ``abi_major``)
wrote shorter structs: the fields it did not write are listed in ``Snapshot.absent`` and are None
in ``Snapshot.to_dict()``."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._strict_json import json_ready
from ..errors import CorruptSegment, TruncatedSegment
from .figures import downsample_cells, kv_shares, latency_percentiles, use_label
from .layout import (
    ABI_MINOR,
    ARENA_DTYPE,
    ARENAS_SINCE_MINOR,
    CAP_TRACE_ALL,
    CLASS_DTYPE,
    COUNTED_DTYPE,
    HEADER_DTYPE,
    HEAPMAP_CELLS_MAX,
    HEAPMAP_DTYPE,
    KV_ADDED_1_4,
    KV_ADDED_1_5,
    KV_CALL_KINDS,
    KV_COUNTERS,
    KV_DTYPE,
    KV_NAMESPACE_DTYPE,
    KV_NAMESPACE_ROWS_MAX,
    KV_NAMESPACES_DTYPE,
    KV_NS_OTHER,
    KV_SEQ_ENTRIES_MAX,
    KV_SEQ_PIN,
    KV_SEQ_TABLE_MAX,
    KV_SEQUENCE_HEAD_DTYPE,
    KV_SEQUENCE_TABLE_AT,
    KV_SEQUENCES_DTYPE,
    LATENCY_DTYPE,
    MAX_SECTIONS,
    NO_OFFSET,
    OLDEST_SIZE,
    OP_NAMES,
    RECORD_DTYPE,
    SECTION_ARENAS,
    SECTION_CLASSES,
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
    SLABS_MAX,
    STATUS_NAMES,
    SUMMARY_ADDED_1_1,
    SUMMARY_ADDED_1_4,
    SUMMARY_COUNTERS,
    SUMMARY_DTYPE,
    TRACE_DTYPE,
    TRACE_RECORDS_MAX,
    struct_fields,
)

@dataclass(frozen=True, eq=False)
class KvSequenceEntry:
    """One of the longest live sequences or pins of a KV cache (the segment's KV sequences
    section, layout 1.5). ``table`` holds the first ids of its block table (read-only, uint32);
    ``table_complete`` says whether that is all of it (``len(table) == blocks``)."""

    handle: int
    num_tokens: int
    blocks: int
    cached_tokens: int
    namespace: int
    priority: int
    pin: bool
    table: np.ndarray
    table_complete: bool

    def _key(self) -> tuple[Any, ...]:
        return (self.handle, self.num_tokens, self.blocks, self.cached_tokens, self.namespace,
                self.priority, self.pin, self.table.tobytes(), self.table_complete)

    def __eq__(self, other: object) -> bool:
        # By value, the table's ids included (a dataclass would compare the arrays' truth).
        if not isinstance(other, KvSequenceEntry):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def to_dict(self) -> dict[str, Any]:
        return {"handle": self.handle, "num_tokens": self.num_tokens, "blocks": self.blocks,
                "cached_tokens": self.cached_tokens, "namespace": self.namespace,
                "priority": self.priority, "pin": self.pin,
                "table": [int(b) for b in self.table], "table_complete": self.table_complete}


@dataclass(frozen=True)
class KvSequences:
    """The KV cache's sequences as of its latest full publish (at most a second old): ``live``
    sequences and ``pins`` over all, the longest sequence's tokens and handle (0 and 0 when there
    is none; pins are not counted), and ``entries``, the longest sequences and pins, longest
    first (at most 16 from this library's writer)."""

    live: int
    pins: int
    longest_tokens: int
    longest_handle: int
    entries: list[KvSequenceEntry]

    def to_dict(self) -> dict[str, Any]:
        return {"live": self.live, "pins": self.pins, "longest_tokens": self.longest_tokens,
                "longest_handle": self.longest_handle,
                "entries": [entry.to_dict() for entry in self.entries]}


@dataclass(frozen=True)
class KvNamespaceShare:
    """One namespace's share of a KV cache (kvalloc_kv.h, kva_kv_namespaces): its live
    ``sequences`` and ``pins``, ``blocks`` (their block tables' lengths summed: a block shared by
    two tables counts twice) and ``registered_blocks`` (its keys in the prefix table).
    ``namespace`` None is the row that pools every namespace past the tracked ones."""

    namespace: int | None
    sequences: int
    pins: int
    blocks: int
    registered_blocks: int

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "sequences": self.sequences, "pins": self.pins,
                "blocks": self.blocks, "registered_blocks": self.registered_blocks}


class Snapshot:
    """One consistent copy of a segment, with numpy views over its sections.

    Every array is read-only and views the private copy, never the live file. Sections the
    writer does not publish are None (``kv`` is None also when no KV cache is attached).
    ``absent`` names, per section, the fields a writer of an older minor version did not write:
    they read as zero in the arrays and as None in ``to_dict()``.
    """

    def __init__(self, data: bytes, path: Path | None = None, *,
                 trace_bounds: tuple[int, int] | None = None) -> None:
        """``trace_bounds``: the live ring's ``written`` before and after the copy was taken
        (``Segment.snapshot`` passes them), which say which of its records the copy holds whole;
        without them the copy's own count is trusted, as for a copy of a quiet segment."""
        self.data = data
        self.path = path
        self._trace_bounds = trace_bounds
        self.taken_ns = time.time_ns()
        if len(data) < HEADER_DTYPE.itemsize:
            raise self._truncated(f"{len(data)} bytes, fewer than the {HEADER_DTYPE.itemsize} "
                                  "of the header")
        self.header = np.frombuffer(data, HEADER_DTYPE, count=1)[0]
        h = self.header
        self.abi = (int(h["abi_major"]), int(h["abi_minor"]))
        self.sequence = int(h["sequence"])
        self.pid = int(h["writer_pid"])
        self.pool_name = bytes(h["pool_name"]).split(b"\0", 1)[0].decode("utf-8", "replace")
        self.start_time_ns = int(h["start_time_ns"])
        self.heartbeat_ns = int(h["heartbeat_ns"])
        self.publish_count = int(h["publish_count"])
        self.capabilities = int(h["capabilities"])

        size, header_size = int(h["segment_size"]), int(h["header_size"])
        if size > len(data):
            raise self._truncated(f"the header states {size} bytes, the file has {len(data)}")
        if not HEADER_DTYPE.itemsize <= header_size <= size:
            raise self._corrupt(f"header_size {header_size} is outside "
                                f"[{HEADER_DTYPE.itemsize}, {size}]")
        self.segment_size = size
        self._header_size = header_size
        self._newer = self.abi[1] > ABI_MINOR
        self._sections = self._section_table()
        self.absent: dict[str, tuple[str, ...]] = {}

        self.summary: np.void = self._summary()
        orders = int(self.summary["num_orders"])
        self.num_orders = orders
        self.free_blocks: np.ndarray = self.summary["free_blocks"][:orders]
        self.unusable_index: np.ndarray = self.summary["unusable_index"][:orders]
        self.heapmap: np.void | None = None
        self.cell_state: np.ndarray | None = None
        self.cell_fill: np.ndarray | None = None
        self._read_heapmap()
        self.classes = self._counted(SECTION_CLASSES, CLASS_DTYPE)
        # Before 1.2 an arena entry held other counters (allocations, frees, failures, bytes in
        # use of the pool's one arena) under the same bytes: not read as today's fields.
        self.arenas = (self._counted(SECTION_ARENAS, ARENA_DTYPE)
                       if self.abi[1] >= ARENAS_SINCE_MINOR else None)
        self.slabs = self._slabs()
        latency = self._fixed(SECTION_LATENCY, LATENCY_DTYPE)
        self.latency: dict[str, np.ndarray] | None = (
            None if latency is None else {"alloc": latency["alloc"], "free": latency["free"]})
        kv = self._fixed(SECTION_KV, KV_DTYPE)
        self.kv: np.void | None = kv if kv is not None and kv["present"] else None
        self.kv_latency = self._kv_latency()
        self.kv_sequences: KvSequences | None = self._kv_sequences()
        self.kv_namespaces: list[KvNamespaceShare] | None = self._kv_namespaces()
        self.trace_written = 0
        self._trace_first = 0  # the oldest record the copy holds whole
        self._ring: np.ndarray | None = self._trace_ring()

    # -- parsing, every offset checked before use ----------------------------------------------

    def _section_table(self) -> dict[int, tuple[int, int]]:
        count = int(self.header["section_count"])
        if count > MAX_SECTIONS:
            raise self._corrupt(f"section_count {count} exceeds the table's {MAX_SECTIONS}")
        sections: dict[int, tuple[int, int]] = {}
        for entry in self.header["sections"][:count]:
            kind, offset, size = int(entry["kind"]), int(entry["offset"]), int(entry["size"])
            if kind == 0:
                continue
            what = SECTION_NAMES.get(kind, f"kind {kind}")
            if offset < self._header_size or offset % 8 or offset > self.segment_size \
                    or size > self.segment_size - offset:
                raise self._corrupt(f"the {what} section [{offset}, +{size}) is not inside the "
                                    f"{self.segment_size}-byte segment past its header, or is "
                                    "misaligned")
            sections.setdefault(kind, (offset, size))
        return sections

    def _fixed(self, kind: int, dtype: np.dtype) -> np.void | None:
        where = self._sections.get(kind)
        if where is None:
            return None
        offset, size = where
        if size < dtype.itemsize:
            oldest: np.void = self._older(kind, dtype, offset, 1, size)[0]
            return oldest
        struct: np.void = np.frombuffer(self.data, dtype, count=1, offset=offset)[0]
        return struct

    def _older(self, kind: int, dtype: np.dtype, offset: int, count: int, written: int
               ) -> np.ndarray:
        """``count`` structs of ``written`` bytes each, fewer than ``dtype`` has: an older minor
        version wrote them before fields were added at their end. A copy in ``dtype`` with the
        fields it did not write zeroed and listed in ``absent``; fewer bytes than the oldest
        layout of the struct is corruption."""
        name = SECTION_NAMES[kind]
        oldest = OLDEST_SIZE.get(dtype, dtype.itemsize)
        if written < oldest:
            raise self._corrupt(f"the {name} section holds structs of {written} bytes, fewer "
                                f"than the {oldest} of their oldest layout")
        fields = struct_fields(dtype)
        present = [f for f, (field_dtype, at) in fields.items() if at + field_dtype.itemsize <= written]
        written_dtype = np.dtype({"names": present, "formats": [fields[f][0] for f in present],
                                  "offsets": [fields[f][1] for f in present],
                                  "itemsize": written})
        entries = np.ndarray((count,), written_dtype, buffer=self.data, offset=offset)
        copy = np.zeros(count, dtype)
        for f in present:
            copy[f] = entries[f]
        copy.flags.writeable = False
        self.absent[name] = tuple(f for f in fields if f not in present)
        return copy

    def _array(self, kind: int, head: int, dtype: np.dtype, count: int, entry_size: int = 0
               ) -> np.ndarray:
        """``count`` entries after ``head`` bytes of a section. A writer of a newer minor version
        may have grown each entry at its end: its stride is then the entry size the section
        states (layout 1.1 on), or else what the section size says."""
        offset, size = self._sections[kind]
        stride = dtype.itemsize
        if entry_size:
            stride = entry_size
        elif self._newer and count:
            stride = (size - head) // count
        if stride < 1 or head + count * stride > size:
            raise self._corrupt(f"the {SECTION_NAMES[kind]} section has {size} bytes, too few "
                                f"for {count} entries of {stride}")
        if stride < dtype.itemsize:
            return self._older(kind, dtype, offset + head, count, stride)
        entries: np.ndarray = np.ndarray((count,), dtype, buffer=self.data, offset=offset + head,
                                         strides=(stride,))
        return entries

    def _summary(self) -> np.void:
        summary = self._fixed(SECTION_SUMMARY, SUMMARY_DTYPE)
        if summary is None:
            raise self._corrupt("it has no summary section")
        if int(summary["num_orders"]) > 48:
            raise self._corrupt(f"num_orders {int(summary['num_orders'])} exceeds 48")
        return summary

    def _read_heapmap(self) -> None:
        head = self._fixed(SECTION_HEAPMAP, HEAPMAP_DTYPE)
        if head is None:
            return
        offset, size = self._sections[SECTION_HEAPMAP]
        cells = int(head["cells"])
        self._at_most("heap map cells", cells, HEAPMAP_CELLS_MAX)
        start = size - 2 * cells if self._newer else HEAPMAP_DTYPE.itemsize
        if start < HEAPMAP_DTYPE.itemsize or start + 2 * cells > size:
            raise self._corrupt(f"the heap map section has {size} bytes, too few for "
                                f"{cells} cells")
        self.heapmap = head
        self.cell_state = np.frombuffer(self.data, np.uint8, cells, offset + start)
        self.cell_fill = np.frombuffer(self.data, np.uint8, cells, offset + start + cells)

    def _at_most(self, what: str, count: int, limit: int) -> None:
        """A count no writer makes is corruption, refused before anything is sized by it."""
        if count > limit:
            raise self._corrupt(f"{what}: {count}, more than the {limit} a writer makes")

    def _counted(self, kind: int, dtype: np.dtype) -> np.ndarray | None:
        head = self._fixed(kind, COUNTED_DTYPE)
        if head is None:
            return None
        return self._array(kind, COUNTED_DTYPE.itemsize, dtype, int(head["count"]), int(head["entry_size"]))

    def _slabs(self) -> np.ndarray | None:
        head = self._fixed(SECTION_SLABS, SLABS_DTYPE)
        if head is None:
            return None
        count, capacity = int(head["count"]), int(head["capacity"])
        self._at_most("room for slabs", capacity, SLABS_MAX)
        if count > capacity:
            raise self._corrupt(f"the slabs section counts {count} slabs in room for {capacity}")
        return self._array(SECTION_SLABS, SLABS_DTYPE.itemsize, SLAB_DTYPE, capacity)[:count]

    def _kv_latency(self) -> dict[str, np.ndarray] | None:
        """The KV cache's call latency histograms by kind (1.4 on), or None: also when the
        section does not state the kinds its arrays hold (a writer fills call_kinds whenever a
        cache is attached), since then nothing says what its histograms mean."""
        if self.kv is None or "call_ns_log2" in self.absent.get("kv", ()):
            return None
        if int(self.kv["call_kinds"]) != len(KV_CALL_KINDS):
            return None
        return {kind: self.kv["call_ns_log2"][k] for k, kind in enumerate(KV_CALL_KINDS)}

    def _kv_sequences(self) -> KvSequences | None:
        """The KV sequences section (1.5), None without it or without a KV cache. Each entry's
        fixed fields, then its table of ``table_capacity`` ids at the same offset in every minor
        version; an entry may be longer (``entry_size``)."""
        head = self._fixed(SECTION_KV_SEQUENCES, KV_SEQUENCES_DTYPE)
        if head is None or self.kv is None:
            return None
        offset, size = self._sections[SECTION_KV_SEQUENCES]
        count, capacity = int(head["count"]), int(head["capacity"])
        entry_size, table_capacity = int(head["entry_size"]), int(head["table_capacity"])
        self._at_most("room for KV sequences", capacity, KV_SEQ_ENTRIES_MAX)
        self._at_most("block ids a KV sequence entry holds", table_capacity, KV_SEQ_TABLE_MAX)
        if count > capacity:
            raise self._corrupt(f"the kv sequences section counts {count} entries in room for "
                                f"{capacity}")
        if entry_size < KV_SEQUENCE_TABLE_AT + 4 * table_capacity or entry_size % 8:
            raise self._corrupt(f"the kv sequences section states entries of {entry_size} bytes, "
                                f"not a multiple of 8 of at least the {KV_SEQUENCE_TABLE_AT} of "
                                f"their fields and {4 * table_capacity} of a table of "
                                f"{table_capacity} ids")
        head_size = KV_SEQUENCES_DTYPE.itemsize
        if head_size + capacity * entry_size > size:
            raise self._corrupt(f"the kv sequences section has {size} bytes, too few for "
                                f"{capacity} entries of {entry_size}")
        rows: np.ndarray = np.ndarray((count,), KV_SEQUENCE_HEAD_DTYPE, buffer=self.data,
                                      offset=offset + head_size, strides=(entry_size,))
        entries = []
        for i, row in enumerate(rows):
            blocks, table_len = int(row["blocks"]), int(row["table_len"])
            if table_len > min(blocks, table_capacity):
                raise self._corrupt(f"kv sequence entry {i} holds {table_len} block ids of a "
                                    f"table of {blocks}, in room for {table_capacity}")
            at = offset + head_size + i * entry_size + KV_SEQUENCE_TABLE_AT
            table = np.frombuffer(self.data, "<u4", table_len, at).astype(np.uint32, copy=False)
            table.flags.writeable = False
            entries.append(KvSequenceEntry(
                handle=int(row["handle"]), num_tokens=int(row["num_tokens"]), blocks=blocks,
                cached_tokens=int(row["cached_tokens"]), namespace=int(row["namespace_id"]),
                priority=int(row["priority"]), pin=bool(int(row["flags"]) & KV_SEQ_PIN),
                table=table, table_complete=table_len == blocks))
        return KvSequences(live=int(head["live_sequences"]), pins=int(head["live_pins"]),
                           longest_tokens=int(head["longest_tokens"]),
                           longest_handle=int(head["longest_handle"]), entries=entries)

    def _kv_namespaces(self) -> list[KvNamespaceShare] | None:
        """The KV namespaces section (1.5), None without it or without a KV cache."""
        head = self._fixed(SECTION_KV_NAMESPACES, KV_NAMESPACES_DTYPE)
        if head is None or self.kv is None:
            return None
        count, capacity = int(head["count"]), int(head["capacity"])
        self._at_most("room for KV namespace rows", capacity, KV_NAMESPACE_ROWS_MAX)
        if count > capacity:
            raise self._corrupt(f"the kv namespaces section counts {count} rows in room for "
                                f"{capacity}")
        if not int(head["entry_size"]):
            raise self._corrupt("the kv namespaces section states no entry size")
        rows = self._array(SECTION_KV_NAMESPACES, KV_NAMESPACES_DTYPE.itemsize,
                           KV_NAMESPACE_DTYPE, capacity, int(head["entry_size"]))[:count]
        return [KvNamespaceShare(
            namespace=None if int(row["flags"]) & KV_NS_OTHER else int(row["namespace_id"]),
            sequences=int(row["sequences"]), pins=int(row["pins"]), blocks=int(row["blocks"]),
            registered_blocks=int(row["registered_blocks"])) for row in rows]

    def _trace_ring(self) -> np.ndarray | None:
        """The trace ring as the writer stores it (record i at i % capacity), bounds-checked but
        not reordered: ``trace_tail`` orders only the records asked for."""
        head = self._fixed(SECTION_TRACE, TRACE_DTYPE)
        if head is None:
            return None
        capacity, written = int(head["capacity"]), int(head["written"])
        self._at_most("room for trace records", capacity, TRACE_RECORDS_MAX)
        ring = self._array(SECTION_TRACE, TRACE_DTYPE.itemsize, RECORD_DTYPE, capacity,
                           int(head["entry_size"]))
        # The records whole in the copy (kvalloc_stats.h, "The trace ring"): below the count
        # read before the copy, and from the last one the writer may have begun meanwhile less
        # a lap of the ring.
        first = written - capacity
        if self._trace_bounds is not None:
            before, after = self._trace_bounds
            written, first = before, max(before, after + 1) - capacity
        self.trace_written = written
        self._trace_first = max(0, first)
        return ring

    @property
    def has_trace(self) -> bool:
        """Whether the writer publishes a trace ring (it may hold no record yet)."""
        return self._ring is not None

    def trace_tail(self, newest: int | None = None) -> np.ndarray | None:
        """The newest ``newest`` records of the ring (all it holds when None), oldest first; None
        when the writer publishes no ring. Only those records are copied: a ring may hold
        hundreds of thousands, of which a screen shows a few."""
        ring = self._ring
        if ring is None:
            return None
        capacity = len(ring)
        kept = max(0, min(self.trace_written - self._trace_first, capacity))
        if newest is not None:
            kept = min(kept, max(0, newest))
        # Record i of the ring sits at i % capacity.
        order = np.arange(self.trace_written - kept, self.trace_written, dtype=np.uint64)
        records: np.ndarray = ring[(order % np.uint64(max(capacity, 1))).astype(np.intp)]
        return records

    @functools.cached_property
    def trace(self) -> np.ndarray | None:
        """The whole ring, oldest first (``trace_tail()``); None without one."""
        return self.trace_tail()

    def _corrupt(self, why: str) -> CorruptSegment:
        return CorruptSegment(f"{self.path or 'segment'} is corrupt: {why}",
                              path=str(self.path) if self.path else None)

    def _truncated(self, why: str) -> TruncatedSegment:
        return TruncatedSegment(f"{self.path or 'segment'} is truncated: {why}",
                                path=str(self.path) if self.path else None)

    # -- figures derived from the copy ---------------------------------------------------------

    def heartbeat_age(self, now_ns: int | None = None) -> float:
        """Seconds since the writer's latest publish."""
        return max(0, (now_ns or self.taken_ns) - self.heartbeat_ns) / 1e9

    def uptime(self, now_ns: int | None = None) -> float:
        """Seconds since the pool was created."""
        return max(0, (now_ns or self.taken_ns) - self.start_time_ns) / 1e9

    @property
    def capacity(self) -> int:
        return int(self.summary["capacity"])

    @property
    def bytes_in_use(self) -> int:
        return int(self.summary["bytes_in_use"])

    @property
    def use_fraction(self) -> float:
        """``bytes_in_use`` (usable bytes of live allocations) over the capacity."""
        return self.bytes_in_use / self.capacity if self.capacity else 0.0

    @property
    def kv_blocks(self) -> tuple[int, int, int] | None:
        """(used, cached, total) blocks of the KV cache; None without one."""
        if self.kv is None:
            return None
        return int(self.kv["used_blocks"]), int(self.kv["cached_blocks"]), int(self.kv["total_blocks"])

    @property
    def kv_use(self) -> tuple[float, float] | None:
        """(used, cached) shares of the KV cache's blocks (``kv_shares``); None without one."""
        blocks = self.kv_blocks
        return None if blocks is None else kv_shares(*blocks)

    @property
    def kv_peaks(self) -> tuple[int, int, int] | None:
        """The KV cache's peaks since its creation or its last reset: (used blocks, cached
        blocks, bytes in use); None without a KV cache or from a writer before layout 1.4."""
        if self.kv is None or "peak_used_blocks" in self.absent.get("kv", ()):
            return None
        return (int(self.kv["peak_used_blocks"]), int(self.kv["peak_cached_blocks"]),
                int(self.kv["peak_bytes_in_use"]))

    @property
    def pool_peaks(self) -> tuple[int, int] | None:
        """The pool's peaks since its creation or its last reset: (bytes in buddy blocks, bytes
        in use); None from a writer before layout 1.4."""
        if "peak_block_bytes" in self.absent.get("summary", ()):
            return None
        return int(self.summary["peak_block_bytes"]), int(self.summary["peak_bytes_in_use"])

    @property
    def use_label(self) -> str:
        """The pool's use as ``kvalloc ls``, ``top`` and ``dump`` show it (``use_label``)."""
        return use_label(self.bytes_in_use, self.capacity, self.kv_blocks)

    @property
    def fragmentation(self) -> float:
        return float(self.summary["fragmentation"])

    def block_size(self, order: int) -> int:
        return int(self.summary["min_block"]) << order

    def latency_samples(self, kind: str) -> int:
        return int(self.latency[kind].sum()) if self.latency is not None else 0

    def latency_percentiles(self, kind: str, quantiles: tuple[float, ...] = (0.5, 0.99, 0.999)
                            ) -> dict[float, int] | None:
        """Upper bounds (ns) of the log2 buckets that hold each quantile of ``kind`` ("alloc"
        or "free") calls; None without samples."""
        return None if self.latency is None else latency_percentiles(self.latency[kind], quantiles)

    def calls_are_timed(self) -> bool:
        """Whether the latency histograms count calls: the library times calls, every one of
        them, only in a pool created with trace on (the segment says so in its capabilities);
        otherwise it reads no clock and the histograms stay empty."""
        return bool(self.capabilities & CAP_TRACE_ALL)

    def kv_latency_percentiles(self, kind: str,
                               quantiles: tuple[float, ...] = (0.5, 0.99, 0.999)
                               ) -> dict[float, int] | None:
        """Upper bounds (ns) of the log2 buckets that hold each quantile of the KV cache's
        timed calls of ``kind`` (one of ``KV_CALL_KINDS``); None without samples, a KV cache
        or a writer of 1.4 on."""
        if self.kv_latency is None:
            return None
        return latency_percentiles(self.kv_latency[kind], quantiles)

    @property
    def kv_call_sample_period(self) -> int | None:
        """1 when the KV cache times every call (trace on), else on average one call in this
        many of each kind is timed; None without a KV cache or a writer of 1.4 on."""
        if self.kv is None or self.kv_latency is None:
            return None
        return int(self.kv["call_sample_period"])

    @property
    def hit_rate(self) -> float | None:
        """KV prefix-cache hits over queried tokens; None without a KV cache or queries."""
        if self.kv is None or not int(self.kv["query_tokens"]):
            return None
        return int(self.kv["hit_tokens"]) / int(self.kv["query_tokens"])

    @property
    def hit_rates(self) -> tuple[float | None, float | None] | None:
        """The prefix-cache hit rate of first admissions and of re-admissions apart, each None
        without queries of its kind; None without a KV cache or from a writer before 1.5."""
        if self.kv is None or "readmit_query_tokens" in self.absent.get("kv", ()):
            return None
        again_hit, again_query = int(self.kv["readmit_hit_tokens"]), int(self.kv["readmit_query_tokens"])
        first_hit = int(self.kv["hit_tokens"]) - again_hit
        first_query = int(self.kv["query_tokens"]) - again_query
        return (first_hit / first_query if first_query > 0 else None,
                again_hit / again_query if again_query > 0 else None)

    def heap_cells(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The heap map fitted to ``count`` cells (states, fills); see ``downsample_cells``."""
        if self.cell_state is None or self.cell_fill is None:
            return np.zeros(0, np.uint8), np.zeros(0, np.uint8)
        return downsample_cells(self.cell_state, self.cell_fill, count)

    def trace_records(self, newest: int | None = None) -> Iterator[dict[str, Any]]:
        """The recent-operations ring, oldest first, as plain dicts: its newest ``newest``
        records, or all of them (see ``trace_tail``)."""
        records = self.trace if newest is None else self.trace_tail(newest)
        if records is None:
            return
        for record in records:
            offset = int(record["offset"])
            yield {"time_ns": int(record["time_ns"]), "op": OP_NAMES.get(int(record["op"]),
                                                                          str(int(record["op"]))),
                   "status": int(record["status"]),
                   "status_name": STATUS_NAMES.get(int(record["status"]),
                                                   str(int(record["status"]))),
                   "offset": None if offset == NO_OFFSET else offset,
                   "size": int(record["size"]), "thread": int(record["thread"])}

    def to_dict(self, *, trace: bool = False) -> dict[str, Any]:
        """Everything in the snapshot as JSON-ready Python values (``kvalloc dump --json``)."""
        summary: dict[str, Any] = {name: int(self.summary[name]) for name in SUMMARY_COUNTERS}
        summary.update(page_kind=int(self.summary["page_kind"]), num_orders=self.num_orders,
                       fragmentation=self.fragmentation,
                       free_blocks=[int(n) for n in self.free_blocks],
                       unusable_index=[float(x) for x in self.unusable_index])
        # The 1.1 fields are None when the writer predates them (``absent`` says so); numa_node
        # is None also for a region bound to no node, as in ``Pool.stats()``.
        absent = self.absent.get("summary", ())
        summary.update({name: None if name in absent else int(self.summary[name])
                        for name in SUMMARY_ADDED_1_1 + SUMMARY_ADDED_1_4})
        if summary["numa_node"] is not None and summary["numa_node"] < 0:
            summary["numa_node"] = None
        result: dict[str, Any] = {
            "pool": self.pool_name, "pid": self.pid, "segment": str(self.path),
            "abi": f"{self.abi[0]}.{self.abi[1]}", "sequence": self.sequence,
            "publish_count": self.publish_count, "start_time_ns": self.start_time_ns,
            "heartbeat_ns": self.heartbeat_ns, "taken_ns": self.taken_ns,
            "summary": summary,
        }
        if self.heapmap is not None:
            assert self.cell_state is not None and self.cell_fill is not None
            result["heapmap"] = {
                "cells": int(self.heapmap["cells"]),
                "cell_blocks": int(self.heapmap["cell_blocks"]),
                "cell_bytes": int(self.heapmap["cell_bytes"]),
                "state": self.cell_state.tolist(), "fill": self.cell_fill.tolist()}
        if self.classes is not None:
            result["classes"] = _records(self.classes)
        if self.slabs is not None:
            result["slabs"] = [dict(entry, strip=list(entry["strip"]))
                               for entry in _records(self.slabs)]
        if self.arenas is not None:
            result["arenas"] = _records(self.arenas, self.absent.get("arenas", ()))
        if self.latency is not None:
            result["latency"] = {
                kind: {"buckets": [int(n) for n in self.latency[kind]],
                       "samples": self.latency_samples(kind),
                       **{f"p{_quantile_label(q)}_ns": bound for q, bound in
                          (self.latency_percentiles(kind) or {}).items()}}
                for kind in ("alloc", "free")}
        result["kv"] = None if self.kv is None else self._kv_dict()
        result["kv_sequences"] = None if self.kv_sequences is None else self.kv_sequences.to_dict()
        result["kv_namespaces"] = (None if self.kv_namespaces is None else
                                   [row.to_dict() for row in self.kv_namespaces])
        if trace:
            result["trace_written"] = self.trace_written
            result["trace"] = list(self.trace_records())
        ready: dict[str, Any] = json_ready(result)
        return ready


    def _kv_dict(self) -> dict[str, Any]:
        assert self.kv is not None
        kv_absent = self.absent.get("kv", ())
        result: dict[str, Any] = {"block_tokens": int(self.kv["block_tokens"]),
                                  **{name: int(self.kv[name]) for name in KV_COUNTERS},
                                  **{name: None if name in kv_absent else int(self.kv[name])
                                     for name in KV_ADDED_1_4 + KV_ADDED_1_5}}
        result["call_sample_period"] = self.kv_call_sample_period
        result["latency"] = None if self.kv_latency is None else {
            kind: {"buckets": [int(n) for n in self.kv_latency[kind]],
                   "samples": int(self.kv["call_timed"][k]),
                   "sum_ns": int(self.kv["call_ns"][k]),
                   **{f"p{_quantile_label(q)}_ns": bound for q, bound in
                      (self.kv_latency_percentiles(kind) or {}).items()}}
            for k, kind in enumerate(KV_CALL_KINDS)}
        return result


def _records(array: np.ndarray, absent: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    names = [name for name in struct_fields(array.dtype) if name != "reserved"]
    return [{name: None if name in absent else _plain(entry[name]) for name in names}
            for entry in array]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value.item()


def _quantile_label(q: float) -> str:
    # 0.5 -> "50", 0.99 -> "99", 0.999 -> "999"
    return f"{q * 100:g}".replace(".", "")
