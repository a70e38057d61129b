"""The trace readers, the embedded default workload and the prefix keys of the replay."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pykvalloc.replay import traces
from pykvalloc.replay.simulator import block_keys
from pykvalloc.replay.traces import (MOONCAKE_BLOCK_TOKENS, Request, TraceError, load_trace, parse_azure_csv,
                                     parse_mooncake_jsonl)
from pykvalloc.replay.workload import default_workload

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"the shared traces are not at {SHARED}")

AZURE_SAMPLE = ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                "2023-11-16 18:15:46.6805900,374,44\r\n"
                "2023-11-16 18:15:50.9951690,396,109\r\n"
                "2023-11-16 18:15:51.2224670,879,55")          # the real file ends without a newline
MOONCAKE_SAMPLE = ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
                   '{"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 1]}\n')


def test_azure_reader_reads_times_and_lengths() -> None:
    trace = parse_azure_csv(AZURE_SAMPLE.splitlines(keepends=True))
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [(374, 44), (396, 109), (879, 55)]
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert trace.requests[2].hash_ids is None


@pytest.mark.parametrize("row, reason", [
    ("2023-11-16 18:15:52.0,12\r\n", "expected 3 columns"),
    ("not a time,12,3\r\n", "Invalid isoformat"),
    ("2023-11-16 18:15:52.0,-5,3\r\n", "ContextTokens must be a positive"),
    ("2023-11-16 18:15:52.0,5,zero\r\n", "GeneratedTokens must be a positive integer, got .zero."),
])
def test_azure_malformed_row_names_its_line(row: str, reason: str) -> None:
    text = AZURE_SAMPLE + "\r\n" + row
    with pytest.raises(TraceError, match=r"sample.csv:5: .*" + reason) as info:
        parse_azure_csv(text.splitlines(keepends=True), "sample.csv")
    assert info.value.line == 5
    assert isinstance(info.value, ValueError)
    trace = parse_azure_csv(text.splitlines(keepends=True), "sample.csv", skip_bad=True)
    assert len(trace.requests) == 3 and trace.skipped == 1 and trace.skipped_examples[0][0] == 5


def test_azure_header_is_required() -> None:
    with pytest.raises(TraceError, match="expected the header"):
        parse_azure_csv(["a,b,c\n", "1,2,3\n"])


def test_mooncake_reader_reads_ids() -> None:
    trace = parse_mooncake_jsonl(MOONCAKE_SAMPLE.splitlines())
    assert [r.hash_ids for r in trace.requests] == [(0, 1, 2), (0, 1)]
    assert [r.arrival_s for r in trace.requests] == [0.0, 3.0]


@pytest.mark.parametrize("line, reason", [
    ('{"timestamp": 1, "input_length": 10}', "missing field 'output_length'"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [0, 1]}', "2 hash_ids for 10 input"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 2}', "timestamp must be"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [0, "x"]}', "hash_ids must be"),
    ('[1, 2, 3]', "must be a JSON object"),
    ('{"timestamp": 1,', "Expecting"),
])
def test_mooncake_malformed_line_names_its_line(line: str, reason: str) -> None:
    lines = MOONCAKE_SAMPLE.splitlines() + [line]
    with pytest.raises(TraceError, match=r":3: .*" + reason):
        parse_mooncake_jsonl(lines, "m.jsonl")
    assert parse_mooncake_jsonl(lines, "m.jsonl", skip_bad=True).skipped == 1


def test_load_trace_detects_the_format(tmp_path: Path) -> None:
    csv_file, jsonl_file = tmp_path / "a.csv", tmp_path / "m.jsonl"
    csv_file.write_bytes(AZURE_SAMPLE.encode())
    jsonl_file.write_text(MOONCAKE_SAMPLE)
    assert len(load_trace(csv_file).requests) == 3
    assert len(load_trace(jsonl_file).requests) == 2
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no usable request"):
        load_trace(tmp_path / "empty.jsonl")


def test_default_workload_follows_the_published_statistics() -> None:
    trace = default_workload(20000, seed=7)
    inputs = [r.input_tokens for r in trace.requests]
    outputs = [r.output_tokens for r in trace.requests]
    assert statistics.median(inputs) == pytest.approx(1020, rel=0.05)
    assert sorted(inputs)[int(0.99 * len(inputs))] == pytest.approx(4142, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(129, rel=0.05)
    assert min(inputs) >= 2 and max(inputs) <= 14050 and 7 <= min(outputs) and max(outputs) <= 1000
    rate = len(trace.requests) / trace.requests[-1].arrival_s
    assert rate == pytest.approx(5.5, rel=0.05)
    assert all(r.hash_ids and r.hash_ids[0] == 0 for r in trace.requests)
    assert all(len(r.hash_ids) == -(-r.input_tokens // MOONCAKE_BLOCK_TOKENS) for r in trace.requests)
    assert default_workload(50, seed=3) == default_workload(50, seed=3)


def test_block_keys_follow_the_hash_id_and_position() -> None:
    request = Request(0.0, 1100, 5, (10, 11, 12))        # 512 + 512 + 76 tokens
    keys16 = block_keys(request, 16)
    assert len(keys16) == 1100 // 16                       # full 16-token blocks only
    assert len(set(keys16)) == len(keys16) and all(0 <= k < 1 << 64 for k in keys16)
    keys512 = block_keys(request, 512)
    assert len(keys512) == 2 and len(set(keys512)) == 2
    assert block_keys(Request(0.0, 100, 5, None), 16) is None
    assert block_keys(request, 48) is None                 # 48 neither divides 512 nor is a multiple
    # Two requests sharing their first id share exactly that id's blocks.
    other = Request(0.0, 600, 5, (10, 99))
    shared = [a == b for a, b in zip(block_keys(request, 16), block_keys(other, 16))]
    assert shared == [True] * 32 + [False] * (len(shared) - 32)
    # Ids that differ only above bit 56 (which an id << 8 would push out of 64 bits) stay apart.
    assert block_keys(Request(0.0, 512, 5, (1 << 56,)), 16) != block_keys(Request(0.0, 512, 5, (0,)), 16)


def test_block_keys_of_a_multiple_of_512_cover_its_ids() -> None:
    # A 1024-token block is keyed by its two ids together; 1100 tokens hold one full block.
    keys = block_keys(Request(0.0, 2100, 5, (10, 11, 12, 13, 14)), 1024)
    assert len(keys) == 2 and keys[0] != keys[1]
    assert block_keys(Request(0.0, 1100, 5, (10, 11, 12)), 1024) == keys[:1]
    assert block_keys(Request(0.0, 1100, 5, (10, 99, 12)), 1024) != keys[:1]


def test_mooncake_hash_ids_are_bounded_to_64_bits() -> None:
    line = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [%d, 1]}'
    assert parse_mooncake_jsonl([line % ((1 << 64) - 1)]).requests[0].hash_ids == ((1 << 64) - 1, 1)
    with pytest.raises(TraceError, match=r"<mooncake jsonl>:1: hash_ids must be a list of integers in 0 \.\. 2\^64-1"):
        parse_mooncake_jsonl([line % (1 << 64)])


def test_azure_times_are_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read in the machine's zone, the hour a clock springs forward vanished between two requests.
    import time
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        trace = parse_azure_csv(["TIMESTAMP,ContextTokens,GeneratedTokens\n", "2023-03-12 01:59:59.0000000,100,10\n",
                                 "2023-03-12 03:00:01.0000000,100,10\n"])
    finally:
        monkeypatch.undo()
        time.tzset()
    assert trace.requests[1].arrival_s == 3602.0


@needs_shared
def test_the_shared_traces_read_whole() -> None:
    azure = load_trace(SHARED / "azure2023_conv.csv")
    # PROVENANCE.md says 19,365: it counted line ends, and the last row has none.
    assert len(azure.requests) == 19366 and azure.skipped == 0
    assert statistics.median(r.input_tokens for r in azure.requests) == 1020
    mooncake = load_trace(SHARED / "mooncake_conversation_trace.jsonl")
    assert len(mooncake.requests) == 12031
    assert sum(len(r.hash_ids) for r in mooncake.requests) == 288500


def test_a_trace_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    # The bytes of the undecodable line are its own fault: the lines around it read.
    good = b'{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
    trace = tmp_path / "latin1.jsonl"
    trace.write_bytes(good + b'{"timestamp": 1, "input_length": 10, "output_length": 5, "n": "\xe9"}\n' + good)
    with pytest.raises(TraceError, match=r"latin1.jsonl:2: not UTF-8 text: byte 0xe9") as info:
        load_trace(trace)
    assert info.value.line == 2
    skipped = load_trace(trace, skip_bad=True)
    assert len(skipped.requests) == 2 and skipped.skipped_examples[0][0] == 2
    header = tmp_path / "header.csv"
    header.write_bytes(b"\xff\xfeTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n")
    with pytest.raises(TraceError, match=r"header.csv:1: expected the header"):
        load_trace(header)


@pytest.mark.parametrize("line", [
    '{"timestamp": NaN, "input_length": 10, "output_length": 5}',
    '{"timestamp": 1, "input_length": Infinity, "output_length": 5}',
    '{"timestamp": 1e999, "input_length": 10, "output_length": 5}',
    '{"timestamp": 1' + '0' * 400 + ', "input_length": 10, "output_length": 5}',
    '[' * 100_000 + ']' * 100_000,
])
def test_mooncake_numbers_must_be_finite_and_lines_plain(line: str) -> None:
    lines = MOONCAKE_SAMPLE.splitlines() + [line]
    with pytest.raises(TraceError, match=r"m.jsonl:3: "):
        parse_mooncake_jsonl(lines, "m.jsonl")
    trace = parse_mooncake_jsonl(lines, "m.jsonl", skip_bad=True)
    assert trace.skipped == 1 and len(trace.requests) == 2


def test_a_binary_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # A sparse file or /dev/zero was read whole into memory as one line (MemoryError).
    image = tmp_path / "disk.img"
    with open(image, "wb") as handle:
        handle.truncate(1 << 30)  # a gigabyte of NUL bytes, not written
    with pytest.raises(TraceError, match=r"disk.img: a binary file"):
        load_trace(image)


def test_a_line_with_no_end_is_refused_at_the_limit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(traces, "MAX_LINE", 64)
    endless = tmp_path / "endless.csv"
    endless.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "7" * 200)
    with pytest.raises(TraceError, match=r"endless.csv:2: a line longer than 64 characters"):
        load_trace(endless)
    fits = tmp_path / "fits.csv"  # a line of exactly the limit, its end included, is a line
    fits.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.6805900,374,44".ljust(63) + "\n")
    assert len(load_trace(fits).requests) == 1
