"""``kvalloc top`` driven through Textual's pilot (``App.run_test``) against real pools: a writer
process the test drives, pools of this process, a crafted segment with a KV section. Each test
is a plain function running its coroutine with asyncio.run."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console
from rich.text import Text
from stats_writer import Writer, crafted_segment, prune_lock, unique_name

import pykvalloc
from pykvalloc import stats
from pykvalloc.sizes import format_size
from kvalloc_tui import render
from kvalloc_tui.app import INTERVALS, KvallocTop
from kvalloc_tui.screens import HelpScreen, PickerScreen, PoolScreen
from kvalloc_tui.widgets import Banner

MiB = 1 << 20


async def until(pilot: Any, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Lets the app run until ``predicate()`` holds; fails after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        assert loop.time() < deadline, f"timed out waiting for {predicate}"
        await pilot.pause(0.02)
    return value


def shown(app: KvallocTop, selector: str) -> Text:
    """What a panel draws now."""
    widget = app.screen.query_one(selector)
    rendered = widget.render()
    assert isinstance(rendered, Text)
    return rendered


def screen_text(app: KvallocTop) -> str:
    """The whole screen as plain text, as a terminal of the app's size would show it."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      force_terminal=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text()


def target(segment_name: str) -> stats.SegmentFile:
    return stats.find_segment(segment_name.lstrip("/"))


def test_the_panels_show_the_pools_real_figures_at_80x24():
    async def scenario(writer: Writer, truth: dict) -> None:
        app = KvallocTop(target(writer.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            expected = truth["stats"]

            header = shown(app, "#header").plain
            use = expected["bytes_in_use"] / expected["capacity"]
            for part in (writer.name, f"pid {writer.pid}", "16 MiB", f"use {use:.1%}", "up "):
                assert part in header, part

            orders = shown(app, "#orders").plain.splitlines()
            assert orders[-1].split()[:2] == ["4K", "16K"]  # sizes, every other one labelled
            counts = [render.compact_count(n) for n in expected["free_blocks"]]
            assert orders[0].split() == counts[-len(orders[0].split()):]

            classes = shown(app, "#classes").plain
            by_size = {c["object_size"]: c for c in truth["classes"] if c["slabs"]}
            for size, cls in by_size.items():
                room = cls["slabs"] * cls["objects_per_slab"]
                assert f"{format_size(size)} ▕" in classes
                assert f"{cls['live_objects']:,}/{room:,} ×{cls['slabs']}" in classes

            trends = shown(app, "#trends").plain
            assert f"use  {use:>5.1%}" in trends and "p50" in trends and "alloc" in trends
            assert "sampled" not in trends  # trace on: every call is timed

            assert shown(app, "#kv").plain == "no KV cache attached"

            ops = shown(app, "#ops")
            first = ops.plain.splitlines()[0]
            assert "alloc" in first and "15 MiB" in first and "out of memory" in first
            assert any(span.style == render.FAILURE_STYLE for span in ops.spans)

            text = screen_text(app)
            lines = text.splitlines()
            assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
            for title in ("heap map", "free blocks per order", "slab classes", "KV cache",
                          "use · fragmentation · latency", "recent operations"):
                assert title in text, title
            heap = shown(app, "#heap").plain.splitlines()
            assert len(heap[0]) == app.screen.query_one("#heap").content_size.width
            assert "█" in heap[0] and "·" in "".join(heap)
            footer = await until(pilot, lambda: screen_text(app).splitlines()[-1].strip())
            for key in ("q Quit", "space Pause", "+ Slower", "- Faster", "tab Next pool",
                        "? Help"):
                assert key in footer, key

    with Writer(unique_name("top"), trace=True) as writer:
        writer.ask("alloc 64 500")
        writer.ask("alloc 1000 100")
        writer.ask("alloc 300000 8")
        writer.ask("free_every 3")
        writer.ask(f"fail {15 * MiB}")
        writer.ask("publish")
        asyncio.run(scenario(writer, writer.ask("stats")))


def test_pause_interval_help_and_quit_keys():
    async def scenario(pool: pykvalloc.Pool) -> None:
        app = KvallocTop(target(pool.segment_name), interval=0.2)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and len(app.current.use) >= 2)

            await pilot.press("space")
            assert app.paused and "PAUSED" in shown(app, "#header").plain
            samples = len(app.current.use)
            await pilot.pause(0.5)
            assert len(app.current.use) == samples  # nothing read while paused
            await pilot.press("space")
            assert not app.paused
            await until(pilot, lambda: len(app.current.use) > samples)

            await pilot.press("plus")
            assert app.interval == 0.5 and "↻ 0.5 s" in shown(app, "#header").plain
            await pilot.press("minus", "minus", "minus", "minus")
            assert app.interval == INTERVALS[0] == 0.1
            assert "↻ 0.1 s" in shown(app, "#header").plain

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            assert "pause / resume" in screen_text(app)
            await pilot.press("escape")
            assert isinstance(app.screen, PoolScreen)

            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)

    with pykvalloc.Pool(16 * MiB, name=unique_name("keys")) as pool:
        asyncio.run(scenario(pool))


def test_tab_cycles_through_the_live_pools():
    async def scenario(first: pykvalloc.Pool, second: pykvalloc.Pool) -> None:
        app = KvallocTop(target(first.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            visited = [app.current.file.name]
            for _ in range(50):  # other test runs on this machine may own live pools too
                await pilot.press("tab")
                visited.append(app.current.file.name)
                if visited[-1] == first.name:
                    break
            assert visited[-1] == first.name and second.name in visited
            await until(pilot, lambda: second.name in shown(app, "#header").plain
                        if app.current.file.name == second.name else app.current.last)

    with pykvalloc.Pool(16 * MiB, name=unique_name("tab-a")) as first, \
            pykvalloc.Pool(16 * MiB, name=unique_name("tab-b")) as second:
        asyncio.run(scenario(first, second))


def test_the_picker_lists_several_pools_and_opens_the_chosen_one():
    async def scenario(pools: list[pykvalloc.Pool]) -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, PickerScreen))
            await pilot.press("escape")  # declined: the app waits, and does not insist
            await pilot.pause(0.3)
            assert isinstance(app.screen, PoolScreen) and app.current is None
            assert "waiting for a pool" in shown(app, "#header").plain
            await pilot.press("p")
            picker = await until(pilot, lambda: isinstance(app.screen, PickerScreen)
                                 and app.screen)
            options = picker.query_one("#pools")
            ids = [options.get_option_at_index(i).id for i in range(options.option_count)]
            paths = [str(stats.SHM_DIR / pool.segment_name[1:]) for pool in pools]
            assert set(paths) <= set(ids)
            row = str(options.get_option_at_index(ids.index(paths[1])).prompt)
            assert pools[1].name in row and "32 MiB" in row and "use   3.1%" in row
            options.highlighted = ids.index(paths[1])
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, PoolScreen))
            await until(pilot, lambda: app.current.last is not None)
            assert app.current.file.name == pools[1].name
            assert pools[1].name in shown(app, "#header").plain

    with pykvalloc.Pool(16 * MiB, name=unique_name("pick-a")) as a, \
            pykvalloc.Pool(32 * MiB, name=unique_name("pick-b")) as b:
        b.alloc(1 * MiB)
        asyncio.run(scenario([a, b]))


def test_a_destroyed_pool_shows_engine_exited_instead_of_crashing():
    async def scenario() -> None:
        pool = pykvalloc.Pool(16 * MiB, name=unique_name("exits"))
        block = pool.alloc(4 * MiB)
        pool.publish()
        app = KvallocTop(target(pool.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            del block
            pool.close()
            await until(pilot, lambda: app.current.ended)
            await pilot.pause(0.1)
            assert "ENGINE EXITED" in shown(app, "#header").plain
            banner = app.screen.query_one(Banner)
            assert banner.display and "Engine exited" in banner.message
            assert "was destroyed" in banner.message
            assert "Engine exited" in screen_text(app)
            assert "█" in shown(app, "#heap").plain  # the last figures stay on screen
            await pilot.press("space", "plus", "tab")  # keys still work
            assert app.is_running

    asyncio.run(scenario())


def test_a_killed_engine_shows_engine_exited():
    async def scenario(writer: Writer) -> None:
        app = KvallocTop(target(writer.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            writer.kill()
            await until(pilot, lambda: app.current.ended)
            await pilot.pause(0.05)
            assert f"process {writer.pid}" in app.screen.query_one(Banner).message
            assert "ENGINE EXITED" in shown(app, "#header").plain

    with prune_lock(exclusive=False), Writer(unique_name("killed")) as writer:
        writer.ask("alloc 4096 8")
        writer.ask("publish")
        asyncio.run(scenario(writer))


def test_a_kv_cache_shows_its_block_states_and_hit_rate():
    # No KV cache can be attached from Python yet, so the KV section of a real segment is
    # filled in by hand (and a few heap cells painted), as the library's KV manager does.
    with pykvalloc.Pool(16 * MiB, name=unique_name("kv")) as pool:
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            data = bytearray(segment.snapshot().data)
    snap = stats.Snapshot(bytes(data))
    kv_at = snap._sections[stats.SECTION_KV][0]
    kv = np.frombuffer(data, stats.KV_DTYPE, count=1, offset=kv_at)
    kv["present"], kv["block_tokens"], kv["total_blocks"] = 1, 16, 1000
    kv["used_blocks"], kv["cached_blocks"], kv["free_blocks"] = 600, 150, 250
    kv["hit_tokens"], kv["query_tokens"], kv["live_sequences"] = 3000, 12000, 42
    map_at = snap._sections[stats.SECTION_HEAPMAP][0] + stats.HEAPMAP_DTYPE.itemsize
    cells = len(snap.cell_state)
    data[map_at:map_at + cells // 2] = bytes([stats.CELL_KV_USED]) * (cells // 2)
    data[map_at + cells:map_at + cells + cells // 2] = bytes([255]) * (cells // 2)

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            text = shown(app, "#kv").plain
            assert "used 600  cached 150  free 250  of 1,000" in text
            assert "hit rate 25.0% of 12,000 tokens" in text and "seqs 42" in text
            heap = shown(app, "#heap")
            assert "kv used" in heap.plain
            assert any(span.style == render.CELL_STYLES[stats.CELL_KV_USED]
                       for span in heap.spans)

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def test_it_fits_larger_terminals_and_resizes():
    async def scenario(pool: pykvalloc.Pool) -> None:
        app = KvallocTop(target(pool.segment_name), interval=0.1)
        async with app.run_test(size=(160, 50)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            wide = shown(app, "#heap").plain.splitlines()
            assert len(wide[0]) == app.screen.query_one("#heap").content_size.width > 150
            await pilot.resize_terminal(80, 24)
            await pilot.pause(0.1)
            narrow = shown(app, "#heap").plain.splitlines()
            assert len(narrow[0]) == app.screen.query_one("#heap").content_size.width < 80
            assert len(narrow) < len(wide)
            assert all(len(line) <= 80 for line in screen_text(app).splitlines())

    with pykvalloc.Pool(64 * MiB, name=unique_name("sizes")) as pool:
        blocks = [pool.alloc(1 * MiB) for _ in range(8)]
        pool.publish()
        asyncio.run(scenario(pool))
        del blocks


def test_an_unreadable_segment_is_reported_not_fatal():
    with pykvalloc.Pool(16 * MiB, name=unique_name("torn")) as pool:
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            data = bytearray(segment.snapshot().data)
    np.frombuffer(data, stats.HEADER_DTYPE, count=1)["sequence"] |= 1  # forever mid-publish

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            banner = app.screen.query_one(Banner)
            await until(pilot, lambda: banner.message)
            assert banner.message.startswith("Read failed, retrying: InconsistentSnapshot")
            assert app.current.ended is None and app.is_running
            assert "no snapshot yet" in shown(app, "#header").plain

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))
