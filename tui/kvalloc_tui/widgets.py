"""The panels of ``kvalloc top``: each draws the watched pool's latest snapshot to fit its size.

A panel keeps the ``PoolWatch`` it was last shown and redraws from it on every refresh, so a
resize refits the heap map and the bars without a new snapshot.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from pykvalloc.stats import Snapshot

from . import render
from .watch import PoolWatch


class Panel(Widget):
    """A titled panel; subclasses implement ``draw``."""

    DEFAULT_CSS = """
    Panel {
        height: 1fr;
        text-wrap: nowrap;
        text-overflow: clip;
        border-top: round $primary-darken-1;
        border-title-color: $text-accent;
        border-title-style: bold;
        padding: 0 1;
    }
    """

    TITLE = ""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = self.TITLE
        self.pool: PoolWatch | None = None

    def show(self, pool: PoolWatch) -> None:
        self.pool = pool
        self.refresh()

    def render(self) -> Text:
        size = self.content_size
        if self.pool is None:
            return Text(f"waiting for {self.app.waiting_for()}…", "dim")  # type: ignore[attr-defined]
        if self.pool.last is None:
            return Text("waiting for the first snapshot…", "dim")
        return self.draw(self.pool.last, size.width, size.height)

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        # Every panel below draws itself; this base class is never shown on its own.
        raise TypeError(f"{type(self).__name__} does not say how to draw itself")


def _lines(lines: list[Text], height: int) -> Text:
    return Text("\n", no_wrap=True, overflow="crop").join(lines[:max(0, height)])


class PoolHeader(Widget):
    """One line: pool, pid, process, uptime, capacity, use and the writer's state."""

    DEFAULT_CSS = """
    PoolHeader {
        dock: top;
        height: 1;
        background: $panel;
        padding: 0 1;
    }
    """

    def __init__(self) -> None:
        super().__init__(id="header")
        self.pool: PoolWatch | None = None
        self.paused = False
        self.interval = 1.0

    def show(self, pool: PoolWatch, paused: bool, interval: float) -> None:
        self.pool, self.paused, self.interval = pool, paused, interval
        self.refresh()

    def render(self) -> Text:
        pool = self.pool
        if pool is None:
            return Text(f"kvalloc top: waiting for {self.app.waiting_for()}…"  # type: ignore[attr-defined]
                        " (p: pick one)", "dim", no_wrap=True, overflow="ellipsis")
        if pool.ended:
            state = ("ENGINE EXITED", "bold red")
        elif self.paused:
            state = ("PAUSED", "bold yellow")
        elif pool.last is None:
            state = ("", "")
        else:
            state = render.writer_state(pool.last)
        if pool.last is None:
            # Paused before this pool was first read: nothing is read until space is pressed.
            waiting = Text(f"{pool.file.name}  pid {pool.file.pid}: no snapshot yet", "dim",
                           no_wrap=True, overflow="crop")
            if state[0]:
                waiting.append("  ").append(state[0], state[1])
            return waiting
        return render.header_line(pool.last, pool.process, state, self.content_size.width,
                                  self.interval)


class Banner(Widget):
    """A line shown only when something is wrong: the engine exited, or a read failed."""

    DEFAULT_CSS = """
    Banner {
        dock: top;
        height: auto;
        max-height: 3;
        display: none;
        padding: 0 1;
        background: $error-darken-2;
        color: $text;
    }
    Banner.-shown {
        display: block;
    }
    """

    def __init__(self) -> None:
        super().__init__(id="banner")
        self.message = ""

    def say(self, message: str | None) -> None:
        self.message = message or ""
        self.set_class(bool(message), "-shown")
        self.refresh(layout=True)

    def render(self) -> Text:
        return Text(self.message)


class HeapMapPanel(Panel):
    TITLE = "heap map"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        if snap.cell_state is None:
            return Text("this writer publishes no heap map", "dim")
        rows = max(1, height - 1)
        shown = min(width * rows, len(snap.cell_state))
        lines = [render.heap_map(snap, width, rows), render.heap_legend(snap, shown)]
        return _lines(lines, max(1, height))


class OrdersPanel(Panel):
    TITLE = "free blocks per order"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        return render.order_columns(snap, width, height)


class ClassesPanel(Panel):
    TITLE = "slab classes"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        return _lines(render.class_lines(snap, width), height)


class TrendsPanel(Panel):
    TITLE = "use · fragmentation · latency"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        assert self.pool is not None
        if snap.kv is not None:
            # A pool holding a KV cache: "heap" is its bytes in use, the KV region counted
            # whole (the cache's own use is in its panel and the header); one line with the
            # fragmentation, to leave room for the cache's call latencies.
            half = width // 2
            spark = max(0, half - 12)
            lines = [Text.assemble(("heap ", "bold"), f"{snap.use_fraction:>5.1%} ",
                                   render.sparkline(self.pool.use, spark), " ",
                                   ("frag ", "bold"), f"{snap.fragmentation:>5.1%} ",
                                   render.sparkline(self.pool.fragmentation,
                                                    max(0, width - half - 12), "yellow3"),
                                   no_wrap=True, overflow="crop")]
        else:
            spark_width = max(0, width - 11)
            lines = [
                Text.assemble(("use  ", "bold"), f"{snap.use_fraction:>5.1%} ",
                              render.sparkline(self.pool.use, spark_width)),
                Text.assemble(("frag ", "bold"), f"{snap.fragmentation:>5.1%} ",
                              render.sparkline(self.pool.fragmentation, spark_width, "yellow3")),
            ]
        return _lines([*lines, *render.latency_lines(snap)], height)


class KvPanel(Panel):
    TITLE = "KV cache"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        assert self.pool is not None
        return _lines(render.kv_lines(snap, width, self.pool.hit_rate, self.pool.evictions,
                                      self.pool.first_hit_rate, self.pool.readmit_hit_rate),
                      height)


class SequencesPanel(Panel):
    TITLE = "sequences (longest first; ↑ ↓ select)"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        assert self.pool is not None
        return _lines(render.sequence_lines(snap, width, height, self.pool.selected_sequence),
                      height)


class NamespacesPanel(Panel):
    TITLE = "namespaces: share of the blocks"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        return _lines(render.namespace_lines(snap, width, height), height)


class LatencyPanel(Panel):
    TITLE = "latency"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        return _lines(render.latency_lines(snap), height)


class OpsPanel(Panel):
    TITLE = "recent operations"

    def draw(self, snap: Snapshot, width: int, height: int) -> Text:
        lines = [render.op_line(record) for record in render.recent_ops(snap, height)]
        note = render.trace_note(snap)
        if not lines:
            lines = [Text("no operations recorded yet", "dim")]
        if note and len(lines) < height:
            lines.append(Text(note, "dim italic"))
        return _lines(lines, height)
