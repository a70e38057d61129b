"""Pinned KV blocks in the heap map: the writer paints them as ``CELL_KV_PINNED`` (layout 1.5),
the reader merges cells with pinned before used before cached, a state the reader does not know
is drawn as mixed, and ``kvalloc top``'s pool page and ``kvalloc dump`` draw pinned cells in the
colour the KV bar gives pinned blocks, with a legend entry."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from stats_writer import crafted_segment, unique_name
from support import run_kvalloc
from test_tui import shown, until

import pykvalloc
from pykvalloc import stats
from kvalloc_tui import render
from kvalloc_tui.app import KvallocTop
from kvalloc_cli import main

MiB = 1 << 20
CACHED = 256  # blocks cached, the first PINNED of them then pinned
PINNED = 128
USED = 128    # blocks a sequence holds, none of them pinned


@dataclass
class Serving:
    pool: pykvalloc.Pool
    cache: pykvalloc.KVCache
    pin: pykvalloc.Pin
    unpinned: bool = False

    def unpin(self) -> None:
        self.pin.unpin()
        self.unpinned = True


@contextmanager
def pinned_cache(name: str) -> Iterator[Serving]:
    """A KV cache of 512 blocks of 16 KiB filling half a 16 MiB pool: 256 blocks cached, the
    first 128 of them then pinned (an engine's system prompt), 128 more held by a sequence;
    published."""
    with pykvalloc.Pool(16 * MiB, name=name, pages="small") as pool, \
            pykvalloc.KVCache(512, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                              pool=pool) as cache:
        keys = list(range(1, CACHED + 1))
        cache.allocate(CACHED * 16, block_keys=keys).free()
        pin = cache.pin(block_keys=keys[:PINNED])
        held = cache.allocate(USED * 16)
        cache.publish()
        serving = Serving(pool, cache, pin)
        yield serving
        held.free()
        if not serving.unpinned:
            serving.unpin()


def snapshot(pool: pykvalloc.Pool) -> stats.Snapshot:
    with stats.Segment.for_pool(pool) as segment:
        return segment.snapshot()


def state_counts(snap: stats.Snapshot) -> np.ndarray:
    assert snap.cell_state is not None
    return np.bincount(snap.cell_state, minlength=len(stats.CELL_NAMES))


def test_a_pinned_region_is_painted_pinned_and_unpinning_repaints_it():
    with pinned_cache(unique_name("kvmap")) as serving:
        snap = snapshot(serving.pool)
        assert snap.heapmap is not None
        cell_bytes = int(snap.heapmap["cell_bytes"])
        assert serving.cache.block_bytes % cell_bytes == 0  # a block covers whole cells
        per_block = serving.cache.block_bytes // cell_bytes
        kv = serving.cache.stats()
        assert (kv.pinned_blocks, kv.used_blocks, kv.cached_blocks) == (
            PINNED, PINNED + USED, CACHED - PINNED)
        counts = state_counts(snap)
        assert counts[stats.CELL_KV_PINNED] == PINNED * per_block
        assert counts[stats.CELL_KV_USED] == USED * per_block
        assert counts[stats.CELL_KV_CACHED] == (CACHED - PINNED) * per_block
        assert stats.CELL_NAMES[stats.CELL_KV_PINNED] == "kv pinned"
        state = snap.to_dict()["heapmap"]["state"]
        assert state.count(stats.CELL_KV_PINNED) == PINNED * per_block
        # The pinned blocks were allocated together: one run of cells in each layer's region.
        at = np.flatnonzero(snap.cell_state == stats.CELL_KV_PINNED)
        assert serving.cache.info.layout == pykvalloc.KVLayout.LAYERS
        assert 1 + int((np.diff(at) > 1).sum()) == serving.cache.info.layers

        serving.unpin()  # the blocks are cached again, and so are their cells
        serving.cache.publish()
        after = state_counts(snapshot(serving.pool))
        assert after[stats.CELL_KV_PINNED] == 0
        assert after[stats.CELL_KV_CACHED] == CACHED * per_block
        assert after[stats.CELL_KV_USED] == USED * per_block


def test_merged_cells_break_ties_pinned_then_used_then_cached():
    pinned, used, cached, free = (stats.CELL_KV_PINNED, stats.CELL_KV_USED,
                                  stats.CELL_KV_CACHED, stats.CELL_FREE)
    state = np.array([used, pinned, free, free,       # a tie: pinned
                      cached, used, free, free,       # a tie: used
                      cached, cached, pinned, used,   # most: cached
                      free, free, free, free,         # free
                      used, used, pinned, cached],    # most: used
                     np.uint8)
    fill = np.full(len(state), 200, np.uint8)
    merged, fills = stats.downsample_cells(state, fill, 5)
    assert merged.tolist() == [pinned, used, cached, free, used]
    assert fills.tolist() == [200] * 5


def test_a_state_the_reader_does_not_know_is_drawn_as_mixed():
    """A newer writer's state (as CELL_KV_PINNED is to a reader before 1.5, which takes this
    same path): counted and coloured as mixed, never a crash, and the legend names only the
    states it knows."""
    newer = len(stats.CELL_NAMES) + 3
    state = np.array([newer, newer, stats.CELL_KV_PINNED, stats.CELL_FREE], np.uint8)
    fill = np.array([255, 255, 255, 0], np.uint8)
    merged, _ = stats.downsample_cells(state, fill, 2)
    assert merged.tolist() == [stats.CELL_MIXED, stats.CELL_KV_PINNED]

    with pykvalloc.Pool(16 * MiB, name=unique_name("newer")) as pool:
        pool.publish()
        data = bytearray(snapshot(pool).data)
    snap = stats.Snapshot(bytes(data))
    assert snap.cell_state is not None
    map_at = snap._sections[stats.SECTION_HEAPMAP][0] + stats.HEAPMAP_DTYPE.itemsize
    cells = len(snap.cell_state)
    data[map_at:map_at + cells] = bytes([newer]) * cells
    data[map_at + cells:map_at + 2 * cells] = bytes([255]) * cells
    snap = stats.Snapshot(bytes(data))
    drawn = render.heap_map(snap, 40, 2)  # merged cells
    assert {span.style for span in drawn.spans} == {render.CELL_STYLES[stats.CELL_MIXED]}
    whole = render.heap_map(snap, cells, 1)  # one shown cell for each: the raw state
    assert {span.style for span in whole.spans} == {render.CELL_STYLES[stats.CELL_MIXED]}
    legend = render.heap_legend(snap, 80).plain
    assert "free" in legend and "kv pinned" not in legend

    async def scenario(path: str) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            heap = shown(app, "#heap")
            assert any(span.style == render.CELL_STYLES[stats.CELL_MIXED] for span in heap.spans)

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def test_top_draws_pinned_cells_in_the_kv_bars_pinned_colour_with_a_legend():
    name = unique_name("kvmaptop")

    async def scenario() -> None:
        app = KvallocTop(stats.find_segment(name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            assert shown(app, "#kv").spans[0].style == render.PINNED_STYLE  # the bar
            await pilot.press("v")  # the pool's page

            def pinned_cells() -> list:
                """The map's spans in the pinned style (the legend's line left out): none
                until the page shown has been drawn from the segment."""
                heap = shown(app, "#heap")
                legend = heap.plain.splitlines()[-1] if heap.plain else ""
                map_end = len(heap.plain) - len(legend)
                return [span for span in heap.spans
                        if span.style == render.PINNED_STYLE and span.end <= map_end]

            await until(pilot, lambda: app.screen.query_one("#heap").display and pinned_cells())
            heap = shown(app, "#heap")
            lines = heap.plain.splitlines()
            legend = lines[-1]
            pinned = pinned_cells()
            assert "kv pinned" in legend and "kv used" in legend and "kv cached" in legend
            assert legend.index("kv pinned") < legend.index("kv used") < legend.index("kv cached")
            # The map's pinned cells: an eighth of the pool, one run in address order.
            drawn = sum(span.end - span.start for span in pinned)
            shown_cells = sum(len(line) for line in lines[:-1])
            assert abs(drawn - shown_cells / 8) <= 2 + shown_cells / 64, (drawn, shown_cells)

    with pinned_cache(name):
        asyncio.run(scenario())


def test_dump_draws_pinned_cells_with_a_legend(capsys, monkeypatch):
    name = unique_name("kvmapdump")
    with pinned_cache(name):
        plain = run_kvalloc("dump", name)  # piped
        monkeypatch.setenv("FORCE_COLOR", "1")
        assert main(["dump", name]) == 0
    coloured = capsys.readouterr().out
    assert plain.returncode == 0, plain.stderr
    assert "kv pinned" in plain.stdout and "kv pinned" in coloured
    # The map draws pinned cells (full blocks) in the legend's pinned colour, not used's.
    pinned = re.search(r"\x1b\[([0-9;]+)m█\x1b\[0m kv pinned", coloured)
    used = re.search(r"\x1b\[([0-9;]+)m█\x1b\[0m kv used", coloured)
    assert pinned and used and pinned[1] != used[1]
    assert f"\x1b[{pinned[1]}m████" in coloured[:pinned.start()]
