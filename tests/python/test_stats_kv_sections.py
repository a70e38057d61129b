"""The KV sequences and namespaces sections and the KV section's 1.5 fields, as the reader takes
them: written as a writer writes them, as a 1.4 writer left them out, and damaged every way a
reader can meet. The files are real ones in /dev/shm, made from a real KV cache's segment."""

from __future__ import annotations

import json

import numpy as np
import pytest
from stats_writer import crafted_segment, kv_segment_bytes, write_kv_sections

from pykvalloc import stats
from pykvalloc.errors import CorruptSegment


@pytest.fixture(scope="module")
def original() -> bytes:
    return kv_segment_bytes()


def read(data: bytes) -> stats.Snapshot:
    with crafted_segment(data) as path, stats.Segment(path) as segment:
        return segment.snapshot()


def section_entry(data: bytearray, kind: int) -> np.ndarray:
    entries = np.frombuffer(data, stats.HEADER_DTYPE, count=1)["sections"][0]
    return entries[list(entries["kind"]).index(kind)]


def head(data: bytearray, kind: int, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(data, dtype, count=1, offset=int(section_entry(data, kind)["offset"]))


ENTRIES = [
    {"handle": (3 << 32) | 5, "num_tokens": 300, "blocks": 150, "cached_tokens": 32,
     "namespace_id": (1 << 63) + 9, "priority": 7, "table": list(range(1000, 1128))},
    {"handle": 77, "num_tokens": 40, "blocks": 3, "flags": stats.KV_SEQ_PIN,
     "table": [4, 2, 9]},
    {"handle": 12, "num_tokens": 1, "blocks": 1, "table": []},  # a table not published at all
]
NAMESPACES = [
    {"namespace_id": 7, "sequences": 2, "pins": 1, "blocks": 12, "registered_blocks": 30},
    {"namespace_id": 0, "sequences": 1, "blocks": 150},
    {"flags": stats.KV_NS_OTHER, "sequences": 5, "pins": 2, "blocks": 40,
     "registered_blocks": 100},
]


def written(original: bytes) -> bytes:
    return write_kv_sections(original, live=9, pins=4, longest=(300, (3 << 32) | 5),
                             entries=ENTRIES, namespaces=NAMESPACES)


def test_the_sections_read_as_written(original):
    snap = read(written(original))
    sequences = snap.kv_sequences
    assert sequences is not None
    assert (sequences.live, sequences.pins, sequences.longest_tokens,
            sequences.longest_handle) == (9, 4, 300, (3 << 32) | 5)
    first, pin, bare = sequences.entries
    assert (first.handle, first.num_tokens, first.blocks, first.cached_tokens, first.namespace,
            first.priority, first.pin) == ((3 << 32) | 5, 300, 150, 32, (1 << 63) + 9, 7, False)
    # 128 of 150 ids: cut, and said so.
    assert first.table.tolist() == list(range(1000, 1128)) and not first.table_complete
    assert first.table.dtype == np.uint32 and not first.table.flags.writeable
    with pytest.raises(ValueError):
        first.table[0] = 1
    assert first == stats.KvSequenceEntry(**{**first.__dict__, "table": first.table.copy()})
    assert first != pin and len({first, pin, first}) == 2
    assert pin.pin and pin.table.tolist() == [4, 2, 9] and pin.table_complete
    assert bare.table.tolist() == [] and not bare.table_complete
    with pytest.raises(AttributeError):
        first.handle = 1  # type: ignore[misc]
    assert snap.kv_namespaces == [
        stats.KvNamespaceShare(7, 2, 1, 12, 30), stats.KvNamespaceShare(0, 1, 0, 150, 0),
        stats.KvNamespaceShare(None, 5, 2, 40, 100)]


def test_to_dict_carries_them_as_json(original):
    dumped = json.loads(json.dumps(read(written(original)).to_dict()))
    assert dumped["kv_sequences"]["live"] == 9
    assert dumped["kv_sequences"]["entries"][1] == {
        "handle": 77, "num_tokens": 40, "blocks": 3, "cached_tokens": 0, "namespace": 0,
        "priority": 0, "pin": True, "table": [4, 2, 9], "table_complete": True}
    assert dumped["kv_namespaces"][2] == {"namespace": None, "sequences": 5, "pins": 2,
                                          "blocks": 40, "registered_blocks": 100}
    for name in stats.KV_ADDED_1_5:
        assert dumped["kv"][name] == 0


def test_the_1_5_kv_fields_and_the_hit_rates_apart(original):
    data = bytearray(original)
    kv = head(data, stats.SECTION_KV, stats.KV_DTYPE)
    kv["hit_tokens"], kv["query_tokens"] = 70, 200
    kv["readmit_hit_tokens"], kv["readmit_query_tokens"] = 50, 100
    kv["pinned_blocks"] = 6
    snap = read(bytes(data))
    assert snap.kv is not None and int(snap.kv["pinned_blocks"]) == 6
    assert snap.hit_rates == (0.2, 0.5)  # first admissions 20 of 100, re-admissions 50 of 100
    assert "kv" not in snap.absent


def as_1_4(original: bytes) -> bytes:
    """``original`` as a writer of layout 1.4 wrote it: the KV section ends at its latency
    histograms (the bytes after them 0xff, which the reader must not take for the 1.5 fields),
    and neither new section exists."""
    data = bytearray(original)
    np.frombuffer(data, stats.HEADER_DTYPE, count=1)["abi_minor"] = 4
    kv = section_entry(data, stats.SECTION_KV)
    kv["size"] = stats.KV_DTYPE.fields["pinned_blocks"][1]
    end = int(kv["offset"]) + int(kv["size"])
    data[end:end + 24] = b"\xff" * 24
    for kind in (stats.SECTION_KV_SEQUENCES, stats.SECTION_KV_NAMESPACES):
        section_entry(data, kind)["kind"] = 0
    return bytes(data)


def test_a_1_4_writer_has_the_new_fields_absent_and_no_new_sections(original):
    snap = read(as_1_4(original))
    assert snap.kv is not None and snap.abi == (1, 4)
    assert set(stats.KV_ADDED_1_5) <= set(snap.absent["kv"])
    for name in stats.KV_ADDED_1_5:
        assert int(snap.kv[name]) == 0
    assert snap.kv_sequences is None and snap.kv_namespaces is None and snap.hit_rates is None
    dumped = snap.to_dict()
    assert all(dumped["kv"][name] is None for name in stats.KV_ADDED_1_5)
    assert dumped["kv_sequences"] is None and dumped["kv_namespaces"] is None
    assert dumped["kv"]["peak_used_blocks"] is not None  # what 1.4 wrote still reads


def test_without_a_kv_cache_both_are_none(original):
    data = bytearray(written(original))
    head(data, stats.SECTION_KV, stats.KV_DTYPE)["present"] = 0
    snap = read(bytes(data))
    assert snap.kv is None and snap.kv_sequences is None and snap.kv_namespaces is None


def test_a_newer_writer_with_longer_entries_still_reads(original):
    # A newer minor version may add fields after an entry's table: the stride is entry_size.
    snap = read(written(original))
    assert snap.kv_sequences is not None and snap.kv_namespaces is not None
    seq_head = np.zeros(1, stats.KV_SEQUENCES_DTYPE)
    seq_head[0] = head(bytearray(written(original)), stats.SECTION_KV_SEQUENCES,
                       stats.KV_SEQUENCES_DTYPE)[0]
    grown = np.zeros(int(seq_head["capacity"][0]),
                     [("entry", stats.KV_SEQUENCE_DTYPE), ("added", "<u8")])
    for i, entry in enumerate(ENTRIES):
        for name, value in entry.items():
            if name == "table":
                grown["entry"]["table"][i][:len(value)] = value
            else:
                grown["entry"][name][i] = value
        grown["entry"]["table_len"][i] = len(entry["table"])
    grown["added"] = 0xFFFF_FFFF_FFFF_FFFF
    seq_head["entry_size"] = grown.itemsize
    section = seq_head.tobytes() + grown.tobytes()
    data = bytearray(written(original)) + section + bytes(-len(section) % 8)
    entry = section_entry(data, stats.SECTION_KV_SEQUENCES)
    entry["offset"], entry["size"] = len(data) - len(section) - (-len(section) % 8), len(section)
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["segment_size"] = len(data)
    header["abi_minor"] = stats.ABI_MINOR + 1
    newer = read(bytes(data))
    assert newer.kv_sequences == snap.kv_sequences


def change_seq(field: str, value: int):
    def change(data: bytearray) -> None:
        head(data, stats.SECTION_KV_SEQUENCES, stats.KV_SEQUENCES_DTYPE)[field] = value
    return change


def change_ns(field: str, value: int):
    def change(data: bytearray) -> None:
        head(data, stats.SECTION_KV_NAMESPACES, stats.KV_NAMESPACES_DTYPE)[field] = value
    return change


def change_entry(field: str, value: int):
    def change(data: bytearray) -> None:
        offset = int(section_entry(data, stats.SECTION_KV_SEQUENCES)["offset"])
        np.frombuffer(data, stats.KV_SEQUENCE_DTYPE, count=1,
                      offset=offset + stats.KV_SEQUENCES_DTYPE.itemsize)[field] = value
    return change


def shrink(kind: int, by: int):
    def change(data: bytearray) -> None:
        section_entry(data, kind)["size"] -= by
    return change


def sized(kind: int, size: int):
    def change(data: bytearray) -> None:
        section_entry(data, kind)["size"] = size
    return change


@pytest.mark.parametrize("change, message", [
    (change_seq("count", 17), "counts 17 entries in room for 16"),
    (change_seq("count", 1 << 31), "counts"),
    (change_seq("capacity", 1 << 20), "more than the 1024"),
    (change_seq("table_capacity", 1 << 30), "more than the 65536"),
    (change_seq("table_capacity", 129), "table of 129 ids"),
    (change_seq("entry_size", 8), "entries of 8 bytes"),
    (change_seq("entry_size", 0), "entries of 0 bytes"),
    (change_seq("entry_size", 564), "entries of 564 bytes"),  # not a multiple of 8
    (change_seq("entry_size", 1 << 20), "too few for 16 entries"),
    (change_seq("capacity", 17), "too few for 17 entries"),
    (shrink(stats.SECTION_KV_SEQUENCES, 8), "too few for 16 entries"),
    (change_entry("table_len", 151), "holds 151 block ids of a table of 150"),
    (change_entry("table_len", 129), "in room for 128"),
    (change_entry("table_len", 1 << 31), "block ids"),
    (change_ns("count", 34), "counts 34 rows in room for 33"),
    (change_ns("capacity", 1 << 20), "more than the 1024"),
    (change_ns("entry_size", 0), "no entry size"),
    (change_ns("entry_size", 40), "structs of 40 bytes"),
    (change_ns("entry_size", 1 << 16), "too few"),
    (shrink(stats.SECTION_KV_NAMESPACES, 8), "too few"),
    (sized(stats.SECTION_KV_SEQUENCES, 16), "fewer than the 48"),  # smaller than its head
    (sized(stats.SECTION_KV_NAMESPACES, 8), "fewer than the 16"),
])
def test_damaged_sections_are_refused_cleanly(original, change, message):
    data = bytearray(written(original))
    change(data)
    with pytest.raises(CorruptSegment, match=message):
        read(bytes(data))
