"""Segments that are wrong in every way a reader can meet: each raises its own clear error, and no
bad offset is followed. The files are real ones in /dev/shm, made from a real segment's bytes
and then damaged; their names carry this process's pid, so the writer counts as alive."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from stats_writer import crafted_segment, unique_name

import pykvalloc
import kvalloc_cli
from pykvalloc import stats
from pykvalloc.errors import (
    BadMagic,
    CorruptSegment,
    InconsistentSnapshot,
    KvallocError,
    SegmentError,
    SegmentUnreadable,
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


def test_a_zero_magic_costs_a_reader_a_few_reads_not_the_whole_backoff(original, monkeypatch):
    # A file planted with a zero magic looks like a segment being set up; every `kvalloc ls`
    # meets it, so giving up on it must not take the full backoff of a busy writer.
    reads = []
    real_pread = os.pread

    def counting_pread(fd, length, offset):
        reads.append(offset)
        return real_pread(fd, length, offset)

    def change(data):
        header_of(data)["magic"] = 0
    with crafted_segment(damaged(original, change)) as path, stats.Segment(path) as segment:
        monkeypatch.setattr(os, "pread", counting_pread)
        with pytest.raises(BadMagic, match="magic stayed zero"):
            segment.snapshot()
    assert 0 < len(reads) <= 4


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
                                  stats.SECTION_TRACE, stats.SECTION_KV_SEQUENCES,
                                  stats.SECTION_KV_NAMESPACES])
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
    # Counts no writer makes are refused before anything is sized by them.
    (counts(stats.SECTION_HEAPMAP, stats.HEAPMAP_DTYPE, "cells", 16385), "more than the 16384"),
    (counts(stats.SECTION_SLABS, stats.SLABS_DTYPE, "capacity", 65537), "more than the 65536"),
    (counts(stats.SECTION_TRACE, stats.TRACE_DTYPE, "capacity", 65537), "more than the 65536"),
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
    with pytest.raises(InconsistentSnapshot, match=f"in {stats.SNAPSHOT_ATTEMPTS} attempts"):
        read(damaged(original, change))


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


KV_1_0_SIZE = stats.KV_DTYPE.fields["peak_used_blocks"][1]  # the KV section ended at block_bytes
KV_ADDED_1_4 = tuple(name for name in stats.KV_DTYPE.names
                     if stats.KV_DTYPE.fields[name][1] >= KV_1_0_SIZE)


def layout_1_0(original: bytes) -> bytes:
    """``original`` as a writer of layout 1.0 wrote it: the summary without its 1.1 fields (the
    24 bytes after it filled with 0xff, which the reader must not take for them), no entry
    sizes in the array heads (reserved, zero), no liveness lock, and the arena entry of then
    (other counters, 32 bytes, one arena)."""
    data = bytearray(original)
    header = header_of(data)
    header["abi_minor"] = 0
    header["capabilities"] &= ~np.uint64(stats.CAP_LIVENESS_LOCK | stats.CAP_TRACE_ALL)
    summary = section_entry(data, stats.SECTION_SUMMARY)
    summary["size"] = stats.SUMMARY_DTYPE.fields["publish_interval_ms"][1]
    start = int(summary["offset"]) + int(summary["size"])
    data[start:start + 24] = b"\xff" * 24
    section_entry(data, stats.SECTION_KV)["size"] = KV_1_0_SIZE
    for kind, dtype in ((stats.SECTION_CLASSES, stats.COUNTED_DTYPE),
                        (stats.SECTION_ARENAS, stats.COUNTED_DTYPE),
                        (stats.SECTION_TRACE, stats.TRACE_DTYPE)):
        counts(kind, dtype, "entry_size", 0)(data)
    counts(stats.SECTION_ARENAS, stats.COUNTED_DTYPE, "count", 1)(data)
    section_entry(data, stats.SECTION_ARENAS)["size"] = stats.COUNTED_DTYPE.itemsize + 32
    return bytes(data)


def test_a_segment_of_layout_1_0_reads_with_its_newer_fields_absent(original, capsys):
    # kvalloc_stats.h: a reader accepts the same abi_major. What 1.0 wrote reads as it was
    # written; what it did not write (the summary's 1.1 fields) is absent, never guessed, and
    # the arenas, whose entries meant other counters before 1.2, are not shown as today's.
    current = read(original)
    with crafted_segment(layout_1_0(original)) as path, stats.Segment(path) as segment:
        snap = segment.snapshot()
        assert kvalloc_cli.main(["dump", str(path)]) == 0
        assert kvalloc_cli.main(["dump", str(path), "--json", "--trace"]) == 0
    tables, dumped = capsys.readouterr().out.split("\n{\n", 1)
    dumped = json.loads("{\n" + dumped)
    assert dumped["abi"] == "1.0" and dumped["summary"]["publish_interval_ms"] is None
    assert "arenas" not in dumped and len(dumped["trace"]) == len(list(snap.trace_records()))
    assert "Pool statistics" in tables
    assert snap.abi == (1, 0)
    assert snap.absent == {"summary": stats.SUMMARY_ADDED_1_1 + stats.SUMMARY_ADDED_1_4,
                           "kv": KV_ADDED_1_4}
    summary = snap.to_dict()["summary"]
    assert all(summary[name] is None for name in stats.SUMMARY_ADDED_1_1 + stats.SUMMARY_ADDED_1_4)
    assert {name: summary[name] for name in stats.SUMMARY_COUNTERS} == {
        name: int(current.summary[name]) for name in stats.SUMMARY_COUNTERS}
    assert summary["free_blocks"] == [int(n) for n in current.free_blocks]
    assert snap.arenas is None and "arenas" not in snap.to_dict()
    assert snap.classes.tolist() == current.classes.tolist()
    assert snap.slabs.tobytes() == current.slabs.tobytes()
    assert list(snap.trace_records()) == list(current.trace_records())
    assert snap.cell_state.tolist() == current.cell_state.tolist()


def test_arena_entries_written_before_numa_node_read_without_it(original):
    # The arena entry of 1.2 first ended before numa_node: 32 bytes, its entry size says so.
    current = read(original)
    data = bytearray(original)
    offset = int(section_entry(data, stats.SECTION_ARENAS)["offset"])
    older = np.zeros(len(current.arenas), [(name, "<u8") for name in
                                           ("slabs", "slab_bytes", "spare_slabs", "word_claims")])
    for name in older.dtype.names:
        older[name] = current.arenas[name]
    head = offset + stats.COUNTED_DTYPE.itemsize
    data[head:head + older.nbytes] = older.tobytes()
    counts(stats.SECTION_ARENAS, stats.COUNTED_DTYPE, "entry_size", 32)(data)
    section_entry(data, stats.SECTION_ARENAS)["size"] = stats.COUNTED_DTYPE.itemsize + older.nbytes
    snap = read(bytes(data))
    assert snap.absent == {"arenas": ("numa_node",)}
    arenas = snap.to_dict()["arenas"]
    assert [a["slabs"] for a in arenas] == current.arenas["slabs"].tolist()
    assert [a["word_claims"] for a in arenas] == current.arenas["word_claims"].tolist()
    assert all(a["numa_node"] is None for a in arenas)


def test_structs_shorter_than_their_oldest_layout_are_corrupt(original):
    def change(data):
        section_entry(data, stats.SECTION_SUMMARY)["size"] = 100
    with pytest.raises(CorruptSegment, match="summary section holds structs of 100 bytes"):
        read(damaged(original, change))


def test_a_file_longer_than_its_segment_is_copied_only_as_far_as_the_header_states(original):
    with crafted_segment(original + b"\xee" * (1 << 20)) as path, stats.Segment(path) as segment:
        assert segment.snapshot().data == original


def test_a_header_stating_more_than_a_segment_may_have_is_corrupt(original):
    # A sparse file: its holes cost nothing until read, and the reader reads only the header.
    size = stats.MAX_SEGMENT_BYTES + 4096
    data = bytearray(original)
    header_of(data)["segment_size"] = size
    with crafted_segment(bytes(data)) as path:
        os.truncate(path, size)
        with stats.Segment(path) as segment:
            with pytest.raises(CorruptSegment, match=f"states {size} bytes, more than"):
                segment.snapshot()


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_file_that_is_no_segment_file_is_unreadable_not_an_os_error(original, kind):
    path = stats.SHM_DIR / f"kvalloc.{os.getpid()}.{unique_name(kind)}"
    with crafted_segment(original) as target:
        try:
            if kind == "directory":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)  # opening it for reading must not wait for a writer
            else:
                path.symlink_to(target)
            with pytest.raises(SegmentUnreadable, match=str(path)) as info:
                stats.Segment(path)
            assert info.value.path == str(path)
            assert stats.SegmentFile.from_path(path).process_alive()  # by its pid: this process
        finally:
            path.rmdir() if kind == "directory" else path.unlink()
