"""The KV cache's page of ``kvalloc top`` (pilot, 80 x 24 and taller) and the drawing of its
figures: pinned blocks in the bar and its legend, the hit rates of first admissions and
re-admissions apart, the sequences with a selected one's block table, the namespaces' shares.
The segments are real KV caches' with the sections written as the library's writer writes them
(stats_writer.write_kv_sections), so every case, a cut block table included, is exact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from stats_writer import crafted_segment, kv_segment_bytes, unique_name, write_kv_sections
from test_stats_kv_sections import as_1_4
from test_tui import screen_text, shown, until

import pykvalloc
from pykvalloc import stats
from kvalloc_tui import render
from kvalloc_tui.app import KvallocTop

LONGEST = (5 << 32) | 1
RUNS = list(range(17, 41)) + [3] + list(range(99, 102))  # 17-40 3 99-101
SCATTERED = [(i * 37) % 900 for i in range(128)]          # the first 128 ids of 900
ENTRIES = [
    {"handle": LONGEST, "num_tokens": 14_397, "blocks": 900, "cached_tokens": 512,
     "namespace_id": 7, "table": SCATTERED},
    {"handle": 0x2A, "num_tokens": 448, "blocks": len(RUNS), "cached_tokens": 64,
     "namespace_id": 0, "table": RUNS},
    {"handle": 0x2B, "num_tokens": 64, "blocks": 4, "namespace_id": 7, "flags": stats.KV_SEQ_PIN,
     "table": [5, 6, 7, 8]},
    {"handle": 0x2C, "num_tokens": 16, "blocks": 1, "namespace_id": (1 << 63) + 9,
     "table": [900]},
]
NAMESPACES = [
    {"namespace_id": 0, "sequences": 1, "blocks": 28, "registered_blocks": 20},
    {"namespace_id": 7, "sequences": 1, "pins": 1, "blocks": 904, "registered_blocks": 300},
    {"flags": stats.KV_NS_OTHER, "sequences": 5, "pins": 2, "blocks": 40,
     "registered_blocks": 100},
]


@pytest.fixture(scope="module")
def original() -> bytes:
    return kv_segment_bytes()


def kv_segment(original: bytes, readmitted: bool = True) -> bytes:
    """A KV cache of 2,000 blocks, 40 of its 1,200 used ones pinned; 3,000 of 12,000 tokens
    hit, of them 900 of the 1,000 re-admitted ones (none when not ``readmitted``)."""
    data = bytearray(write_kv_sections(original, live=9, pins=4, longest=(14_397, LONGEST),
                                       entries=ENTRIES, namespaces=NAMESPACES))
    snap = stats.Snapshot(bytes(data))
    kv = np.frombuffer(data, stats.KV_DTYPE, count=1, offset=snap._sections[stats.SECTION_KV][0])
    kv["total_blocks"], kv["used_blocks"], kv["cached_blocks"] = 2000, 1200, 300
    kv["free_blocks"], kv["pinned_blocks"], kv["live_sequences"] = 500, 40, 9
    kv["hit_tokens"], kv["query_tokens"] = 3000, 12000
    kv["readmit_hit_tokens"], kv["readmit_query_tokens"] = (900, 1000) if readmitted else (0, 0)
    return bytes(data)


def watch(data: bytes, size: tuple[int, int], check) -> None:
    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            await pilot.pause(0.1)
            await check(app, pilot)

    with crafted_segment(data) as path:
        asyncio.run(scenario(path))


def test_the_kv_page_at_80x24_shows_pins_hit_rates_sequences_and_namespaces(original):
    async def check(app, pilot) -> None:
        lines = screen_text(app).splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)

        kv = shown(app, "#kv")
        width = app.screen.query_one("#kv").content_size.width
        pinned = kv.spans[0]
        assert pinned.style == render.PINNED_STYLE
        assert pinned.end - pinned.start == round(width * 40 / 2000)
        assert kv.plain.splitlines()[0] == "█" * round(width * 0.75) + "·" * (width - round(width * 0.75))
        legend, hits = kv.plain.splitlines()[1:3]
        assert legend.startswith("used 1,200 60.0%  pinned 40  cached 300 15.0%  free 500")
        # 3,000 of 12,000 overall; first admissions 2,100 of 11,000; re-admissions 900 of 1,000.
        assert hits.startswith("hit  25.0% of 12000 tok first  19.1% ")
        assert "readmit  90.0% " in hits

        sequences = shown(app, "#sequences").plain.splitlines()
        assert sequences[0].startswith("live 9  pins 4  longest 14,397 tok, 900 blocks 0x500000001")
        assert sequences[1].split() == ["handle", "tokens", "blocks", "cached", "namespace"]
        assert sequences[2].split() == ["▸0x500000001", "14,397", "900", "512", "7"]
        assert sequences[4].split() == ["0x2b", "64", "4", "0", "7", "pin"]
        table = next(line for line in sequences if line.startswith("blocks of 0x500000001: "))
        cut = " ".join(sequences[sequences.index(table):])
        assert table.startswith("blocks of 0x500000001: 0 37 74 ")
        assert cut.rstrip().endswith("(first 128 of 900)") and " … +" in cut

        await pilot.press("down")  # the next one's block table
        await until(pilot, lambda: "blocks of 0x2a: " in shown(app, "#sequences").plain)
        sequences = shown(app, "#sequences").plain.splitlines()
        assert sequences[3].startswith("▸0x2a")
        assert sequences[-1].rstrip() == "blocks of 0x2a: 17-40 3 99-101" or any(
            line.rstrip() == "blocks of 0x2a: 17-40 3 99-101" for line in sequences)
        await pilot.press("up", "up")  # stops at the first
        await until(pilot, lambda: "blocks of 0x500000001: " in shown(app, "#sequences").plain)

        namespaces = shown(app, "#namespaces").plain.splitlines()
        assert namespaces[0].split() == ["namespace", "seqs", "pins", "blocks", "share", "reg"]
        assert namespaces[1].split() == ["7", "1", "1", "904", "45.2%", "300"]
        assert namespaces[2].split() == ["0", "1", "0", "28", "1.4%", "20"]
        assert namespaces[3].split() == ["other", "5", "2", "40", "2.0%", "100"]  # last

    watch(kv_segment(original), (80, 24), check)


def test_a_tall_terminal_shows_every_panel_at_once(original):
    async def check(app, pilot) -> None:
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == 50 and all(len(line) <= 160 for line in lines)
        for title in ("KV cache", "sequences", "namespaces", "heap map", "free blocks per order",
                      "slab classes", "use · fragmentation · latency", "recent operations"):
            assert title in text, title
        assert not app.screen.query_one("#kv-latency").display  # the latencies show once
        footer = await until(pilot, lambda: screen_text(app).splitlines()[-1].strip())
        assert "v " not in footer  # nothing to turn to
        # The wide namespaces panel draws each share as a bar too.
        namespaces = shown(app, "#namespaces").plain.splitlines()
        assert "█" in namespaces[1]
        # The block table takes the lines the rows leave: all 128 ids, with the note.
        sequences = shown(app, "#sequences").plain
        assert "(first 128 of 900)" in sequences and " … +" not in sequences

    watch(kv_segment(original), (160, 50), check)


def test_no_readmission_is_a_dash_that_says_why(original):
    async def check(app, pilot) -> None:
        hits = shown(app, "#kv").plain.splitlines()[2]
        assert "first  25.0% " in hits
        assert f"readmit      - {render.READMIT_NONE}" in hits

    watch(kv_segment(original, readmitted=False), (80, 24), check)


def test_a_1_4_writer_shows_what_it_publishes_and_says_what_it_does_not(original):
    async def check(app, pilot) -> None:
        kv = shown(app, "#kv").plain.splitlines()
        assert "pinned" not in kv[1] and "readmit" not in kv[2] and kv[2].startswith("hit ")
        assert "publishes no sequences" in shown(app, "#sequences").plain
        assert "publishes no namespaces" in shown(app, "#namespaces").plain

    watch(as_1_4(kv_segment(original)), (80, 24), check)


def entry(ids: list[int], blocks: int | None = None) -> stats.KvSequenceEntry:
    table = np.array(ids, np.uint32)
    blocks = len(ids) if blocks is None else blocks
    return stats.KvSequenceEntry(handle=1, num_tokens=blocks * 16, blocks=blocks,
                                 cached_tokens=0, namespace=0, priority=0, pin=False,
                                 table=table, table_complete=len(ids) == blocks)


def test_a_block_table_is_drawn_as_runs_cut_to_fit():
    assert render.block_table_lines(entry(RUNS), 40) == ["17-40 3 99-101"]
    # Cut: "…" and the count of ids left out, never a run cut in half.
    assert render.block_table_lines(entry(RUNS), 12) == ["17-40 3 … +3"]
    assert render.block_table_lines(entry(list(range(100)) + [7]), 8) == ["0-99 7"]
    lines = render.block_table_lines(entry(SCATTERED, 900), 40, 3)
    assert len(lines) == 3 and all(len(line) <= 40 for line in lines)
    assert lines[-1].endswith("(first 128 of 900)") and " … +" in lines[-1]
    shown_ids = [int(token) for line in lines for token in line.split("…")[0].split()]
    assert shown_ids == SCATTERED[:len(shown_ids)]
    left = int(lines[-1].split("… +")[1].split()[0])
    assert len(shown_ids) + left == 128
    assert render.block_table_lines(entry(list(range(128)), 900), 78) == [
        "0-127 (first 128 of 900)"]
    assert render.block_table_lines(entry([], 900), 78) == ["table not published (900 blocks)"]
    assert render.block_table_lines(entry([]), 78) == ["no blocks"]


MiB = 1 << 20


@contextmanager
def serving(name: str) -> Iterator[tuple[pykvalloc.KVCache, dict[str, Any]]]:
    """A real KV cache in a named pool, as an engine holds one: a request admitted, freed and
    admitted again (a re-admission that finds its blocks), a longer one in namespace 7, a pin
    of the first prefix; and what the cache says of itself (its stats, namespaces, sequences)."""
    with pykvalloc.Pool(64 * MiB, name=name, trace=True, pages="small") as pool, \
            pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                              pool=pool, trace=True) as cache:
        cache.allocate(4 * 16, block_keys=[1, 2, 3, 4]).free()
        again = cache.allocate(4 * 16 + 3, block_keys=[1, 2, 3, 4], again=True)
        longest = cache.allocate(6 * 16 + 5, namespace=7)
        pin = cache.pin(block_keys=[1, 2])
        cache.publish()
        truth = {"stats": cache.stats(), "namespaces": cache.namespaces(), "again": again,
                 "longest": longest, "pin": pin}
        yield cache, truth
        pin.unpin()
        again.free()
        longest.free()


def runs_text(table: np.ndarray) -> str:
    return " ".join(str(a) if a == b else f"{a}-{b}" for a, b in render.block_runs(table))


def test_a_real_kv_cache_lights_the_kv_page_at_80x24_and_every_panel_when_tall():
    name = unique_name("kvpage")

    async def scenario(truth: dict[str, Any], size: tuple[int, int]) -> None:
        app = KvallocTop(stats.find_segment(name), interval=0.1)
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.current and app.current.last
                        and app.current.last.kv_sequences
                        and app.current.last.kv_sequences.entries)
            await pilot.pause(0.1)
            kv, again, longest = truth["stats"], truth["again"], truth["longest"]
            lines = screen_text(app).splitlines()
            assert len(lines) == size[1] and all(len(line) <= size[0] for line in lines)
            assert kv.pinned_blocks == 2 and kv.readmit_query_tokens > 0
            panel = shown(app, "#kv").plain.splitlines()
            assert f"  pinned {kv.pinned_blocks}  " in panel[1]
            assert f"readmit {kv.readmit_hit_tokens / kv.readmit_query_tokens:>6.1%}" in panel[2]
            first = (kv.hit_tokens - kv.readmit_hit_tokens) / (kv.query_tokens
                                                               - kv.readmit_query_tokens)
            assert f"first {first:>6.1%}" in panel[2]

            sequences = shown(app, "#sequences").plain.splitlines()
            assert sequences[0].startswith(
                f"live 2  pins 1  longest {longest.num_tokens:,} tok, {longest.num_blocks} "
                f"blocks {longest.handle:#x}")
            rows = {line.split()[0].lstrip("▸"): line.split() for line in sequences[2:]
                    if line.strip().startswith(("▸0x", "0x"))}
            assert rows[f"{longest.handle:#x}"][1:5] == [
                f"{longest.num_tokens:,}", str(longest.num_blocks), "0", "7"]
            assert rows[f"{again.handle:#x}"][1:4] == [
                f"{again.num_tokens:,}", str(again.num_blocks), f"{again.num_cached_tokens:,}"]
            assert rows[f"{truth['pin'].handle:#x}"][-1] == "pin"
            assert f"blocks of {longest.handle:#x}: {runs_text(longest.block_table)}" in \
                shown(app, "#sequences").plain
            order = list(rows)
            await pilot.press("down")  # the second longest's table
            await until(pilot, lambda: f"blocks of {order[1]}: " in shown(app, "#sequences").plain)
            if order[1] == f"{again.handle:#x}":
                assert f"blocks of {order[1]}: {runs_text(again.block_table)}" in \
                    shown(app, "#sequences").plain

            namespaces = shown(app, "#namespaces").plain.splitlines()
            for row in truth["namespaces"]:
                line = next(line for line in namespaces[1:]
                            if line.split()[0] == render.format_namespace(row.namespace))
                assert line.split()[1:4] == [str(row.sequences), str(row.pins), str(row.blocks)]
                assert line.split()[5] == str(row.registered_blocks)
            if size[1] >= 46:
                text = "\n".join(lines)
                for title in ("heap map", "free blocks per order", "slab classes",
                              "recent operations"):
                    assert title in text, title
            else:
                assert "heap map" not in "\n".join(lines)

    with serving(name) as (_, truth):
        asyncio.run(scenario(truth, (80, 24)))
        asyncio.run(scenario(truth, (160, 50)))


@pytest.mark.parametrize("width", [60, 78, 120])
def test_a_cache_that_looked_nothing_up_keeps_its_two_hit_rates_apart(width):
    # A fresh cache: neither kind of admission has looked anything up, and each says why in
    # the room of its half; the first half's words end before the second half starts.
    name = unique_name("kvfresh")
    with pykvalloc.KVCache(64, block_tokens=16, layers=1, kv_heads=1, head_dim=1, dtype="uint8",
                           pages="small", name=name) as cache:
        cache.publish()
        with stats.open_segment(name) as segment:
            snap = segment.snapshot()
    lines = [line.plain for line in render.hit_lines(snap, width)]
    assert all(len(line) <= width for line in lines)
    text = " ".join(lines)
    assert " readmit " in f" {text}" and "first " in text
    before_readmit = text.split("readmit")[0]
    assert before_readmit.endswith(" "), text
    assert "nothing looked" in before_readmit, text


def test_very_long_sequences_and_wide_handles_keep_the_sequence_columns(original):
    # The largest figures a writer can publish (u32 tokens and blocks) and a handle of a slot
    # reused 2^32-1 times: every row's figures end where their heading does, and the columns
    # fit the 80-column page.
    import re

    huge = [{"handle": 0xFFFFFFFF0000FFFF, "num_tokens": (1 << 32) - 1, "blocks": (1 << 28),
             "cached_tokens": (1 << 32) - 16, "namespace_id": 7, "table": [1, 2, 3]},
            {"handle": 0x2A, "num_tokens": 14_400_003, "blocks": 900_001,
             "cached_tokens": 512, "namespace_id": 0, "table": [4]},
            {"handle": 0x2B, "num_tokens": 64, "blocks": 4, "namespace_id": 0, "table": [5]}]
    data = write_kv_sections(original, live=3, longest=((1 << 32) - 1, 0xFFFFFFFF0000FFFF),
                             entries=huge, namespaces=[])
    lines = [line.plain for line in render.sequence_lines(stats.Snapshot(data), 78, 12, None)]
    heading = lines[1]
    ends = {m.group(): m.end() for m in re.finditer(r"\S+", heading)}
    rows = [line for line in lines[2:] if line.lstrip(" ▸").startswith("0x")]
    assert len(rows) == 3
    for row in rows:
        fields = [(m.group(), m.end()) for m in re.finditer(r"\S+", row.lstrip("▸").rjust(len(row)))]
        assert [end for _, end in fields[1:4]] == [ends["tokens"], ends["blocks"], ends["cached"]], \
            (heading, row)
        assert fields[4][0] in ("7", "0") and len(row) <= 78
    assert "4,294,967,295" in lines[0]  # the summary has room for the figure whole


def test_a_namespace_share_past_the_whole_cache_keeps_its_column(original):
    # Blocks are counted per table (a fork's shared blocks count again), so a namespace's share
    # may pass 100%, even 100x: the share still ends under its heading, apart from the blocks.
    import re

    data = bytearray(kv_segment(original))  # 2,000 blocks in all
    rows = [{"namespace_id": 5, "sequences": 31, "blocks": 454_200, "registered_blocks": 2},
            {"namespace_id": 6, "sequences": 2, "blocks": 45_420, "registered_blocks": 2},
            {"namespace_id": 7, "sequences": 2, "blocks": 2_000},
            {"namespace_id": 8, "sequences": 1, "blocks": 20}]
    data = write_kv_sections(bytes(data), namespaces=rows)
    lines = [line.plain for line in render.namespace_lines(stats.Snapshot(data), 40, 8)]
    ends = {m.group(): m.end() for m in re.finditer(r"\S+", lines[0])}
    for line in lines[1:5]:
        fields = [(m.group(), m.end()) for m in re.finditer(r"\S+", line)]
        assert len(fields) == 6, line
        assert [end for _, end in fields[3:5]] == [ends["blocks"], ends["share"]], (lines[0], line)
        assert fields[4][0].endswith("%")
    assert [line.split()[4] for line in lines[1:5]] == ["23k%", "2271%", "100%", "1.0%"]


@pytest.mark.parametrize("room", [9, 12, 20])
def test_long_namespace_ids_cut_to_their_room_stay_apart(room):
    # Ids that differ only in their last digits (a tenant in the high bits, an adapter in the
    # low ones) keep distinct labels in the panels' columns; short ids are shown whole.
    ids = [(1 << 64) - 2, (1 << 64) - 4, (7 << 48) | 1, (7 << 48) | 2, (1 << 63) + 9]
    labels = [render.format_namespace(ns, room) for ns in ids]
    assert len(set(labels)) == len(ids), labels
    assert all(len(label) <= room for label in labels)
    assert render.format_namespace(42, room) == "42" and render.format_namespace(None, room) == "other"
    assert render.format_namespace((1 << 64) - 2, 20) == "0xfffffffffffffffe"


def test_the_other_row_stays_in_view_when_the_namespaces_are_cut(original):
    # Past the 32 tracked namespaces the other row pools the rest, often the most blocks of
    # all: a short panel keeps it (last) and counts the tracked rows it leaves out.
    rows = [{"namespace_id": 100 + i, "sequences": 1, "blocks": 40 - i} for i in range(32)]
    rows.append({"flags": stats.KV_NS_OTHER, "sequences": 30, "blocks": 5000})
    data = write_kv_sections(kv_segment(original), namespaces=rows)
    for height in (3, 6, 10):
        lines = [line.plain for line in render.namespace_lines(stats.Snapshot(data), 40, height)]
        assert len(lines) == height, lines
        assert lines[-2].split()[:4] == ["other", "30", "0", "5000"], lines
        shown = len(lines) - 3
        assert [line.split()[0] for line in lines[1:1 + shown]] == [str(100 + i) for i in range(shown)]
        left = 32 - shown
        assert lines[-1] == f"… {left} more, {sum(40 - i for i in range(shown, 32)):,} blocks"


def test_the_longest_sequence_has_its_blocks_when_pins_fill_the_list(original):
    # The writer lists the 16 longest sequences and pins; 16 pins of a long system prompt can
    # leave the longest sequence out. Its block count follows from its tokens all the same.
    block_tokens = int(stats.Snapshot(original).kv["block_tokens"])
    pins = [{"handle": 0x100 + i, "num_tokens": 64 * block_tokens, "blocks": 64,
             "flags": stats.KV_SEQ_PIN, "table": list(range(64))} for i in range(16)]
    longest = (5 * block_tokens + 3, 0x2A)
    data = write_kv_sections(original, live=3, pins=16, longest=longest, entries=pins)
    summary = render.sequences_summary(stats.Snapshot(data)).plain
    assert f"longest {longest[0]:,} tok, 6 blocks 0x2a" in summary, summary
