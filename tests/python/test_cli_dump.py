"""``kvalloc dump``: one snapshot as rich tables or as JSON, read from another process's pool."""

from __future__ import annotations

import json

import psutil
import pytest
import numpy as np
from stats_writer import (Writer, crafted_segment, kv_segment_bytes, prune_lock, segment_bytes,
                          unique_name)
from support import run_kvalloc

import pykvalloc
from pykvalloc import stats
from kvalloc_cli import main

MiB = 1 << 20


def test_json_equals_the_writers_own_figures(capsys):
    with Writer(unique_name("dump"), trace=True) as writer:
        writer.ask("alloc 64 300")
        writer.ask("alloc 200000 6")
        writer.ask("free_every 4")
        writer.ask(f"fail {15 * MiB}")
        writer.ask("publish")
        truth = writer.ask("stats")
        assert main(["dump", writer.name, "--json"]) == 0
        plain = json.loads(capsys.readouterr().out)
        assert main(["dump", str(writer.pid), "--json", "--trace"]) == 0
        traced = json.loads(capsys.readouterr().out)

    expected = truth["stats"]
    summary = plain["summary"]
    assert {key: summary[key] for key in summary if key in expected} == {
        key: list(value) if key == "free_blocks" else value
        for key, value in expected.items() if key in summary}
    assert set(stats.SUMMARY_COUNTERS) <= set(expected) & set(summary)
    assert summary["num_orders"] == len(expected["free_blocks"])
    assert [c["live_objects"] for c in plain["classes"]] == [
        c["live_objects"] for c in truth["classes"]]
    assert [c["slabs"] for c in plain["classes"]] == [c["slabs"] for c in truth["classes"]]
    assert plain["pool"] == writer.name and plain["pid"] == writer.pid
    assert plain["process"] == psutil.Process().name()  # the same interpreter
    assert plain["segment"] == str(writer.path) and plain["kv"] is None
    assert plain["heapmap"]["cells"] == len(plain["heapmap"]["state"])
    assert len(plain["arenas"]) == expected["arenas"]
    assert sum(a["slabs"] for a in plain["arenas"]) == expected["slab_count"]
    latency = plain["latency"]["alloc"]
    assert latency["samples"] == expected["alloc_count"] + 1 == sum(latency["buckets"])
    assert latency["p50_ns"] <= latency["p99_ns"] <= latency["p999_ns"]
    assert "trace" not in plain

    calls = expected["alloc_count"] + expected["free_count"] + 1
    assert traced["trace_written"] == calls
    assert len(traced["trace"]) == min(calls, 1024)
    failure = traced["trace"][-1]
    assert failure["op"] == "alloc" and failure["status_name"] == "out of memory"
    assert failure["size"] == 15 * MiB and failure["offset"] is None


def test_tables_for_people(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    name = unique_name("dump")
    with pykvalloc.Pool(16 * MiB, name=name) as pool:
        blocks = [pool.alloc(64) for _ in range(50)] + [pool.alloc(200_000) for _ in range(5)]
        with pytest.raises(pykvalloc.OutOfMemory):
            pool.alloc(15 * MiB)
        pool.publish()
        assert main(["dump", name, "--trace"]) == 0
        del blocks
    out = capsys.readouterr().out
    for expected in (name, "Pool statistics", "Free buddy blocks per order", "unusable",
                     "heap map", "· free", "█ block", "Slab size classes in use", "64 B",
                     "Call latency", "not timed: a pool times its calls only with trace on",
                     "no KV cache attached",
                     "Recent operations (1 recorded", "out of memory",
                     "trace off: only failed and rejected calls"):
        assert expected in out, expected
    heap_rows = [line for line in out.splitlines() if line.startswith("│ ") and "█" in line]
    assert heap_rows and all(len(line) <= 100 for line in heap_rows)


def test_the_heap_map_is_coloured_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    name = unique_name("colour")
    with pykvalloc.Pool(16 * MiB, name=name) as pool:
        block = pool.alloc(1 * MiB)
        pool.publish()
        assert main(["dump", name]) == 0
        del block
    out = capsys.readouterr().out
    assert "\x1b[" in out and "█" in out


def test_a_dead_writer_is_reported_not_dumped(capsys):
    with prune_lock(exclusive=False), Writer(unique_name("dead")) as writer:
        writer.kill()
        assert main(["dump", str(writer.path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvalloc dump: process {writer.pid}")
    assert "kvalloc ls --prune" in err


def test_no_such_pool(capsys):
    assert main(["dump", unique_name("absent")]) == 1
    assert capsys.readouterr().err.startswith("kvalloc dump: no pool segment matches")


def test_a_segment_removed_while_it_is_read(capsys):
    name = unique_name("gone")
    pool = pykvalloc.Pool(16 * MiB, name=name)
    segment = stats.open_segment(name)
    pool.close()
    with pytest.raises(pykvalloc.errors.SegmentRemoved):
        segment.snapshot()
    segment.close()
    assert main(["dump", name]) == 1
    assert capsys.readouterr().err.startswith(f"kvalloc dump: no pool segment matches {name!r}")


def refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_json_stays_json_when_a_segment_holds_nan(capsys):
    # The library never writes NaN or infinity, but a corrupt or foreign segment may hold them:
    # dump --json printed them as Python's NaN and Infinity, which strict parsers (jq) refuse.
    data = bytearray(segment_bytes())
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)[0]
    offset = next(int(s["offset"]) for s in header["sections"] if int(s["kind"]) == stats.SECTION_SUMMARY)
    summary = np.frombuffer(data, stats.SUMMARY_DTYPE, count=1, offset=offset)
    summary["fragmentation"] = float("nan")
    summary["unusable_index"][0][0] = float("inf")
    with crafted_segment(bytes(data)) as path:
        assert main(["dump", str(path), "--json"]) == 0
        dumped = json.loads(capsys.readouterr().out, parse_constant=refuse_constant)
    assert dumped["summary"]["fragmentation"] is None  # unknown, not a number
    assert dumped["summary"]["unusable_index"][0] is None


def test_a_kv_cache_comes_first_with_the_use_ls_shows_at_80_columns():
    name = unique_name("dumpkv")
    with pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64, name=name) as cache:
        held = cache.allocate(16 * 16)
        cache.allocate(8 * 16, block_keys=list(range(1, 9))).free()
        cache.publish()
        dumped = run_kvalloc("dump", name)  # piped: 80 columns
        assert dumped.returncode == 0, dumped.stderr
        lines = dumped.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), lines
        assert "KV 25.0% +12.5% cached" in lines[0]  # the header: ls's figure
        titles = [line.split("  ")[0].strip() for line in lines if line[:1].isalpha()]
        assert titles.index("KV cache") < titles.index("Pool statistics")  # the KV cache first
        kv_table = lines[next(i for i, line in enumerate(lines) if line.startswith("KV cache")):]
        assert any("KV 25.0% +12.5% cached" in line for line in kv_table[:10])
        # Peaks (24 used at most, before the 8 went to the prefix cache) and the calls by kind.
        assert any("peak used / cached" in line and "24 (37.5%) / 8 (12.5%)" in line for line in lines)
        assert any(line.startswith("KV call latency (upper bounds of log2 buckets)") for line in lines)
        calls = {line.split()[1]: line for line in lines if line.startswith("│") and len(line.split()) > 3}
        assert {"allocate", "append", "free", "lookup", "evict"} <= set(calls)
        assert any("peak in buddy blocks" in line for line in lines)
        held.free()


def test_pins_hit_rates_sequences_and_namespaces_at_80_columns_and_in_json():
    from test_tui_kv import kv_segment

    with crafted_segment(kv_segment(kv_segment_bytes())) as path:
        dumped = run_kvalloc("dump", str(path))  # piped: 80 columns
        as_json = run_kvalloc("dump", str(path), "--json")
    assert dumped.returncode == 0 and as_json.returncode == 0, dumped.stderr + as_json.stderr
    lines = dumped.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    text = "\n".join(lines)
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in lines if line.count("│") == 3}
    assert rows["of them pinned"] == "40"
    assert rows["first admissions"] == "19.1% (2,100 of 11,000 tokens)"
    assert rows["re-admissions"] == "90.0% (900 of 1,000 tokens)"
    titles = [line.rstrip() for line in lines if line[:1].isalpha()]
    assert titles.index("KV sequences (the longest, longest first)") < titles.index(
        "KV namespaces (share: blocks their tables hold, of all blocks)")
    assert "live 9  pins 4  longest 14,397 tok, 900 blocks 0x500000001" in text
    sequence = next(line for line in lines if "0x2b" in line and "│" in line)
    assert [cell.strip() for cell in sequence.split("│")[1:-1]] == [
        "0x2b", "64", "4", "0", "7", "pin"]
    assert "blocks of 0x2a: 17-40 3 99-101" in text
    longest = text[text.index("blocks of 0x500000001: "):text.index("blocks of 0x2a")]
    assert "(first 128 of 900)" in longest
    start = next(i for i, line in enumerate(lines) if line.startswith("KV namespaces"))
    namespaces = [[cell.strip() for cell in line.split("│")[1:-1]]
                  for line in lines[start:start + 9] if line.count("│") == 7]
    assert namespaces == [["7", "1", "1", "904", "45.2%", "300"],
                               ["0", "1", "0", "28", "1.4%", "20"],
                               ["other", "5", "2", "40", "2.0%", "100"]]

    dumped_json = json.loads(as_json.stdout)
    sequences = dumped_json["kv_sequences"]
    assert (sequences["live"], sequences["pins"], sequences["longest_tokens"]) == (9, 4, 14_397)
    first = sequences["entries"][0]
    assert first["blocks"] == 900 and len(first["table"]) == 128 and not first["table_complete"]
    assert sequences["entries"][2]["pin"] is True
    assert dumped_json["kv_namespaces"][-1]["namespace"] is None
    assert dumped_json["kv"]["pinned_blocks"] == 40
    assert dumped_json["kv"]["readmit_query_tokens"] == 1000


def test_a_1_4_writer_says_what_it_does_not_publish():
    from test_stats_kv_sections import as_1_4
    from test_tui_kv import kv_segment

    with crafted_segment(as_1_4(kv_segment(kv_segment_bytes()))) as path:
        dumped = run_kvalloc("dump", str(path))
    assert dumped.returncode == 0, dumped.stderr
    assert "This writer publishes no KV sequences (layout 1.5 on)." in dumped.stdout
    assert "This writer publishes no KV namespaces (layout 1.5 on)." in dumped.stdout
    assert "pinned" not in dumped.stdout and "re-admissions" not in dumped.stdout


def test_a_real_kv_caches_sequences_and_namespaces_as_text_and_json():
    from test_tui_kv import serving

    name = unique_name("dumpseq")
    with serving(name) as (_, truth):
        dumped = run_kvalloc("dump", name)  # piped: 80 columns
        as_json = run_kvalloc("dump", name, "--json")
        check_sequences_dumped(truth, dumped, as_json)


def check_sequences_dumped(truth: dict, dumped, as_json) -> None:
    from test_tui_kv import runs_text

    assert dumped.returncode == 0 and as_json.returncode == 0, dumped.stderr + as_json.stderr
    kv, longest, again = truth["stats"], truth["longest"], truth["again"]
    lines = dumped.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in lines if line.count("│") == 3}
    assert rows["of them pinned"] == f"{kv.pinned_blocks:,}"
    assert rows["re-admissions"].startswith(
        f"{kv.readmit_hit_tokens / kv.readmit_query_tokens:.1%} ({kv.readmit_hit_tokens:,} of "
        f"{kv.readmit_query_tokens:,} tokens)")
    text = dumped.stdout
    for sequence in (longest, again):
        assert f"blocks of {sequence.handle:#x}: {runs_text(sequence.block_table)}" in text

    dumped_json = json.loads(as_json.stdout)
    entries = {e["handle"]: e for e in dumped_json["kv_sequences"]["entries"]}
    for sequence in (longest, again):
        entry = entries[sequence.handle]
        assert entry["table"] == sequence.block_table.tolist() and entry["table_complete"]
        assert (entry["num_tokens"], entry["blocks"], entry["namespace"]) == (
            sequence.num_tokens, sequence.num_blocks, sequence.namespace)
    assert entries[truth["pin"].handle]["pin"] is True
    assert dumped_json["kv_sequences"]["longest_handle"] == longest.handle
    assert [(row["namespace"], row["sequences"], row["pins"], row["blocks"],
             row["registered_blocks"]) for row in dumped_json["kv_namespaces"]] == [
        (row.namespace, row.sequences, row.pins, row.blocks, row.registered_blocks)
        for row in truth["namespaces"]]
