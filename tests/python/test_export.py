"""``kvalloc export``: the exposition text parsed back (names, types, labels, histograms), its
figures against the objects that published them, the segments a scrape skips (vanished,
corrupt, truncated, dead, over the limit) without failing, and the HTTP server and the command.

Counting tests scrape a private directory of planted segments (copies of a real one, holding
the writer's liveness lock as a live writer does), so that other tests' pools in /dev/shm do not
change the counts; the figure tests scrape /dev/shm itself and look at their own pool's series."""

from __future__ import annotations

import fcntl
import math
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from stats_writer import Writer, unique_name
from support import clean_env

import pykvalloc
from kvalloc_cli import exposition
from kvalloc_cli.export import serve
from kvalloc_cli.exposition import CONTENT_TYPE, ExporterState, Family, scrape
from pykvalloc import stats
from pykvalloc.stats import KV_CALL_KINDS, process_name

# Scrapes of /dev/shm read every segment there, so that other tests' pools cannot push ours past
# the limit.
EVERY = 1 << 20

SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)\Z')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|\Z)')


def parse(text: str) -> dict[str, dict]:
    """The exposition text as {family: {"type", "help", "samples": [(name, labels, value)]}},
    checked as Prometheus' parser would: every sample after its family's TYPE, names that belong
    to it, well-formed labels, each series once."""
    families: dict[str, dict] = {}
    current: str | None = None
    seen: set[tuple[str, tuple]] = set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            assert name not in families, f"{name} twice"
            families[name] = {"help": help_text, "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name == current and kind in ("gauge", "counter", "histogram")
            families[name]["type"] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, _, label_text, value = match.groups()
            assert current is not None and families[current]["type"] is not None
            suffixes = ("_bucket", "_sum", "_count") if families[current]["type"] == "histogram" \
                else ("",)
            assert name in {current + s for s in suffixes}, f"{name} outside {current}"
            labels = {}
            rest = label_text or ""
            while rest:
                pair = LABEL.match(rest)
                assert pair, f"bad labels in {line!r}"
                labels[pair.group(1)] = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(
                    m.group(1), m.group(1)), pair.group(2))
                rest = rest[pair.end():]
            key = (name, tuple(sorted(labels.items())))
            assert key not in seen, f"series twice: {key}"
            seen.add(key)
            families[current]["samples"].append((name, labels, float(value)))
    for name, family in families.items():
        if family["type"] == "counter":
            assert name.endswith("_total"), name
        if family["type"] == "histogram":
            check_histograms(family["samples"])
    return families


def check_histograms(samples: list) -> None:
    """Each series' buckets ascend in le and count, end at +Inf, and +Inf equals _count."""
    series: dict[tuple, dict] = {}
    for name, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": []})
        if name.endswith("_bucket"):
            entry["buckets"].append((float(labels["le"]), value))
        else:
            entry[name.rsplit("_", 1)[1]] = value
    for entry in series.values():
        bounds = [le for le, _ in entry["buckets"]]
        counts = [n for _, n in entry["buckets"]]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf
        assert counts == sorted(counts) and counts[-1] == entry["count"]
        assert entry["sum"] >= 0


def series(families: dict, name: str, **labels: str) -> list[tuple[str, dict, float]]:
    return [s for s in families[name]["samples"]
            if all(s[1].get(k) == v for k, v in labels.items())]


def value(families: dict, name: str, **labels: str) -> float:
    found = series(families, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0][2]


def test_a_live_kv_pool_exports_what_its_objects_say() -> None:
    name = unique_name("export")
    with pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                           name=name, trace=True) as cache:
        first = cache.allocate(64, block_keys=[1, 2, 3, 4])
        for _ in range(3):
            first.append(1)
        first.free()
        held = cache.allocate(48, block_keys=[1, 2, 9])
        cache.evict(1)
        cache.publish()
        kv = cache.stats()
        families = parse(scrape(ExporterState(max_segments=EVERY)))
        mine = {"pool": name, "pid": str(os.getpid())}
        assert series(families, "kvalloc_pool_capacity_bytes", **mine)[0][1]["process"] == \
            process_name(os.getpid())
        assert value(families, "kvalloc_kv_prefix_cache_query_tokens_total", **mine) == \
            kv.query_tokens
        assert value(families, "kvalloc_kv_prefix_cache_hit_tokens_total", **mine) == kv.hit_tokens
        assert value(families, "kvalloc_kv_evictions_total", **mine) == kv.evictions
        for state in ("used", "cached", "free"):
            assert value(families, "kvalloc_kv_blocks", state=state, **mine) == \
                getattr(kv, f"{state}_blocks")
        assert value(families, "kvalloc_kv_capacity_blocks", **mine) == kv.num_blocks
        assert value(families, "kvalloc_kv_usage_ratio", **mine) == kv.used_blocks / kv.num_blocks
        assert value(families, "kvalloc_kv_peak_used_blocks", **mine) == kv.peak_used_blocks
        assert value(families, "kvalloc_kv_peak_in_use_bytes", **mine) == kv.peak_bytes_in_use
        assert value(families, "kvalloc_kv_call_sample_period", **mine) == 1
        for kind in KV_CALL_KINDS:
            calls = kv.call_latency[kind]
            assert families["kvalloc_kv_call_duration_seconds"]["type"] == "histogram"
            for sample_name, labels, number in series(
                    families, "kvalloc_kv_call_duration_seconds", call=kind, **mine):
                if sample_name.endswith("_count"):
                    assert number == calls.timed_calls
                elif sample_name.endswith("_sum"):
                    assert number == pytest.approx(calls.timed_ns / 1e9)
                elif labels["le"] != "+Inf":
                    # 2^e ns holds the log2 buckets below e exactly
                    exponent = round(math.log2(float(labels["le"]) * 1e9))
                    assert number == sum(calls.ns_log2[:exponent])
        assert kv.call_latency["append"].timed_calls == 3 and kv.call_latency["evict"].timed_calls == 1
        del held


def test_pool_figures_and_peaks_match_the_pool() -> None:
    name = unique_name("export-pool")
    with pykvalloc.Pool(16 << 20, name=name, pages="small") as pool:
        blocks = [pool.alloc(1 << 20), pool.alloc(64), pool.alloc(300_000)]
        pool.free(blocks.pop(0))
        pool.publish()
        figures = pool.stats()
        families = parse(scrape(ExporterState(max_segments=EVERY)))
        mine = {"pool": name}
        assert value(families, "kvalloc_pool_allocations_total", **mine) == figures.alloc_count
        assert value(families, "kvalloc_pool_frees_total", **mine) == figures.free_count
        assert value(families, "kvalloc_pool_in_use_bytes", **mine) == figures.bytes_in_use
        assert value(families, "kvalloc_pool_peak_block_bytes", **mine) == figures.peak_block_bytes
        assert value(families, "kvalloc_pool_capacity_bytes", **mine) == figures.capacity
        orders = series(families, "kvalloc_pool_free_blocks", **mine)
        assert [int(s[2]) for s in orders] == list(figures.free_blocks)
        assert all(int(s[1]["block_bytes"]) == figures.block_size(int(s[1]["order"]))
                   for s in orders)
        # A pool without a KV cache has no KV series.
        assert not series(families, "kvalloc_kv_blocks", **mine) if "kvalloc_kv_blocks" in \
            families else True
        for block in blocks:
            pool.free(block)


def test_label_values_are_escaped() -> None:
    family = Family("kvalloc_test", "gauge", "A test.")
    odd = 'a"b\\c\nd'
    family.add((("pool", "p"), ("process", odd)), 3)
    parsed = parse(family.text())
    assert parsed["kvalloc_test"]["samples"] == [("kvalloc_test", {"pool": "p", "process": odd},
                                                   3.0)]


# -- a private directory of planted segments ---------------------------------------------------


@pytest.fixture(scope="module")
def segment_copy() -> bytes:
    """A consistent copy of a real KV pool's segment."""
    name = unique_name("export-copy")
    with pykvalloc.KVCache(num_blocks=32, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                           name=name) as cache:
        cache.allocate(40).free()
        cache.publish()
        with stats.open_segment(name) as segment:
            return segment.snapshot().data


@contextmanager
def planted(directory: Path, data: bytes, *, live: bool = True) -> Iterator[Path]:
    """``data`` as a segment file of this process in ``directory``; while ``live`` it holds the
    writer's liveness lock, as a live writer does."""
    path = directory / f"kvalloc.{os.getpid()}.{unique_name('planted')}"
    path.write_bytes(data)
    with open(path, "rb") as held:
        if live:
            fcntl.flock(held, fcntl.LOCK_SH)
        yield path
    path.unlink(missing_ok=True)


def damaged(data: bytes, at: int, replacement: bytes) -> bytes:
    out = bytearray(data)
    out[at:at + len(replacement)] = replacement
    return bytes(out)


def own(families: dict, name: str, **labels: str) -> float:
    return value(families, f"kvalloc_exporter_{name}", **labels)


def test_vanished_corrupt_truncated_and_dead_segments_are_skipped_and_counted(
        tmp_path: Path, segment_copy: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    header = stats.HEADER_DTYPE
    bad_sections = damaged(segment_copy, header.fields["section_count"][1],
                           (99).to_bytes(4, "little"))
    truncated = segment_copy[:len(segment_copy) // 2]
    state = ExporterState(directory=tmp_path)
    with planted(tmp_path, segment_copy) as good, planted(tmp_path, segment_copy) as vanishing, \
            planted(tmp_path, bad_sections), planted(tmp_path, truncated), \
            planted(tmp_path, segment_copy, live=False):
        read = exposition.read_segment

        def vanish_first(found: stats.SegmentFile) -> stats.Snapshot:
            if found.path == vanishing:
                vanishing.unlink()  # gone between the listing and the read, as a pool closing
            return read(found)

        monkeypatch.setattr(exposition, "read_segment", vanish_first)
        families = parse(scrape(state))
    assert own(families, "segments_seen") == 5
    assert own(families, "segments_exported") == 1
    assert own(families, "segments_skipped_total", reason="vanished") == 1
    assert own(families, "segments_skipped_total", reason="dead") == 1
    assert own(families, "segments_skipped_total", reason="error") == 2
    assert own(families, "segment_errors_total", kind="corrupt") == 1
    assert own(families, "segment_errors_total", kind="truncated") == 1
    assert own(families, "scrapes_total") == 1
    # The exported one is whole: all of its series, one pool.
    assert {s[1]["pool"] for s in families["kvalloc_kv_blocks"]["samples"]} == {
        good.name.split(".", 2)[2]}


def test_a_scrape_reads_at_most_max_segments(tmp_path: Path, segment_copy: bytes,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Path] = []
    read = exposition.read_segment

    def counted(found: stats.SegmentFile) -> stats.Snapshot:
        reads.append(found.path)
        return read(found)

    monkeypatch.setattr(exposition, "read_segment", counted)
    state = ExporterState(directory=tmp_path, max_segments=2)
    with planted(tmp_path, segment_copy), planted(tmp_path, segment_copy), \
            planted(tmp_path, segment_copy), planted(tmp_path, segment_copy):
        first = parse(scrape(state))
        second = parse(scrape(state))
    assert len(reads) == 4 and reads[:2] == reads[2:]  # the same two, scrape after scrape
    assert own(first, "segments_seen") == 4 and own(first, "segments_exported") == 2
    assert own(second, "segments_skipped_total", reason="limit") == 4  # a counter: 2 a scrape
    assert own(second, "max_segments") == 2


def test_an_unexpected_failure_in_one_segment_skips_it_only(
        tmp_path: Path, segment_copy: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    read = exposition.read_segment
    calls = []

    def first_fails(found: stats.SegmentFile) -> stats.Snapshot:
        calls.append(found)
        if len(calls) == 1:
            raise ValueError("a writer's bytes the parser did not foresee")
        return read(found)

    monkeypatch.setattr(exposition, "read_segment", first_fails)
    with planted(tmp_path, segment_copy), planted(tmp_path, segment_copy):
        families = parse(scrape(ExporterState(directory=tmp_path)))
    assert own(families, "segments_exported") == 1
    assert own(families, "segment_errors_total", kind="unexpected") == 1


def test_a_dead_writers_segment_left_by_sigkill_is_skipped(tmp_path: Path) -> None:
    writer = Writer(unique_name("export-dead"))
    try:
        writer.ask("publish")
        writer.kill()
        data = writer.path.read_bytes()
    finally:
        writer.path.unlink(missing_ok=True)
    with planted(tmp_path, data, live=False):
        families = parse(scrape(ExporterState(directory=tmp_path)))
    assert own(families, "segments_skipped_total", reason="dead") == 1
    assert own(families, "segments_exported") == 0
    assert "kvalloc_pool_capacity_bytes" not in families


# -- the server and the command -----------------------------------------------------------------


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def test_the_server_answers_200_with_corrupt_segments_and_404_elsewhere(
        tmp_path: Path, segment_copy: bytes) -> None:
    server = serve("127.0.0.1", 0, ExporterState(directory=tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        with planted(tmp_path, segment_copy), planted(tmp_path, b"\0" * 64):
            status, content_type, body = get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and content_type == CONTENT_TYPE
            families = parse(body)
            assert own(families, "segments_exported") == 1
            assert own(families, "segments_skipped_total", reason="error") == 1
        assert get(f"http://127.0.0.1:{port}/")[0] == 200
        assert get(f"http://127.0.0.1:{port}/nothing")[0] == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=60)
        assert not thread.is_alive(), "hung: the server did not stop"


def test_the_command_serves_on_a_free_port_and_says_where() -> None:
    name = unique_name("export-cmd")
    with pykvalloc.Pool(1 << 22, name=name) as pool, subprocess.Popen(
            [sys.executable, "-m", "kvalloc_cli", "export", "--port", "0", "--max-segments",
             str(EVERY)],
            stderr=subprocess.PIPE, text=True, env=clean_env()) as process:
        try:
            assert process.stderr is not None
            line = process.stderr.readline()
            match = re.match(r"kvalloc export: serving (http://127\.0\.0\.1:\d+/metrics)$",
                             line.strip())
            assert match, f"hung or failed: {line!r}"
            pool.alloc(4096)
            pool.publish()
            families = parse(get(match.group(1))[2])
            assert value(families, "kvalloc_pool_allocations_total", pool=name) == \
                pool.stats().alloc_count
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_once_prints_one_scrape_and_bad_ports_are_usage_errors(capsys) -> None:
    from kvalloc_cli import main

    assert main(["export", "--once"]) == 0
    families = parse(capsys.readouterr().out)
    assert own(families, "scrapes_total") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--port", "70000"])
    assert exit_info.value.code == 2
    assert "kvalloc export: argument --port: must lie between 0 and 65535" in \
        capsys.readouterr().err


def test_a_port_in_use_is_one_line_and_status_1(capsys) -> None:
    from kvalloc_cli import main

    server = serve("127.0.0.1", 0, ExporterState())
    try:
        port = server.server_address[1]
        assert main(["export", "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"kvalloc export: cannot listen on 127.0.0.1:{port}") and \
            err.count("\n") == 1
    finally:
        server.server_close()


def test_histogram_bounds_sum_the_log2_buckets_exactly() -> None:
    buckets = np.zeros(stats.LATENCY_BUCKETS, np.uint64)
    buckets[[3, 10, 10, 20, 39]] = [5, 2, 2, 7, 1]
    family = Family("kvalloc_h", "histogram", "h")
    exposition._histogram(family, (("call", "x"),), buckets, int(buckets.sum()), 1.0)
    parsed = parse(family.text())["kvalloc_h"]["samples"]
    by_le = {s[1]["le"]: s[2] for s in parsed if s[0].endswith("_bucket")}
    assert by_le[repr(64e-9)] == 5            # 2^6 ns: buckets 0..5
    assert by_le[repr(2 ** 11 / 1e9)] == 7    # 2^11 ns: also bucket 10
    assert by_le[repr(2 ** 30 / 1e9)] == 14   # up to 2^30 ns: not bucket 39
    assert by_le["+Inf"] == 15


def test_pins_readmissions_the_longest_sequence_and_namespaces(tmp_path: Path) -> None:
    from stats_writer import kv_segment_bytes
    from test_tui_kv import kv_segment

    with planted(tmp_path, kv_segment(kv_segment_bytes())) as path:
        families = parse(scrape(ExporterState(directory=tmp_path)))
    mine = {"pool": path.name.split(".", 2)[2]}
    assert value(families, "kvalloc_kv_pinned_blocks", **mine) == 40
    assert value(families, "kvalloc_kv_prefix_cache_readmission_query_tokens_total", **mine) == 1000
    assert value(families, "kvalloc_kv_prefix_cache_readmission_hit_tokens_total", **mine) == 900
    assert value(families, "kvalloc_kv_pins", **mine) == 4
    assert value(families, "kvalloc_kv_longest_sequence_tokens", **mine) == 14_397
    expected = {"7": (1, 1, 904, 300), "0": (1, 0, 28, 20), "other": (5, 2, 40, 100)}
    for name, column in (("sequences", 0), ("pins", 1), ("blocks", 2), ("registered_blocks", 3)):
        found = {s[1]["namespace"]: s[2] for s in series(
            families, f"kvalloc_kv_namespace_{name}", **mine)}
        assert found == {ns: figures[column] for ns, figures in expected.items()}, name
        assert families[f"kvalloc_kv_namespace_{name}"]["type"] == "gauge"


def test_namespace_series_are_bounded_and_never_written_twice() -> None:
    def row(namespace: int | None, blocks: int) -> stats.KvNamespaceShare:
        return stats.KvNamespaceShare(namespace=namespace, sequences=1, pins=0, blocks=blocks,
                                      registered_blocks=2)

    # A writer tracking more namespaces than 32 (a newer one), one of them listed twice.
    rows = [row(ns, 100 + ns) for ns in range(40)] + [row(39, 1), row(None, 5)]
    found = exposition._namespace_series(rows)
    assert len(found) == exposition.NAMESPACE_SERIES_MAX == 33
    assert found["39"] == (2, 0, 140, 4)  # the two rows of 39 added up; the most blocks
    kept = {str(ns) for ns in range(8, 40)}
    assert set(found) == kept | {"other"}
    # Namespaces 0..7 (the fewest blocks) and the writer's own "other" row go to "other".
    assert found["other"] == (9, 0, sum(100 + ns for ns in range(8)) + 5, 18)
    assert exposition._namespace_series([]) == {}


def test_a_real_kv_caches_pins_readmissions_and_namespaces() -> None:
    from test_tui_kv import serving

    name = unique_name("export-ns")
    with serving(name) as (_, truth):
        families = parse(scrape(ExporterState(max_segments=EVERY)))
        longest_tokens = truth["longest"].num_tokens
    kv, mine = truth["stats"], {"pool": name, "pid": str(os.getpid())}
    assert value(families, "kvalloc_kv_pinned_blocks", **mine) == kv.pinned_blocks == 2
    assert value(families, "kvalloc_kv_prefix_cache_readmission_hit_tokens_total", **mine) == \
        kv.readmit_hit_tokens > 0
    assert value(families, "kvalloc_kv_prefix_cache_readmission_query_tokens_total", **mine) == \
        kv.readmit_query_tokens
    assert value(families, "kvalloc_kv_longest_sequence_tokens", **mine) == longest_tokens
    assert value(families, "kvalloc_kv_pins", **mine) == 1
    for row in truth["namespaces"]:
        label = "other" if row.namespace is None else str(row.namespace)
        for metric in ("sequences", "pins", "blocks", "registered_blocks"):
            assert value(families, f"kvalloc_kv_namespace_{metric}", namespace=label, **mine) \
                == getattr(row, metric), (label, metric)
