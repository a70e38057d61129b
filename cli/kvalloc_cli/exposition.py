"""What ``kvalloc export`` serves: every live pool's statistics segment as Prometheus metrics, in
the text exposition format (version 0.0.4), written directly.

Names follow Prometheus' conventions: the ``kvalloc_`` prefix, base units in the name's suffix
(``_bytes``, ``_seconds``, ``_ratio``), ``_total`` for counters, a histogram (``_bucket{le=...}``,
``_sum``, ``_count``) for latencies. Each series carries the labels ``pool``, ``pid`` and
``process`` (the writer's command name). The KV hit rate is left to the query language, as vLLM
leaves ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``: its two inputs are counters.

A scrape is bounded however many segments the machine holds: the directory is listed (names
only), at most ``max_segments`` are read (in the listing's order, pid then pool name, so that the
same ones are exported from one scrape to the next), and each read copies at most the bytes the
reader allows (``pykvalloc.stats.MAX_SEGMENT_BYTES``). A segment that vanishes, is corrupt,
truncated, inconsistent or written by a dead process is skipped and counted; nothing about one
segment can fail the scrape.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pykvalloc.errors import DeadWriter, SegmentError, SegmentNotFound, SegmentRemoved
from pykvalloc.stats import (
    KV_CALL_KINDS,
    KvNamespaceShare,
    SHM_DIR,
    Segment,
    SegmentFile,
    Snapshot,
    list_segments,
    process_name,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The default most segments a scrape reads.
MAX_SEGMENTS = 256

#: The histograms' upper bounds: every power of two of nanoseconds from 64 ns to about 1.07 s.
#: The library's log2 buckets (bucket i: [2^i, 2^(i+1)) ns) sum exactly into each of them.
LE_EXPONENTS = range(6, 31)


def _escape(value: str) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(int(value))


@dataclass
class Family:
    """One metric: its name, type, help, and its samples (label pairs, suffix, value)."""

    name: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    samples: list[tuple[str, tuple[tuple[str, str], ...], float]] = field(default_factory=list)

    def add(self, labels: tuple[tuple[str, str], ...], value: float, suffix: str = "") -> None:
        self.samples.append((suffix, labels, value))

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for suffix, labels, value in self.samples:
            pairs = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
            lines.append(f"{self.name}{suffix}{{{pairs}}} {_number(value)}" if pairs
                         else f"{self.name}{suffix} {_number(value)}")
        return "\n".join(lines) + "\n"


# name -> (type, help). Families appear in this order; one without samples is left out.
POOL_FAMILIES: dict[str, tuple[str, str]] = {
    "kvalloc_pool_capacity_bytes": ("gauge", "Bytes the pool manages."),
    "kvalloc_pool_in_use_bytes": ("gauge", "Usable bytes of live allocations (size classes and "
                                           "blocks)."),
    "kvalloc_pool_free_bytes": ("gauge", "Bytes in free buddy blocks."),
    "kvalloc_pool_largest_free_bytes": ("gauge", "The largest free buddy block."),
    "kvalloc_pool_slab_bytes": ("gauge", "Bytes of buddy blocks held by slabs."),
    "kvalloc_pool_mapped_bytes": ("gauge", "Bytes backed by memory now (CUDA: mapped device "
                                           "memory; host: the region)."),
    "kvalloc_pool_metadata_bytes": ("gauge", "Host bytes of the pool's bookkeeping."),
    "kvalloc_pool_peak_block_bytes": ("gauge", "The most bytes in live buddy blocks at once "
                                               "(exact) since creation or the last reset."),
    "kvalloc_pool_peak_in_use_bytes": ("gauge", "The highest bytes in use the pool's statistics "
                                                "saw since creation or the last reset (a lower "
                                                "bound of the true peak)."),
    "kvalloc_pool_fragmentation_ratio": ("gauge", "1 - largest free block / free bytes."),
    "kvalloc_pool_live_allocations": ("gauge", "Live allocations."),
    "kvalloc_pool_slabs": ("gauge", "Live slabs."),
    "kvalloc_pool_free_blocks": ("gauge", "Free buddy blocks per order (block_bytes: their size)."),
    "kvalloc_pool_allocations_total": ("counter", "Successful allocations."),
    "kvalloc_pool_frees_total": ("counter", "Successful frees."),
    "kvalloc_pool_allocation_failures_total": ("counter", "Allocations refused for want of "
                                                          "memory."),
    "kvalloc_pool_rejected_calls_total": ("counter", "Calls refused as invalid, double frees or "
                                                     "bad pointers."),
    "kvalloc_pool_publishes_total": ("counter", "Publishes of the statistics segment."),
    "kvalloc_pool_start_time_seconds": ("gauge", "When the pool was created, seconds since the "
                                                 "epoch."),
    "kvalloc_pool_last_publish_time_seconds": ("gauge", "The segment's latest publish, seconds "
                                                        "since the epoch (a quiet pool publishes "
                                                        "nothing: idle, not dead)."),
}
KV_FAMILIES: dict[str, tuple[str, str]] = {
    "kvalloc_kv_capacity_blocks": ("gauge", "Blocks of the KV cache."),
    "kvalloc_kv_blocks": ("gauge", "KV blocks by state: used (held by sequences), cached (kept "
                                   "only by the prefix cache, evictable), free."),
    "kvalloc_kv_usage_ratio": ("gauge", "Used blocks / all blocks: the share held by sequences "
                                        "(cached blocks are evictable, as in vLLM's "
                                        "kv_cache_usage_perc)."),
    "kvalloc_kv_block_bytes": ("gauge", "Bytes of one KV block (contiguous mode: of one token)."),
    "kvalloc_kv_in_use_bytes": ("gauge", "KV bytes held by sequences."),
    "kvalloc_kv_peak_in_use_bytes": ("gauge", "The most KV bytes held by sequences since "
                                              "creation or the last reset."),
    "kvalloc_kv_peak_used_blocks": ("gauge", "The most used blocks since creation or the last "
                                             "reset."),
    "kvalloc_kv_peak_cached_blocks": ("gauge", "The most cached blocks since creation or the "
                                               "last reset."),
    "kvalloc_kv_sequences": ("gauge", "Live sequences."),
    "kvalloc_kv_prefix_cache_query_tokens_total": ("counter", "Tokens looked up in the prefix "
                                                              "cache (vLLM: "
                                                              "prefix_cache_queries)."),
    "kvalloc_kv_prefix_cache_hit_tokens_total": ("counter", "Tokens the prefix cache held (vLLM: "
                                                            "prefix_cache_hits)."),
    "kvalloc_kv_prefix_cache_readmission_query_tokens_total": (
        "counter", "Of the tokens looked up, those of re-admissions (requests admitted again "
                   "after a preemption); the rest are first admissions'."),
    "kvalloc_kv_prefix_cache_readmission_hit_tokens_total": (
        "counter", "Of the tokens the prefix cache held, those of re-admissions."),
    "kvalloc_kv_pinned_blocks": ("gauge", "Distinct blocks held by live pins (part of the used "
                                          "ones)."),
    "kvalloc_kv_pins": ("gauge", "Live pins."),
    "kvalloc_kv_longest_sequence_tokens": ("gauge", "Tokens of the longest live sequence (0: "
                                                    "none)."),
    "kvalloc_kv_namespace_sequences": ("gauge", "Live sequences by namespace (namespace=\"other\": "
                                                "every namespace past the tracked ones)."),
    "kvalloc_kv_namespace_pins": ("gauge", "Live pins by namespace."),
    "kvalloc_kv_namespace_blocks": ("gauge", "Blocks the namespace's sequences and pins hold (a "
                                             "block in two tables counts in both)."),
    "kvalloc_kv_namespace_registered_blocks": ("gauge", "Blocks the namespace registered in the "
                                                        "prefix table."),
    "kvalloc_kv_evictions_total": ("counter", "Prefix-cache registrations dropped (evictions)."),
    "kvalloc_kv_cow_copies_total": ("counter", "Copy-on-write block copies."),
    "kvalloc_kv_forks_total": ("counter", "Sequence forks."),
    "kvalloc_kv_call_sample_period": ("gauge", "1: every KV call is timed (trace on); else on "
                                               "average one call in this many of each kind."),
    "kvalloc_kv_call_duration_seconds": ("histogram", "Latency of the KV cache's calls by kind, "
                                                      "lock to lock: a sample of the calls, one "
                                                      "in kvalloc_kv_call_sample_period."),
}
SEGMENT_FAMILIES = {**POOL_FAMILIES, **KV_FAMILIES}
EXPORTER_FAMILIES: dict[str, tuple[str, str]] = {
    "kvalloc_exporter_scrapes_total": ("counter", "Scrapes served."),
    "kvalloc_exporter_scrape_duration_seconds": ("gauge", "Seconds this scrape took to read the "
                                                          "segments."),
    "kvalloc_exporter_segments_seen": ("gauge", "Segment files found in this scrape."),
    "kvalloc_exporter_segments_exported": ("gauge", "Segments exported in this scrape."),
    "kvalloc_exporter_max_segments": ("gauge", "The most segments one scrape reads."),
    "kvalloc_exporter_segments_skipped_total": ("counter", "Segments skipped: over the limit "
                                                           "(limit), gone since listed "
                                                           "(vanished), of a dead writer (dead), "
                                                           "unreadable (error)."),
    "kvalloc_exporter_segment_errors_total": ("counter", "Segments that could not be read, by "
                                                         "what was wrong."),
}


def _histogram(family: Family, labels: tuple[tuple[str, str], ...], buckets: np.ndarray,
               count: int, sum_seconds: float) -> None:
    """A Prometheus histogram from log2 buckets of nanoseconds: cumulative at each bound of
    ``LE_EXPONENTS`` (2^e ns holds buckets 0 .. e-1), then +Inf. The pool's own call histograms
    (trace on) are not exported: they keep no sum, which a histogram needs."""
    cumulative = np.cumsum(np.asarray(buckets, dtype=np.uint64))
    for exponent in LE_EXPONENTS:
        le = float(2 ** exponent) / 1e9
        family.add(labels + (("le", repr(le)),), int(cumulative[exponent - 1]), "_bucket")
    family.add(labels + (("le", "+Inf"),), int(cumulative[-1]), "_bucket")
    family.add(labels, sum_seconds, "_sum")
    family.add(labels, count, "_count")


def _pool_samples(families: dict[str, Family], labels: tuple[tuple[str, str], ...],
                  snap: Snapshot) -> None:
    summary = snap.summary
    absent = snap.absent.get("summary", ())

    def sample(name: str, value: float) -> None:
        families[name].add(labels, value)

    for name, field_name in (("capacity_bytes", "capacity"), ("in_use_bytes", "bytes_in_use"),
                             ("free_bytes", "bytes_free"), ("largest_free_bytes", "largest_free"),
                             ("slab_bytes", "slab_bytes"), ("mapped_bytes", "mapped_bytes"),
                             ("metadata_bytes", "metadata_bytes"),
                             ("peak_block_bytes", "peak_block_bytes"),
                             ("peak_in_use_bytes", "peak_bytes_in_use"),
                             ("live_allocations", "live_allocations"), ("slabs", "slab_count"),
                             ("allocations_total", "alloc_count"), ("frees_total", "free_count"),
                             ("allocation_failures_total", "alloc_failures"),
                             ("rejected_calls_total", "rejected_calls")):
        if field_name not in absent:
            sample(f"kvalloc_pool_{name}", int(summary[field_name]))
    sample("kvalloc_pool_fragmentation_ratio", snap.fragmentation)
    for order, count in enumerate(snap.free_blocks):
        families["kvalloc_pool_free_blocks"].add(
            labels + (("order", str(order)), ("block_bytes", str(snap.block_size(order)))),
            int(count))
    sample("kvalloc_pool_publishes_total", snap.publish_count)
    sample("kvalloc_pool_start_time_seconds", snap.start_time_ns / 1e9)
    sample("kvalloc_pool_last_publish_time_seconds", snap.heartbeat_ns / 1e9)


def _kv_samples(families: dict[str, Family], labels: tuple[tuple[str, str], ...],
                snap: Snapshot) -> None:
    kv = snap.kv
    if kv is None:
        return
    absent = snap.absent.get("kv", ())

    def sample(name: str, value: float, extra: tuple[tuple[str, str], ...] = ()) -> None:
        families[name].add(labels + extra, value)

    total = int(kv["total_blocks"])
    sample("kvalloc_kv_capacity_blocks", total)
    for state in ("used", "cached", "free"):
        sample("kvalloc_kv_blocks", int(kv[f"{state}_blocks"]), (("state", state),))
    sample("kvalloc_kv_usage_ratio", int(kv["used_blocks"]) / total if total else 0.0)
    sample("kvalloc_kv_block_bytes", int(kv["block_bytes"]))
    for name, field_name in (("in_use_bytes", "bytes_in_use"),
                             ("peak_in_use_bytes", "peak_bytes_in_use"),
                             ("peak_used_blocks", "peak_used_blocks"),
                             ("peak_cached_blocks", "peak_cached_blocks")):
        if field_name not in absent:
            sample(f"kvalloc_kv_{name}", int(kv[field_name]))
    sample("kvalloc_kv_sequences", int(kv["live_sequences"]))
    sample("kvalloc_kv_prefix_cache_query_tokens_total", int(kv["query_tokens"]))
    sample("kvalloc_kv_prefix_cache_hit_tokens_total", int(kv["hit_tokens"]))
    sample("kvalloc_kv_evictions_total", int(kv["evictions"]))
    sample("kvalloc_kv_cow_copies_total", int(kv["cow_copies"]))
    sample("kvalloc_kv_forks_total", int(kv["forks"]))
    if "pinned_blocks" not in absent:  # layout 1.5 on
        sample("kvalloc_kv_pinned_blocks", int(kv["pinned_blocks"]))
        sample("kvalloc_kv_prefix_cache_readmission_query_tokens_total",
               int(kv["readmit_query_tokens"]))
        sample("kvalloc_kv_prefix_cache_readmission_hit_tokens_total",
               int(kv["readmit_hit_tokens"]))
    if snap.kv_sequences is not None:
        sample("kvalloc_kv_pins", snap.kv_sequences.pins)
        sample("kvalloc_kv_longest_sequence_tokens", snap.kv_sequences.longest_tokens)
    for namespace, figures in _namespace_series(snap.kv_namespaces or []).items():
        for name, value in zip(("sequences", "pins", "blocks", "registered_blocks"), figures):
            sample(f"kvalloc_kv_namespace_{name}", value, (("namespace", namespace),))
    if snap.kv_latency is not None:
        sample("kvalloc_kv_call_sample_period", int(kv["call_sample_period"]))
        for k, call in enumerate(KV_CALL_KINDS):
            _histogram(families["kvalloc_kv_call_duration_seconds"], labels + (("call", call),),
                       snap.kv_latency[call], int(kv["call_timed"][k]),
                       int(kv["call_ns"][k]) / 1e9)


#: The most namespace series a pool exports: the library's writer tracks 32 namespaces and pools
#: the others in one "other" row.
NAMESPACE_SERIES_MAX = 33


def _namespace_series(rows: list[KvNamespaceShare]) -> dict[str, tuple[int, int, int, int]]:
    """Each namespace's (sequences, pins, blocks, registered blocks) by its ``namespace`` label:
    the id in decimal, "other" for the pooled row. At most NAMESPACE_SERIES_MAX: past the 32
    holding the most blocks, the rest are added to "other" (a newer writer may track more);
    a namespace listed twice (a damaged writer) is added up, so no series is written twice."""
    merged: dict[int | None, list[int]] = {}
    for row in rows:
        figures = merged.setdefault(row.namespace, [0, 0, 0, 0])
        for i, value in enumerate((row.sequences, row.pins, row.blocks, row.registered_blocks)):
            figures[i] += value
    tracked = sorted((ns for ns in merged if ns is not None), key=lambda ns: -merged[ns][2])
    kept = tracked[:NAMESPACE_SERIES_MAX - 1]
    pooled = [merged[ns] for ns in tracked[NAMESPACE_SERIES_MAX - 1:]]
    if None in merged:
        pooled.append(merged[None])
    series = {str(ns): merged[ns] for ns in kept}
    if pooled:
        series["other"] = [sum(column) for column in zip(*pooled)]
    return {label: (f[0], f[1], f[2], f[3]) for label, f in series.items()}


@dataclass
class ExporterState:
    """What the exporter counts across scrapes."""

    max_segments: int = MAX_SEGMENTS
    directory: Path = SHM_DIR
    scrapes: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {
        "limit": 0, "vanished": 0, "dead": 0, "error": 0})
    errors: dict[str, int] = field(default_factory=dict)

    def count_error(self, kind: str) -> None:
        self.skipped["error"] += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


def read_segment(found: SegmentFile) -> Snapshot:
    """One consistent snapshot of a live writer's segment; the reader's ``SegmentError`` for
    anything else (``SegmentNotFound`` when it vanished, ``WriterGone`` when its writer died)."""
    with Segment(found.path) as segment:
        return segment.snapshot()


def scrape(state: ExporterState) -> str:
    """The exposition text of one scrape: every live segment's metrics (at most
    ``state.max_segments`` read), then the exporter's own."""
    started = time.perf_counter()
    state.scrapes += 1
    families = _families(SEGMENT_FAMILIES)
    try:
        found = list_segments(state.directory)
    except SegmentError as exc:
        state.count_error(exc.kind)
        found = []
    read, over = found[:state.max_segments], found[state.max_segments:]
    state.skipped["limit"] += len(over)
    exported = 0
    for segment in read:
        try:
            snap = read_segment(segment)
            # The file's name, not the header's: (pid, name) is unique in a directory, so no
            # two segments (a forged header among them) can make one series twice.
            labels = (("pool", segment.name), ("pid", str(segment.pid)),
                      ("process", process_name(segment.pid) or ""))
            pool = _families(SEGMENT_FAMILIES)
            _pool_samples(pool, labels, snap)
            _kv_samples(pool, labels, snap)
        except (SegmentNotFound, SegmentRemoved):
            state.skipped["vanished"] += 1
            continue
        except DeadWriter:
            state.skipped["dead"] += 1
            continue
        except SegmentError as exc:
            state.count_error(exc.kind)
            continue
        except Exception:  # noqa: BLE001 - a writer's bytes the parser did not foresee
            state.count_error("unexpected")
            continue
        for name, family in pool.items():  # a segment's samples all, or none of them
            families[name].samples.extend(family.samples)
        exported += 1
    own = _families(EXPORTER_FAMILIES)
    own["kvalloc_exporter_scrapes_total"].add((), state.scrapes)
    own["kvalloc_exporter_segments_seen"].add((), len(found))
    own["kvalloc_exporter_segments_exported"].add((), exported)
    own["kvalloc_exporter_max_segments"].add((), state.max_segments)
    for reason, count in state.skipped.items():
        own["kvalloc_exporter_segments_skipped_total"].add((("reason", reason),), count)
    for kind, count in sorted(state.errors.items()):
        own["kvalloc_exporter_segment_errors_total"].add((("kind", kind),), count)
    own["kvalloc_exporter_scrape_duration_seconds"].add((), time.perf_counter() - started)
    # A family no segment gave samples to is left out; the exporter's own are always there.
    shown = [f for f in families.values() if f.samples] + list(own.values())
    return "".join(f.text() for f in shown)


def _families(kinds: dict[str, tuple[str, str]]) -> dict[str, Family]:
    return {name: Family(name, kind, text) for name, (kind, text) in kinds.items()}
