"""``kvalloc top`` driven through Textual's pilot (``App.run_test``) against real pools: a writer
process the test drives, pools of this process, a crafted segment with a KV section. Each test
is a plain function running its coroutine with asyncio.run."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.text import Text
from stats_writer import Writer, crafted_segment, prune_lock, unique_name, writer_named

import pykvalloc
from pykvalloc import stats
from pykvalloc.sizes import format_size
from pykvalloc.stats.layout import TRACE_RECORDS_MAX
from kvalloc_tui import render, watch
from kvalloc_tui.app import INTERVALS, KvallocTop
from kvalloc_tui.screens import HelpScreen, PickerScreen, PoolScreen
from kvalloc_tui.widgets import Banner

MiB = 1 << 20


async def until(pilot: Any, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Lets the app run until ``predicate()`` holds; fails after ``timeout`` seconds, a bound
    against a hang that a loaded machine never reaches."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        assert loop.time() < deadline, f"hung: {predicate} still false after {timeout:g} s"
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
            assert orders[-1].split()[:2] == ["4K", "8K"]  # the orders span the width
            # Every order's count is drawn, none over another (one row or two, staggered).
            counts = [render.compact_count(n, 5) for n in expected["free_blocks"]]
            drawn = [label for line in orders[:-1] for label in line.split() if label[0].isdigit()]
            assert sorted(drawn) == sorted(counts) and len(drawn) == len(expected["free_blocks"])

            classes = shown(app, "#classes").plain
            by_size = {c["object_size"]: c for c in truth["classes"] if c["slabs"]}
            for size, cls in by_size.items():
                room = cls["slabs"] * cls["objects_per_slab"]
                assert f"{format_size(size)} ▕" in classes
                assert f"{cls['live_objects']:,}/{room:,} ×{cls['slabs']}" in classes

            trends = shown(app, "#trends").plain
            assert f"use  {use:>5.1%}" in trends and "p50" in trends and "alloc" in trends
            assert "sampled" not in trends  # trace on: every call is timed

            assert not app.screen.query_one("#kv").display  # no KV cache: no panel for one

            ops = shown(app, "#ops")
            first = ops.plain.splitlines()[0]
            assert "alloc" in first and "15 MiB" in first and "out of memory" in first
            assert any(span.style == render.FAILURE_STYLE for span in ops.spans)

            text = screen_text(app)
            lines = text.splitlines()
            assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
            for title in ("heap map", "free blocks per order", "slab classes",
                          "use · fragmentation · latency", "recent operations"):
                assert title in text, title
            assert "KV cache" not in text
            heap = shown(app, "#heap").plain.splitlines()
            assert len(heap[0]) == app.screen.query_one("#heap").content_size.width
            assert "█" in heap[0] and "·" in "".join(heap)
            footer = await until(pilot, lambda: screen_text(app).splitlines()[-1].strip())
            for key in ("q Quit", "space Pause", "+ - ↻ 0.1 s", "tab Next pool",
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

            # + refreshes more often, - less often; the footer says how often.
            await pilot.press("minus")
            assert app.interval == 0.5 and "↻ 0.5 s" in shown(app, "#header").plain
            await until(pilot, lambda: "+ - ↻ 0.5 s" in screen_text(app).splitlines()[-1])
            await pilot.press("plus", "plus", "plus", "plus")
            assert app.interval == INTERVALS[0] == 0.1
            assert "↻ 0.1 s" in shown(app, "#header").plain
            await until(pilot, lambda: "+ - ↻ 0.1 s" in screen_text(app).splitlines()[-1])

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
            lines = shown(app, "#kv").plain.splitlines()
            width = app.screen.query_one("#kv").content_size.width
            held = round(width * 0.75)  # used, then cached
            assert lines[0] == "█" * held + "·" * (width - held)
            assert "used 600 60.0%  pinned 0  cached 150 15.0%  free 250  of 1,000" in lines[1]
            assert lines[2].startswith("hit  25.0% of 12000 tok") and "seqs 42" in lines[3]
            # The KV use the header shows is the one kvalloc ls shows (use_label).
            assert "KV 60.0% +15.0% cached" in shown(app, "#header").plain
            await pilot.press("v")  # the pool's page
            await until(pilot, lambda: app.screen.query_one("#heap").display)
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
            assert banner.message.startswith("Read failed, retrying: no consistent snapshot of")
            assert app.current.ended is None and app.is_running
            assert "no snapshot yet" in shown(app, "#header").plain

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def real_segment(trace: bool = False) -> bytearray:
    """A consistent copy of a real, partly used pool's segment, to damage and serve crafted."""
    with pykvalloc.Pool(16 * MiB, name=unique_name("copied"), pages="small", trace=trace) as pool:
        blocks = [pool.alloc(64) for _ in range(50)] + [pool.alloc(1 << 16) for _ in range(10)]
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            data = bytearray(segment.snapshot().data)
        del blocks
    return data


def test_figures_out_of_range_are_drawn_clamped():
    data = real_segment()
    snap = stats.Snapshot(bytes(data))
    summary_at = snap._sections[stats.SECTION_SUMMARY][0]
    summary = np.frombuffer(data, stats.SUMMARY_DTYPE, count=1, offset=summary_at)
    summary["fragmentation"] = float("inf")
    kv = np.frombuffer(data, stats.KV_DTYPE, count=1, offset=snap._sections[stats.SECTION_KV][0])
    kv["present"], kv["total_blocks"], kv["used_blocks"], kv["cached_blocks"] = 1, 1, 2**62, 2**62
    kv["pinned_blocks"] = 2**64 - 1

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and len(app.current.fragmentation) >= 2)
            width = app.screen.query_one("#kv").content_size.width
            state_bar = shown(app, "#kv")
            # All used, all of it pinned: no room for more, nor for cached.
            assert state_bar.plain.splitlines()[0] == "█" * width
            assert state_bar.spans[0].style == render.PINNED_STYLE
            assert state_bar.spans[0].end - state_bar.spans[0].start == width
            await pilot.press("v")  # the pool's page
            await until(pilot, lambda: app.screen.query_one("#trends").display)
            await pilot.pause(0.1)
            frag = next(line for line in shown(app, "#trends").plain.splitlines()
                        if "frag" in line)  # beside the heap's use, for a pool with a KV cache
            assert frag.endswith("██")  # full, not an overflow
            assert app.current.problem is None and app.is_running

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def test_drawing_helpers_clamp_what_they_are_given():
    for value, fraction in ((float("inf"), 1.0), (float("-inf"), 0.0), (float("nan"), 0.0),
                            (2**62, 1.0), (-3, 0.0), (0.25, 0.25)):
        assert render.unit(value) == fraction
    assert render.bar(float("nan"), 4).plain == "    "
    assert render.bar(float("inf"), 4).plain == "████"
    assert render.sparkline([float("nan"), float("inf"), -1.0, 0.5], 4).plain == "▁█▁▄"


def test_a_writer_pid_no_process_can_have_shows_a_dead_writer():
    # writer_pid is a u32: past 2**31, judged by the pid alone (no liveness lock), os.kill
    # raised OverflowError in the sampling thread and the app died.
    data = real_segment()
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["writer_pid"] = 2**32 - 1
    header["capabilities"] &= ~np.uint64(stats.CAP_LIVENESS_LOCK)

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.ended)
            await pilot.pause(0.05)
            banner = app.screen.query_one(Banner).message
            assert banner.startswith("Engine exited") and f"process {2**32 - 1}" in banner
            assert app.is_running

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def test_a_file_named_with_a_pid_past_2_31_is_not_a_live_pool():
    async def scenario(pool: pykvalloc.Pool) -> None:
        app = KvallocTop(target(pool.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            await pilot.press("tab")
            await pilot.pause(0.1)
            await pilot.press("p")
            await pilot.pause(0.2)
            assert app.is_running
            if isinstance(app.screen, PickerScreen):  # other test runs' pools may be live
                options = app.screen.query_one("#pools")
                ids = [options.get_option_at_index(i).id for i in range(options.option_count)]
                assert str(stray) not in ids

    with crafted_segment(b"\0" * 64, pid=9_999_999_999) as stray, \
            pykvalloc.Pool(16 * MiB, name=unique_name("beside")) as pool:
        asyncio.run(scenario(pool))


def test_the_picker_survives_any_terminal_size():
    # `kvalloc top` with several live pools opens on the picker: at a width of 7 or less its
    # bordered box left its rows no width, and rich's wrapping raised ValueError at launch.
    async def scenario(width: int, height: int) -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(width, height)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, PickerScreen))
            await pilot.pause(0.1)
            await pilot.resize_terminal(width + 1, height)
            await pilot.pause(0.1)
            assert app.is_running and isinstance(app.screen, PickerScreen)
            await pilot.press("escape")
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, PickerScreen))
            await pilot.pause(0.1)
            assert app.is_running

    with pykvalloc.Pool(16 * MiB, name=unique_name("narrow-a")), \
            pykvalloc.Pool(16 * MiB, name=unique_name("narrow-b")):
        for width, height in ((7, 24), (1, 1), (3, 5), (12, 3)):
            asyncio.run(scenario(width, height))


async def picker_rows(app: KvallocTop, pilot: Any) -> list[str]:
    """The rows of the pool picker, once it shows (the app starts with several live pools)."""
    picker = await until(pilot, lambda: isinstance(app.screen, PickerScreen) and app.screen)
    options = picker.query_one("#pools")
    return [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]


def test_the_picker_shows_whole_names_that_share_a_long_prefix():
    prefix = f"kv-cache-llama-70b-shard-{unique_name('p')}-"

    async def scenario() -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(120, 30)) as pilot:
            rows = await picker_rows(app, pilot)
            for name in (prefix + "primary", prefix + "secondary"):
                row = next(row for row in rows if name in row)
                assert row.endswith(name) and "16 MiB" in row
            assert all(len(line) <= 120 for line in screen_text(app).splitlines())

    with pykvalloc.Pool(16 * MiB, name=prefix + "primary"), \
            pykvalloc.Pool(16 * MiB, name=prefix + "secondary"):
        asyncio.run(scenario())


def test_the_picker_shows_process_names_as_written():
    # A process name is text, not Textual markup: read as markup, "[/]engine" would crash the
    # picker and "[engine]" show as nothing.
    async def scenario(names: list[str]) -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(120, 30)) as pilot:
            rows = await picker_rows(app, pilot)
            for process, pool in (("[/]engine", names[0]), ("[engine]", names[1])):
                assert process in next(row for row in rows if row.endswith(pool))

    with writer_named("[/]engine") as (first, _), writer_named("[engine]") as (second, _):
        asyncio.run(scenario([first, second]))


def test_a_pool_first_shown_while_paused_says_it_is_paused():
    async def scenario(first: pykvalloc.Pool, second: pykvalloc.Pool) -> None:
        app = KvallocTop(target(first.segment_name), interval=0.1)
        async with app.run_test(size=(100, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            await pilot.press("space")
            for _ in range(50):  # other test runs on this machine may own live pools too
                await pilot.press("tab")
                if app.current.file.name == second.name:
                    break
            await pilot.pause(0.3)
            assert app.current.file.name == second.name and app.current.last is None
            header = shown(app, "#header").plain
            assert "no snapshot yet" in header and "PAUSED" in header
            await pilot.press("space")
            await until(pilot, lambda: app.current.last)
            assert "PAUSED" not in shown(app, "#header").plain

    with pykvalloc.Pool(16 * MiB, name=unique_name("paused-a")) as first, \
            pykvalloc.Pool(16 * MiB, name=unique_name("paused-b")) as second:
        asyncio.run(scenario(first, second))


def test_a_pool_without_trace_says_its_calls_are_not_timed():
    async def scenario(pool: pykvalloc.Pool) -> None:
        app = KvallocTop(target(pool.segment_name), interval=0.1)
        async with app.run_test(size=(100, 24)) as pilot:
            snap = await until(pilot, lambda: app.current and app.current.last)
            # The library reads no clock without trace: nothing is timed, not some calls.
            assert snap.latency_samples("alloc") == snap.latency_samples("free") == 0
            trends = shown(app, "#trends").plain
            assert render.UNTIMED_NOTE in trends and "sampled" not in trends

    with pykvalloc.Pool(16 * MiB, name=unique_name("untimed")) as pool:
        blocks = [pool.alloc(1 << 16) for _ in range(20)]
        pool.publish()
        asyncio.run(scenario(pool))
        del blocks


def test_a_pool_created_again_at_the_same_path_is_watched_afresh():
    name = unique_name("again")

    async def scenario() -> None:
        pool = pykvalloc.Pool(16 * MiB, name=name)
        try:
            app = KvallocTop(target(pool.segment_name), interval=0.1)
            async with app.run_test(size=(100, 24)) as pilot:
                await until(pilot, lambda: app.current and app.current.last)
                pool.close()
                await until(pilot, lambda: app.current.ended)
                pool = pykvalloc.Pool(64 * MiB, name=name)  # same process, same name: same path
                pool.publish()
                await until(pilot, lambda: not app.current.ended and app.current.last)
                assert app.current.last.capacity == 64 * MiB
                await pilot.pause(0.1)
                assert "64 MiB" in shown(app, "#header").plain
                assert "ENGINE EXITED" not in shown(app, "#header").plain
                assert not app.screen.query_one(Banner).message
        finally:
            pool.close()

    asyncio.run(scenario())


def mappings_of(path) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(path) in line]


def descriptors_of(path) -> list[str]:
    """This process's open descriptors of the file at ``path`` (or that was there)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue  # the descriptor that listed the directory
        if target.startswith(str(path)):
            held.append(target)
    return held


def test_an_ended_pool_is_unmapped_and_its_last_figures_stay():
    async def scenario() -> None:
        pool = pykvalloc.Pool(16 * MiB, name=unique_name("unmapped"))
        block = pool.alloc(4 * MiB)
        pool.publish()
        path = stats.SHM_DIR / pool.segment_name.lstrip("/")
        app = KvallocTop(target(pool.segment_name), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            assert descriptors_of(path)  # the reader's (the pool's is the library's)
            del block
            pool.close()
            await until(pilot, lambda: app.current.ended)
            # The destroyed pool's shared memory is freed only when no mapping or descriptor of
            # it is left.
            assert mappings_of(path) == [] and descriptors_of(path) == []
            await pilot.pause(0.1)
            assert "█" in shown(app, "#heap").plain and "ENGINE EXITED" in shown(
                app, "#header").plain

    asyncio.run(scenario())


def test_a_redraw_copies_a_screenful_of_a_large_trace_ring(monkeypatch):
    # A valid segment may hold a ring of as many records as a reader takes (TRACE_RECORDS_MAX);
    # a screen shows a few of them, and only those are copied out of it (turning the whole ring
    # into dicts took seconds a redraw).
    data = real_segment(trace=True)
    end, records = len(data), TRACE_RECORDS_MAX
    ring = np.zeros(records, stats.RECORD_DTYPE)
    ring["time_ns"], ring["op"], ring["size"] = 1, 1, np.arange(records)
    head = np.zeros(1, stats.TRACE_DTYPE)
    head["capacity"], head["entry_size"], head["written"] = records, ring.itemsize, records
    data += head.tobytes() + ring.tobytes()
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["segment_size"] = len(data)
    sections = header["sections"][0]
    trace_entry = sections[list(sections["kind"]).index(stats.SECTION_TRACE)]
    trace_entry["offset"], trace_entry["size"] = end, len(data) - end
    snap = stats.Snapshot(bytes(data))

    copied: list[int] = []  # records each read of the ring took out of it
    whole_ring = stats.Snapshot.trace_tail

    def counted(self, newest=None):
        tail = whole_ring(self, newest)
        copied.append(len(tail) if tail is not None else 0)
        return tail

    monkeypatch.setattr(stats.Snapshot, "trace_tail", counted)
    shown_ops = render.recent_ops(snap, 6)
    assert [op["size"] for op in shown_ops] == list(range(records - 1, records - 7, -1))
    assert copied == [6]

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            copied.clear()
            await pilot.press("space")  # a redraw of every panel
            await until(pilot, lambda: copied)
            assert app.paused
            assert max(copied) <= 100  # a screenful, never the whole ring

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


@pytest.mark.parametrize("damage", ["major version", "magic"])
def test_a_lasting_read_error_says_so_and_is_retried_slowly(damage, monkeypatch):
    # The retry waits LASTING_RETRY_S after a lasting error; an hour here, so that no tick of the
    # pause below reads again however slowly a loaded machine runs it.
    monkeypatch.setattr(watch, "LASTING_RETRY_S", 3600.0)
    data = real_segment()
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    if damage == "major version":
        header["abi_major"] = stats.ABI_MAJOR + 1
    else:
        header["magic"] = 0x1122334455667788

    async def scenario(path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(100, 24)) as pilot:
            banner = app.screen.query_one(Banner)
            await until(pilot, lambda: banner.message)
            assert "retrying will not help" in banner.message
            assert ("has layout version 2." if damage == "major version" else
                    "is not a kvalloc statistics segment") in banner.message
            pool = app.current
            reads = []
            take = pool.take
            pool.take = lambda: reads.append(1) or take()  # type: ignore[method-assign]
            await pilot.pause(1.0)  # ten ticks
            assert len(reads) == 0 and app.is_running
            # Nothing held while waiting but crafted_segment's own descriptor, which holds the
            # writer's lock.
            assert mappings_of(path) == [] and len(descriptors_of(path)) == 1

    with crafted_segment(bytes(data)) as path:
        asyncio.run(scenario(path))


def test_a_segment_directory_that_cannot_be_listed_is_reported(monkeypatch, tmp_path):
    not_a_directory = tmp_path / "shm"
    not_a_directory.write_text("")
    monkeypatch.setattr(watch, "list_segments", lambda: stats.list_segments(not_a_directory))

    async def scenario() -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(100, 24)) as pilot:
            notices = await until(pilot, lambda: list(app._notifications))
            assert notices[0].title == "cannot list pools" and notices[0].severity == "error"
            assert f"cannot list the segments in {not_a_directory}" in notices[0].message
            await pilot.pause(0.5)  # ticks keep trying; the notice is not repeated each time
            assert len(list(app._notifications)) == 1
            await pilot.press("tab", "p")  # a key asks again: the same error, not "no pools"
            await pilot.pause(0.1)
            assert [n.title for n in app._notifications] == ["cannot list pools"] * 3
            assert app.is_running and app.current is None

    asyncio.run(scenario())


def test_with_no_pool_it_waits_and_watches_the_first_to_appear(monkeypatch):
    # It exited at once; an operator starts it before the engine. Other runs' pools may live
    # on this machine, so the listing the app sees is this test's.
    appeared: list[stats.SegmentFile] = []
    monkeypatch.setattr("kvalloc_tui.app.live_segments", lambda: list(appeared))

    async def scenario() -> None:
        app = KvallocTop(interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.3)
            assert app.is_running and app.current is None
            assert "waiting for a pool" in shown(app, "#header").plain
            assert "waiting for a pool to publish" in shown(app, "#heap").plain
            with pykvalloc.Pool(16 * MiB, name=unique_name("late")) as pool:
                pool.publish()
                appeared.append(target(pool.segment_name))
                await until(pilot, lambda: app.current and app.current.last)
                assert pool.name in shown(app, "#header").plain

    asyncio.run(scenario())


def test_a_kv_cache_in_a_pool_with_buffers_lights_every_panel_at_80x24():
    # A serving engine's pool: the KV cache, activation buffers through the buddy, token
    # metadata and scratch through slab classes (what `kvalloc demo` allocates).
    name = unique_name("engine")

    async def scenario(cache: pykvalloc.KVCache) -> None:
        app = KvallocTop(target(f"/kvalloc.{os.getpid()}.{name}"), interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last
                        and len(app.current.hit_rate) >= 1)
            text = screen_text(app)
            lines = text.splitlines()
            assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
            # The KV cache's page first: the cache, its sequences, namespaces and latencies.
            for title in ("KV cache", "sequences", "namespaces", "latency"):
                assert title in text, title
            for hidden in ("#heap", "#orders", "#middle", "#ops"):
                assert not app.screen.query_one(hidden).display, hidden
            kv = shown(app, "#kv").plain.splitlines()
            assert len(kv) == 5 and "used 8 12.5%" in kv[1] and kv[2].startswith("hit ")
            assert "seqs 2" in kv[3]
            assert kv[4].startswith("peak used 8 12.5%  cached 0 0.0%  bytes 128 KiB")
            # The KV cache's call latencies (timed: the pool traces), then the pool's.
            latency = shown(app, "#kv-latency").plain.splitlines()
            assert latency[0].split() == ["latency", "p50", "p99", "p999"]
            assert latency[1].startswith("KV allocate") and "≤" in latency[1]
            assert any(line.startswith("pool alloc") for line in latency)
            assert "KV 12.5% +0.0% cached" in shown(app, "#header").plain
            footer = await until(pilot, lambda: screen_text(app).splitlines()[-1].strip())
            assert "v Pool view" in footer and "? Help" in footer and len(footer) <= 80

            # v: the pool's page, where the buffers around the cache show.
            await pilot.press("v")
            await until(pilot, lambda: app.screen.query_one("#heap").display)
            await pilot.pause(0.1)
            text = screen_text(app)
            for title in ("heap map", "free blocks per order", "slab classes",
                          "use · fragmentation · latency", "recent operations"):
                assert title in text, title
            assert not app.screen.query_one("#kv").display
            assert "v KV view" in text.splitlines()[-1]
            classes = shown(app, "#classes").plain
            assert "64 B ▕" in classes and "64 KiB ▕" in classes
            orders = shown(app, "#orders").plain.splitlines()
            assert any(label not in ("0", "") for label in orders[0].split())
            trends = shown(app, "#trends").plain.splitlines()
            assert trends[0].startswith("heap ")  # the pool's bytes, KV region whole
            assert trends[2].startswith("KV allocate") and "≤" in trends[2]

    with pykvalloc.Pool(64 * MiB, name=name, trace=True, pages="small") as pool, \
            pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                              pool=pool, trace=True) as cache:
        first, second = cache.allocate(4 * 16), cache.allocate(4 * 16)
        buffers = [pool.alloc(size) for size in (3 * MiB, 700 << 10, 5 * MiB)]
        metadata = [pool.alloc(64) for _ in range(300)]
        scratch = [pool.alloc(64 << 10) for _ in range(6)]
        cache.publish()
        asyncio.run(scenario(cache))
        for allocation in (*buffers, *metadata, *scratch):
            pool.free(allocation)
        first.free()
        second.free()


def test_a_named_pool_that_does_not_exist_yet_is_waited_for():
    # `kvalloc top NAME` started before the engine: it waits for that pool, not any pool.
    name = unique_name("awaited")

    async def scenario() -> None:
        app = KvallocTop(interval=0.1, wanted=name)
        async with app.run_test(size=(80, 24)) as pilot:
            with pykvalloc.Pool(16 * MiB, name=unique_name("other")) as other:
                other.publish()
                await pilot.pause(0.5)  # five ticks: another pool is not the one asked for
                assert app.is_running and app.current is None
            lines = screen_text(app).splitlines()
            assert f"waiting for pool '{name}' to publish…" in lines[0]
            assert "q Quit" in lines[-1] and all(len(line) <= 80 for line in lines)
            assert f"waiting for pool '{name}' to publish" in shown(app, "#heap").plain
            with pykvalloc.Pool(16 * MiB, name=name) as pool:
                pool.publish()
                await until(pilot, lambda: app.current and app.current.last)
                assert app.current.file.name == name
                assert name in shown(app, "#header").plain
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.is_running)

    asyncio.run(scenario())


def test_a_named_pool_started_again_after_its_engine_exited_is_watched():
    name = unique_name("restarted")

    async def scenario(first: Writer) -> None:
        app = KvallocTop(target(first.segment_name), interval=0.1, wanted=name)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.current and app.current.last)
            first.kill()
            await until(pilot, lambda: app.current.ended)
            await pilot.pause(0.05)
            banner = app.screen.query_one(Banner).message
            assert banner.startswith("Engine exited") and f"'{name}' started again" in banner
            with Writer(name) as second:
                await until(pilot, lambda: app.current.file.pid == second.pid
                            and app.current.last)
                await pilot.pause(0.05)
                assert "ENGINE EXITED" not in shown(app, "#header").plain
                assert f"pid {second.pid}" in shown(app, "#header").plain

    with prune_lock(exclusive=False), Writer(name) as first:
        asyncio.run(scenario(first))
