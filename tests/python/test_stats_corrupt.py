"""Segments that are wrong in every way a reader can meet: each raises its own clear error, and no
bad offset is followed. The files are real ones in /dev/shm, made from a real segment's bytes
and then damaged; their names carry this process's pid, so the writer counts as alive."""

from __future__ import annotations

import time

import numpy as np
import pytest
from stats_writer import crafted_segment, unique_name

import pykvalloc
from pykvalloc import stats
from pykvalloc.errors import (
    BadMagic,
    CorruptSegment,
    InconsistentSnapshot,
    KvallocError,
    SegmentError,
    TruncatedSegment,
    UnsupportedVersion,
)


@pytest.fixture(scope="module")
def original() -> bytes:
    """A consistent copy of a real, partly used pool's segment."""
    with pykvalloc.Pool(16 << 20, name=unique_name("corrupt"), pages="small") as pool:
        blocks = [pool.alloc(64) for _ in range(40)] + [pool.alloc(300_000) for _ in range(3)]
        pool.free(blocks[0])
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            return segment.snapshot().data


def header_of(data: bytearray) -> np.ndarray:
    return np.frombuffer(data, stats.HEADER_DTYPE, count=1)


def section_entry(data: bytearray, kind: int) -> np.ndarray:
    entries = header_of(data)["sections"][0]
    return entries[list(entries["kind"]).index(kind)]


def read(data: bytes) -> stats.Snapshot:
    with crafted_segment(data) as path, stats.Segment(path) as segment:
        return segment.snapshot()


def damaged(original: bytes, change) -> bytes:
    data = bytearray(original)
    change(data)
    return bytes(data)


def test_the_undamaged_copy_reads(original):
    snap = read(original)
    assert snap.summary["live_allocations"] == 42


@pytest.mark.parametrize("magic", [0x1122334455667788, int.from_bytes(b"KVASTAT2", "little")])
def test_wrong_magic(original, magic):
    def change(data):
        header_of(data)["magic"] = magic
    with pytest.raises(BadMagic, match="not a kvalloc statistics segment"):
        read(damaged(original, change))


def test_a_magic_that_stays_zero_is_given_up_on(original):
    def change(data):
        header_of(data)["magic"] = 0
    with pytest.raises(BadMagic, match="magic stayed zero"):
        read(damaged(original, change))


def test_unknown_major_version(original):
    def change(data):
        header_of(data)["abi_major"] = 2
    with pytest.raises(UnsupportedVersion, match=r"layout version 2\."):
        read(damaged(original, change))


@pytest.mark.parametrize("length", [0, 4, 100, stats.HEADER_DTYPE.itemsize + 8, -8])
def test_truncated_files(original, length):
    with pytest.raises(TruncatedSegment, match="truncated"):
        read(original[:length])


@pytest.mark.parametrize("kind", [stats.SECTION_SUMMARY, stats.SECTION_HEAPMAP,
                                  stats.SECTION_TRACE])
@pytest.mark.parametrize("where", ["past the end", "huge size", "inside the header",
                                   "misaligned", "wraps around"])
def test_sections_outside_the_segment(original, kind, where):
    size = len(original)

    def change(data):
        entry = section_entry(data, kind)
        if where == "past the end":
            entry["offset"] = size + 8
        elif where == "huge size":
            entry["size"] = size
        elif where == "inside the header":
            entry["offset"] = 8
        elif where == "misaligned":
            entry["offset"] += 4
        else:
            entry["size"] = 2**64 - 8  # offset + size overflows 64 bits
    with pytest.raises(CorruptSegment, match="section"):
        read(damaged(original, change))


@pytest.mark.parametrize("field, value, message", [
    ("section_count", 17, "section_count 17"),
    ("header_size", 64, "header_size 64"),
    ("segment_size", 1 << 40, "truncated"),
])
def test_header_fields_that_contradict_the_file(original, field, value, message):
    def change(data):
        header_of(data)[field] = value
    with pytest.raises(CorruptSegment, match=message):
        read(damaged(original, change))


def counts(kind: int, dtype: np.dtype, field: str, value: int):
    def change(data):
        offset = int(section_entry(data, kind)["offset"])
        np.frombuffer(data, dtype, count=1, offset=offset)[field] = value
    return change


@pytest.mark.parametrize("change, message", [
    (counts(stats.SECTION_HEAPMAP, stats.HEAPMAP_DTYPE, "cells", 1 << 30), "heap map"),
    (counts(stats.SECTION_CLASSES, stats.COUNTED_DTYPE, "count", 1 << 20), "classes"),
    (counts(stats.SECTION_ARENAS, stats.COUNTED_DTYPE, "count", 1 << 20), "arenas"),
    (counts(stats.SECTION_SLABS, stats.SLABS_DTYPE, "count", 1 << 31), "slabs"),
    (counts(stats.SECTION_SLABS, stats.SLABS_DTYPE, "capacity", 1 << 31), "slabs"),
    (counts(stats.SECTION_TRACE, stats.TRACE_DTYPE, "capacity", 1 << 31), "trace"),
    (counts(stats.SECTION_SUMMARY, stats.SUMMARY_DTYPE, "num_orders", 49), "num_orders 49"),
])
def test_counts_larger_than_their_section(original, change, message):
    with pytest.raises(CorruptSegment, match=message):
        read(damaged(original, change))


def test_a_missing_summary(original):
    def change(data):
        section_entry(data, stats.SECTION_SUMMARY)["kind"] = 0
    with pytest.raises(CorruptSegment, match="no summary"):
        read(damaged(original, change))


def test_unknown_sections_and_missing_optional_ones_are_tolerated(original):
    def change(data):
        section_entry(data, stats.SECTION_KV)["kind"] = 42      # a kind from the future
        section_entry(data, stats.SECTION_TRACE)["kind"] = 0    # not published
    snap = read(damaged(original, change))
    assert snap.kv is None and snap.trace is None and snap.summary["live_allocations"] == 42


def test_an_odd_sequence_forever_is_inconsistent_not_torn(original):
    def change(data):
        header_of(data)["sequence"] |= 1  # a writer that never finishes its publish
    started = time.monotonic()
    with pytest.raises(InconsistentSnapshot, match=f"in {stats.SNAPSHOT_ATTEMPTS} attempts"):
        read(damaged(original, change))
    assert time.monotonic() - started < 1.0  # bounded, and quickly


def test_a_newer_minor_version_with_grown_entries_still_reads(original):
    # A newer minor version may add fields at the end of an array entry: the reader takes the
    # stride from the entry size the section states. Rebuild the classes section with 8 more bytes
    # per entry, at the file's end.
    snap = read(original)
    grown = np.zeros(len(snap.classes), [("entry", stats.CLASS_DTYPE), ("added", "<u8")])
    grown["entry"] = snap.classes
    grown["added"] = 7
    head = np.zeros(1, stats.COUNTED_DTYPE)
    head["count"] = len(snap.classes)
    head["entry_size"] = grown.itemsize
    section = head.tobytes() + grown.tobytes()
    data = bytearray(original) + section + bytes(-len(section) % 8)
    entry = section_entry(data, stats.SECTION_CLASSES)
    entry["offset"], entry["size"] = len(original), len(section)
    header_of(data)["segment_size"] = len(data)
    header_of(data)["abi_minor"] = stats.ABI_MINOR + 1
    newer = read(bytes(data))
    assert newer.abi == (1, stats.ABI_MINOR + 1)
    assert newer.classes.tolist() == snap.classes.tolist()


def test_every_error_is_a_segment_error_naming_the_file(original):
    def change(data):
        header_of(data)["abi_major"] = 9
    data = damaged(original, change)
    with crafted_segment(data) as path, stats.Segment(path) as segment:
        with pytest.raises(SegmentError) as info:
            segment.snapshot()
    assert isinstance(info.value, KvallocError) and info.value.path == str(path)
    assert str(path) in str(info.value)
