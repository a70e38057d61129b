"""The screens of ``kvalloc top``: the pool's panels, the pool picker and the help."""

from __future__ import annotations

import reprlib
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Label, OptionList, Static
from textual.widgets.option_list import Option

from pykvalloc.errors import SegmentError
from pykvalloc.sizes import format_size
from pykvalloc.stats import Segment, SegmentFile, process_name

from .watch import LASTING_RETRY_S, PoolWatch
from .widgets import (
    Banner,
    ClassesPanel,
    HeapMapPanel,
    KvPanel,
    LatencyPanel,
    NamespacesPanel,
    OpsPanel,
    OrdersPanel,
    Panel,
    PoolHeader,
    SequencesPanel,
    TrendsPanel,
)


# From this height on, a pool holding a KV cache shows all its panels at once; below it, the
# KV cache's panels and the pool's take turns (v).
ALL_PANELS_HEIGHT = 46


class PoolScreen(Screen[None]):
    """Every panel of one pool. A pool holding a KV cache has two pages: the KV cache's (the
    cache, its sequences, its namespaces beside the call latencies) and the pool's (heap map,
    orders, slab classes beside use and latency, recent operations); v turns from one to the
    other, and from ALL_PANELS_HEIGHT lines on both show at once. A pool without a KV cache has
    the pool's page only. Rows share the height by the fr figures below: at 24 lines each panel
    gets its title and the lines it needs (the KV cache its bar, legend, hit rates, evictions
    and peaks; the sequences their summary, four rows and a block table; the orders two rows
    of counts, a bar and the sizes); taller terminals give all of them more."""

    DEFAULT_CSS = """
    PoolScreen #heap { height: 3fr; min-height: 3; }
    PoolScreen #kv { height: 6fr; min-height: 4; }
    PoolScreen #sequences { height: 9fr; min-height: 4; }
    PoolScreen #kvrow { height: 7fr; min-height: 3; }
    PoolScreen #orders { height: 5fr; min-height: 4; }
    PoolScreen #middle { height: 6fr; min-height: 4; }
    PoolScreen #middle > Panel, PoolScreen #kvrow > Panel { width: 1fr; height: 1fr; }
    PoolScreen #ops { height: 2fr; min-height: 2; }
    PoolScreen #kv, PoolScreen #sequences, PoolScreen #kvrow { display: none; }
    PoolScreen.-kv #kv, PoolScreen.-kv #sequences, PoolScreen.-kv #kvrow { display: block; }
    PoolScreen.-kv.-kv-page #heap, PoolScreen.-kv.-kv-page #orders,
    PoolScreen.-kv.-kv-page #middle, PoolScreen.-kv.-kv-page #ops { display: none; }
    PoolScreen.-kv.-pool-page #kv, PoolScreen.-kv.-pool-page #sequences,
    PoolScreen.-kv.-pool-page #kvrow { display: none; }
    PoolScreen.-all #kv-latency { display: none; }
    """

    def compose(self) -> ComposeResult:
        yield PoolHeader()
        yield Banner()
        with Vertical(id="panels"):
            yield KvPanel(id="kv")
            yield SequencesPanel(id="sequences")
            with Horizontal(id="kvrow"):
                yield NamespacesPanel(id="namespaces")
                yield LatencyPanel(id="kv-latency")
            yield HeapMapPanel(id="heap")
            yield OrdersPanel(id="orders")
            with Horizontal(id="middle"):
                yield ClassesPanel(id="classes")
                yield TrendsPanel(id="trends")
            yield OpsPanel(id="ops")
        yield Footer()

    @property
    def all_shown(self) -> bool:
        """Whether the terminal is tall enough for every panel at once."""
        return self.size.height >= ALL_PANELS_HEIGHT

    def on_resize(self) -> None:
        self.app.redraw()  # type: ignore[attr-defined]

    def on_mount(self) -> None:
        self.app.redraw()  # type: ignore[attr-defined]

    def show(self, pool: PoolWatch, paused: bool, interval: float) -> None:
        """Redraws every panel from the pool's latest snapshot. Queried, not looked up: before
        the screen is composed and while it is torn down at exit there is nothing to draw."""
        wanted = self.app.wanted  # type: ignore[attr-defined]
        if pool.ended:
            message = f"Engine exited: {pool.ended}. Last figures shown; tab: next pool, q: quit."
            if wanted is not None:
                message += f" A pool {reprlib.repr(wanted)} started again is watched."
        elif pool.problem and pool.lasting:
            message = (f"Cannot read this segment, and retrying will not help (checked again "
                       f"every {LASTING_RETRY_S:g} s): {pool.problem}")
        elif pool.problem:
            message = f"Read failed, retrying: {pool.problem}"
        else:
            message = None
        for header in self.query(PoolHeader):
            header.show(pool, paused, interval)
        for banner in self.query(Banner):
            banner.say(message)
        has_kv = pool.last is not None and pool.last.kv is not None
        kv_page = self.app.kv_page  # type: ignore[attr-defined]
        self.set_class(has_kv, "-kv")
        self.set_class(self.all_shown, "-all")
        self.set_class(not self.all_shown and kv_page, "-kv-page")
        self.set_class(not self.all_shown and not kv_page, "-pool-page")
        for panel in self.query(Panel):
            panel.show(pool)


FIGURES_WIDTH = 33  # "   16 MiB  KV 100.0% +100.0% cached"


def _describe(found: SegmentFile) -> Text:
    """One picker row: pid, process, capacity and use, read without trusting the file, and the
    pool's whole name last: pools of one engine often share a long prefix, so a name cut to a
    column would make two of them look the same."""
    try:
        with Segment(found.path) as segment:
            snap = segment.snapshot(check_writer=False)
        # The use the header and kvalloc ls show (Snapshot.use_label).
        use = snap.use_label if snap.kv is not None else f"use {snap.use_label:>6}"
        figures = f"{format_size(snap.capacity):>9}  {use}"
    except SegmentError as exc:
        figures = f"unreadable: {exc.kind}"
    process = process_name(found.pid) or "?"
    # Text, not a str, which Textual would parse as markup: a process may name itself "[/]x".
    return Text(f"{found.pid:>8}  {process[:16]:<16} {figures:<{FIGURES_WIDTH}}  {found.name}")


class PickerScreen(Screen[Path]):
    """Chooses one of several live pools; dismissed with the chosen segment's path."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    DEFAULT_CSS = """
    PickerScreen {
        align: center middle;
    }
    PickerScreen > Vertical {
        width: 90%;
        max-width: 96;
        min-width: 24;  /* narrower, its rows would wrap to no width at all (a crash in rich) */
        height: auto;
        max-height: 90%;
        border: round $primary;
        border-title-style: bold;
    }
    PickerScreen OptionList {
        height: auto;
        max-height: 20;
    }
    """

    def __init__(self, segments: list[SegmentFile]) -> None:
        super().__init__()
        self.segments = segments

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"{len(self.segments)} live pools: pick one (enter)"
            yield Label(f"{'pid':>8}  {'process':<16} {'capacity':>9}  "
                        f"{'use':<{FIGURES_WIDTH - 11}}  pool", classes="heading")
            yield OptionList(*(Option(_describe(found), id=str(found.path))
                               for found in self.segments), id="pools")
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        assert event.option.id is not None
        self.dismiss(Path(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP_KEYS = (
    ("q / Ctrl-C", "quit"),
    ("space", "pause / resume the refresh"),
    ("+ / -", "refresh more / less often (the footer shows the interval, ↻)"),
    ("tab", "next live pool"),
    ("p", "pick a pool from the live ones"),
    ("v", "a KV cache's page / the pool's page (both show from 46 lines)"),
    ("↑ / ↓", "select a sequence: its block table shows below the list"),
    ("? / F1", "this help; escape closes it"),
)


class HelpScreen(ModalScreen[None]):
    """The keys, and what each panel shows; ↑ ↓ scroll it where the terminal is shorter."""

    BINDINGS = [Binding("escape,question_mark,f1,q", "close", "Close")]

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 78;  /* the widest line and the border; a scroll area cannot size to its content */
        max-width: 100%;
        height: auto;
        max-height: 90%;
        border: round $primary;
        padding: 0 1;
        background: $surface;
    }
    HelpScreen Static {
        width: auto;
    }
    """

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold")
        keys.add_column()
        for key, what in HELP_KEYS:
            keys.add_row(key, what)
        panels = Text(
            "heap map: the pool in address order; colour = what holds a cell,\n"
            "  ░▒▓█ = how much of it is in use, · = free; a KV cache's cells\n"
            "  are pinned, used or cached, whichever most of its blocks are\n"
            "KV cache: blocks used by sequences and pins (KV use, as kvalloc ls\n"
            "  says; the pinned ones first, lighter), cached (kept by the prefix\n"
            "  cache, evictable) and free; hit rate overall, then of first\n"
            "  admissions and of re-admissions (readmit) apart, per refresh in\n"
            "  the sparklines; evictions per second\n"
            "sequences: the longest live sequences and pins (listed at the\n"
            "  engine's full publishes, at most a second apart); blocks of the\n"
            "  selected one as runs of ids (17-40 = 17 to 40), … +N: ids left\n"
            "  out, (first 128 of 900): the segment holds the table's start\n"
            "namespaces: blocks its sequences and pins hold (a block in two\n"
            "  tables counts twice), their share of all blocks, registered\n"
            "  prefix blocks (reg); other: every namespace past 32\n"
            "free blocks per order: count (top), free bytes (bars), block size\n"
            "KV cache peaks: since its creation or its last reset_peaks()\n"
            "latency: upper bounds of the log2 buckets holding p50, p99, p999;\n"
            "  the KV cache's calls by kind first (1/64: a sample), then the pool's",
            "dim")
        with VerticalScroll() as scroll:
            scroll.border_title = "kvalloc top: keys"
            scroll.border_subtitle = "↑ ↓ scroll"
            yield Static(Group(keys, Text(), panels), id="help")

    def action_close(self) -> None:
        self.dismiss(None)
