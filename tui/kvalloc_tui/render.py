"""Rich text for the figures of a snapshot, shared by ``kvalloc top`` and ``kvalloc dump``.

Plain functions of a ``pykvalloc.stats.Snapshot`` and the room available; no Textual here, so
``kvalloc dump`` uses them without loading the TUI.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from rich.text import Text

from pykvalloc import stats
from pykvalloc.sizes import format_size
from pykvalloc.stats import KvSequenceEntry, Snapshot, format_age

PINNED_STYLE = "orchid1"  # pinned KV blocks, in the heap map and the KV bar, beside used's magenta
# One colour per heap-map cell state, in the legend's order; the glyph says how full the cell is.
# A state not here (a newer writer's) is drawn as mixed.
CELL_STYLES = {
    stats.CELL_FREE: "grey42",
    stats.CELL_BLOCK: "dodger_blue1",
    stats.CELL_SLAB: "green3",
    stats.CELL_MIXED: "yellow3",
    stats.CELL_KV_PINNED: PINNED_STYLE,
    stats.CELL_KV_USED: "magenta",
    stats.CELL_KV_CACHED: "cyan",
}
FREE_GLYPH = "·"
FILL_GLYPHS = "░▒▓█"  # in-use share of a cell: up to 1/4, 1/2, 3/4, all
BAR_STYLE = "dodger_blue1"
FAILURE_STYLE = "bold red"


def fill_glyph(fill: int) -> str:
    """The glyph of a non-free cell that is ``fill``/255 in use (never blank: it is not free)."""
    return FILL_GLYPHS[min(len(FILL_GLYPHS) - 1, fill * len(FILL_GLYPHS) // 256)]


def heap_map(snap: Snapshot, width: int, height: int) -> Text:
    """The heap in address order as ``height`` rows of ``width`` coloured cells (fewer rows
    when the segment has fewer cells than that)."""
    states, fills = snap.heap_cells(max(0, width * height))
    cells = [(FREE_GLYPH, CELL_STYLES[stats.CELL_FREE]) if state == stats.CELL_FREE else
             (fill_glyph(fill), CELL_STYLES.get(state, CELL_STYLES[stats.CELL_MIXED]))
             for state, fill in zip(states.tolist(), fills.tolist())]
    text = Text(no_wrap=True, overflow="crop")
    for start in range(0, len(cells), max(1, width)):
        if start:
            text.append("\n")
        row = cells[start:start + width]
        run = 0
        for index in range(1, len(row) + 1):  # one span per run of equal cells
            if index == len(row) or row[index] != row[run]:
                text.append(row[run][0] * (index - run), row[run][1])
                run = index
    return text


def heap_legend(snap: Snapshot, cells_shown: int) -> Text:
    """Which colour is which state, and how many bytes one shown cell stands for."""
    text = Text(no_wrap=True, overflow="ellipsis")
    present = set(np.unique(snap.cell_state).tolist()) if snap.cell_state is not None else set()
    for state, style in CELL_STYLES.items():
        if state in present or state in (stats.CELL_FREE, stats.CELL_BLOCK, stats.CELL_SLAB):
            glyph = FREE_GLYPH if state == stats.CELL_FREE else FILL_GLYPHS[-1]
            text.append(glyph, style).append(f" {stats.CELL_NAMES[state]}  ")
    if cells_shown:
        text.append(f"cell ≈ {format_size(snap.capacity / cells_shown)}", "dim")
    return text


def unit(value: float) -> float:
    """``value`` clamped to [0, 1] for drawing, NaN as 0. A segment's figures come from another
    process and may be anything (an infinite fragmentation, more used blocks than blocks): a
    bar or a glyph is sized from this, never from the raw figure."""
    return 0.0 if math.isnan(value) else max(0.0, min(1.0, value))


def bar(fraction: float, width: int, style: str = BAR_STYLE) -> Text:
    """A horizontal bar ``width`` wide, filled to ``fraction`` in eighths of a cell."""
    eighths = round(unit(fraction) * width * 8)
    full, part = divmod(eighths, 8)
    body = "█" * full + ("" if part == 0 else " ▏▎▍▌▋▊▉"[part])
    return Text(body.ljust(width), style, no_wrap=True)


def strip(values: Iterable[int], style: str = "green3") -> Text:
    """Occupancy cells 0..255 as one row of fill glyphs (a space for an empty cell)."""
    text = Text(no_wrap=True)
    for value in values:
        text.append(" " if value == 0 else fill_glyph(int(value)), style)
    return text


def resample(values: np.ndarray, width: int) -> np.ndarray:
    """``values`` averaged (or repeated) into ``width`` cells."""
    if width <= 0 or len(values) == 0:
        return np.zeros(0, np.int64)
    edges = np.linspace(0, len(values), width + 1)
    starts = np.minimum(edges[:-1].astype(np.int64), len(values) - 1)
    stops = np.maximum(np.ceil(edges[1:]).astype(np.int64), starts + 1)
    sums = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    means: np.ndarray = (sums[stops] - sums[starts]) // (stops - starts)
    return means


def format_ns(ns: float) -> str:
    """``64 ns``, ``8.2 µs``, ``524 µs``, ``1.0 ms``, ``2.1 s``: at most three digits."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            value = ns / scale
            return f"{value:.0f} {unit}" if value >= 99.95 else f"{value:.1f} {unit}"
    return f"{ns:.0f} ns"


def percent(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def writer_state(snap: Snapshot) -> tuple[str, str]:
    """("live" | "idle 12 s", style): a live writer that has not published lately is idle."""
    age = snap.heartbeat_age()
    if age >= stats.IDLE_AFTER_S:
        return f"idle {format_age(age)}", "yellow"
    return "live", "green"


def header_line(snap: Snapshot, process: str | None, state: tuple[str, str],
                width: int | None = None, interval: float | None = None) -> Text:
    """Pool, pid and process, uptime, capacity and use at the left; the writer's state and the
    refresh interval at the right. In ``width`` the process name goes first, then the pool name
    is shortened: the figures always show."""
    right = Text(state[0], state[1], no_wrap=True)
    if interval is not None:
        right.append(f"  ↻ {interval:g} s", "dim")
    # The use that ls and the picker show too (use_label): a KV cache's blocks, else bytes.
    figures = f"  up {format_age(snap.uptime())}  {format_size(snap.capacity)}  "
    use = snap.use_label if snap.kv is not None else f"use {snap.use_label}"
    name = snap.pool_name
    label = f" ({process})" if process else ""
    if width is not None:
        room = width - len(right) - 2 - len(f"  pid {snap.pid}") - len(figures) - len(use)
        if len(name) + len(label) > room:
            label = ""
        if len(name) > room:
            name = name[:max(1, room - 1)] + "…"
    left = Text(no_wrap=True, overflow="crop")
    left.append(name, "bold").append(f"  pid {snap.pid}").append(label, "dim")
    left.append(figures).append(use, "bold")
    gap = 2 if width is None else max(2, width - len(left) - len(right))
    return Text.assemble(left, " " * gap, right, no_wrap=True, overflow="crop")


SPARK_GLYPHS = " ▁▂▃▄▅▆▇█"


def sparkline(values: Iterable[float | None], width: int, style: str = BAR_STYLE) -> Text:
    """The latest ``width`` values in [0, 1] as one row of eighth blocks, on an absolute scale
    (a flat 40 % stays at 40 %), right-aligned so the newest is at the right edge. None (no
    figure for that refresh: nothing was looked up) is a blank."""
    recent = list(values)[-width:] if width > 0 else []
    glyphs = "".join(" " if v is None else SPARK_GLYPHS[max(1, round(unit(v) * 8))]
                     for v in recent)
    return Text(glyphs.rjust(max(0, width)), style, no_wrap=True)


def compact_size(size: int) -> str:
    """``4K``, ``512K``, ``2M``, ``1G``: block sizes in four characters at most."""
    for suffix, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{suffix}"
    return str(size)


def compact_count(count: int, room: int = 4) -> str:
    """``7``, ``999``, ``1.2k``, ``45k``, ``3.1M``: in at most ``room`` characters (at least
    3: ``1k``, ``12k``, ``1M``, ``9G`` when the decimal does not fit)."""
    text = str(count)
    if len(text) <= room:
        return text
    for suffix, scale in (("G", 1_000_000_000), ("M", 1_000_000), ("k", 1000)):
        if count >= scale:
            value = count / scale
            text = f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
            if len(text) > room:
                text = f"{value:.0f}{suffix}"
            if len(text) <= room or suffix == "G":
                return text
    return text


def _label_row(labels: list[str], starts: list[int], width: int, style: str = "") -> Text:
    # Each label at its column's start, skipped when it would touch the previous one.
    row = [" "] * width
    free_from = 0
    for label, start in zip(labels, starts):
        if start >= free_from and start + len(label) <= width:
            row[start:start + len(label)] = label
            free_from = start + len(label) + 1
    return Text("".join(row), style, no_wrap=True)


def order_columns(snap: Snapshot, width: int, height: int) -> Text:
    """Free buddy blocks per order as vertical bars, smallest order at the left: the counts,
    the bars (free bytes of the order, scaled to the largest), a row of block sizes. Every
    order gets a column of the same width; when a count would not fit its column, the counts
    take two rows, every other order's on each (each label then has two columns' room, and no
    count is drawn over another or left out). When the orders do not fit at 2 columns each,
    the largest ones are shown."""
    orders = snap.num_orders
    if orders == 0 or width < 2 or height < 1:
        return Text()
    column = max(2, min(6, width // orders))
    shown = list(range(orders))[-(width // column):]
    counts = [int(snap.free_blocks[k]) for k in shown]
    free_bytes = [count * snap.block_size(k) for count, k in zip(counts, shown)]
    peak = max(free_bytes) or 1
    starts = [i * column for i in range(len(shown))]
    one_row = [compact_count(n, column - 1) for n in counts]
    staggered = any(len(label) > column - 1 for label in one_row) and height >= 5
    rows = []
    if staggered:
        room = 2 * column - 1
        labels = [compact_count(n, room) for n in counts]
        for parity in (0, 1):
            rows.append(_label_row([label if i % 2 == parity else "" for i, label in
                                    enumerate(labels)], starts, width))
    elif height >= 3:
        rows.append(_label_row(one_row, starts, width))
    bar_rows = max(1, height - len(rows) - 1) if height >= 2 else 1
    for level in range(bar_rows, 0, -1):
        line = Text(no_wrap=True)
        for value in free_bytes:
            eighths = round(value / peak * bar_rows * 8)
            cell = max(0, min(8, eighths - (level - 1) * 8))
            glyph = SPARK_GLYPHS[cell] if cell else (" " if value or level > 1 else "▁")
            line.append(glyph * (column - 1) + " ", BAR_STYLE if value else "grey35")
        rows.append(line)
    rows.append(_label_row([compact_size(snap.block_size(k)) for k in shown], starts, width,
                           "dim"))
    return Text("\n").join(rows[-height:] if len(rows) > height else rows)


def class_rows(snap: Snapshot) -> list[tuple[int, int, int, int, np.ndarray]]:
    """Slab classes holding slabs: (object size, live objects, object room, slabs, mean strip
    of their slabs), smallest size first."""
    if snap.classes is None:
        return []
    rows = []
    for index, cls in enumerate(snap.classes):
        slabs = int(cls["slabs"])
        if not slabs:
            continue
        strips = (snap.slabs["strip"][snap.slabs["size_class"] == index]
                  if snap.slabs is not None else np.zeros((0, stats.STRIP_CELLS)))
        mean = (strips.astype(np.int64).mean(axis=0).astype(np.int64) if len(strips)
                else np.zeros(stats.STRIP_CELLS, np.int64))
        rows.append((int(cls["object_size"]), int(cls["live_objects"]),
                     slabs * int(cls["objects_per_slab"]), slabs, mean))
    return rows


def class_lines(snap: Snapshot, width: int) -> list[Text]:
    """One line per slab class holding slabs: object size, occupancy strip (the mean of its
    slabs'), live objects / room, and slabs. Those with live objects come first (a short panel
    shows them rather than empty slabs kept for reuse), each group smallest size first."""
    rows = sorted(class_rows(snap), key=lambda row: row[1] == 0)
    if not rows:
        return [Text("no slabs", "dim")]
    figures = [f" {live:,}/{room:,} ×{slabs}" for _, live, room, slabs, _ in rows]
    figure_width = max(len(figure) for figure in figures)
    strip_width = max(4, width - 9 - 2 - figure_width)
    lines = []
    for (size, _, _, _, mean), figure in zip(rows, figures):
        line = Text(no_wrap=True, overflow="crop")
        line.append(f"{format_size(size):>8} ")
        line.append("▕", "dim").append_text(strip(resample(mean, strip_width)))
        line.append("▏", "dim").append(figure)
        lines.append(line)
    return lines


UNTIMED_NOTE = "not timed: a pool times its calls only with trace on"


LATENCY_NAME, LATENCY_CELL = 11, 9  # "KV allocate" then three "≤16.4 µs" (38 columns in all)


def _latency_row(name: str, bounds: dict[float, int] | None) -> Text:
    line = Text(f"{name:<{LATENCY_NAME}}", "bold", no_wrap=True, overflow="crop")
    if bounds is None:
        line.append("".join(f"{'-':>{LATENCY_CELL}}" for _ in range(3)), "dim")
    else:
        for q in (0.5, 0.99, 0.999):
            line.append(f"{'≤' + format_ns(bounds[q]):>{LATENCY_CELL}}")
    return line


def latency_lines(snap: Snapshot) -> list[Text]:
    """p50/p99/p999 as the upper bounds of their log2 buckets: a KV cache's calls first (the
    kinds that were timed, of allocate, append, free, lookup, evict, other), then the pool's
    alloc and free calls. A KV cache without trace times one call in ``kv_call_sample_period``
    of each kind (the heading says "1/64"); a pool without trace reads no clock, so its
    histograms stay empty: a line says why."""
    kv_rows = []
    if snap.kv_latency is not None:
        kv_rows = [_latency_row(f"KV {kind}", snap.kv_latency_percentiles(kind))
                   for kind in stats.KV_CALL_KINDS if int(snap.kv_latency[kind].sum())]
    period = snap.kv_call_sample_period
    name = "latency" + (f" 1/{period}" if kv_rows and period and period > 1 else "")
    heading = Text(f"{name:<{LATENCY_NAME}}", "bold", no_wrap=True, overflow="crop")
    heading.append("".join(f"{q:>{LATENCY_CELL}}" for q in ("p50", "p99", "p999")), "bold")
    pool = "pool " if kv_rows else ""
    if not snap.calls_are_timed():
        pool_rows = [Text(UNTIMED_NOTE, "dim italic", no_wrap=True)]
    elif snap.latency_samples("alloc") + snap.latency_samples("free") == 0:
        pool_rows = [Text(f"{pool}no calls timed yet", "dim", no_wrap=True)]
    else:
        pool_rows = [_latency_row(f"{pool}{kind}", snap.latency_percentiles(kind))
                     for kind in ("alloc", "free")]
    if not kv_rows and not snap.calls_are_timed():
        return [Text("latency  -", "dim", no_wrap=True), *pool_rows]
    return [heading, *kv_rows, *pool_rows]


def rate(value: float) -> str:
    """Events per second in five characters at most: ``0``, ``12``, ``3.4k``."""
    if value < 10:
        return f"{value:.1f}".rstrip("0").rstrip(".") or "0"
    return compact_count(round(value), 4)


def kv_lines(snap: Snapshot, width: int, hit_history: Iterable[float | None] = (),
             evict_history: Iterable[float] = (), first_history: Iterable[float | None] = (),
             again_history: Iterable[float | None] = ()) -> list[Text]:
    """The KV cache first: its blocks by state (a bar, then its legend with the counts, with
    the same *KV use* as ``kvalloc ls`` and the header), the prefix-cache hit rate (overall,
    first admissions and re-admissions apart; per refresh in the ``*_history`` sparklines),
    evictions (overall, per second in ``evict_history``), sequences, forks and copies on write;
    or that there is none. Lines in order of importance: a short panel shows the first ones."""
    kv = snap.kv
    if kv is None:
        return [Text("no KV cache attached", "dim")]
    total = (snap.kv_blocks or (0, 0, 0))[2]
    hits = hit_lines(snap, width, hit_history, first_history, again_history)
    recent = list(evict_history)
    evict_label = Text.assemble(
        ("seqs ", "bold"), f"{int(kv['live_sequences']):,}",
        ("  forks ", "bold"), f"{int(kv['forks']):,}", ("  CoW ", "bold"), f"{int(kv['cow_copies']):,}",
        ("  evicted ", "bold"), f"{int(kv['evictions']):,}",
        ("  " + (f"{rate(recent[-1])}/s " if recent else "-/s "), ""), no_wrap=True)
    spark_room = max(0, width - len(evict_label))
    top = max(recent[-spark_room:], default=0.0) if spark_room else 0.0
    evictions = evict_label + sparkline([v / top if top else 0.0 for v in recent], spark_room,
                                        "yellow3")
    lines = [kv_bar(snap, width), kv_counts(snap, width), *hits, evictions]
    peaks = snap.kv_peaks
    if peaks is not None:
        peak_used, peak_cached, peak_bytes = peaks
        lines.append(Text.assemble(
            ("peak ", "bold"), ("used ", "bold"), f"{peak_used:,} {percent(peak_used, total)}",
            ("  cached ", "bold"), f"{peak_cached:,} {percent(peak_cached, total)}",
            ("  bytes ", "bold"), format_size(peak_bytes), (" (since start or reset)", "dim"),
            no_wrap=True, overflow="crop"))
    return lines


def op_line(record: dict[str, Any]) -> Text:
    """One trace record: wall-clock time, operation, size, offset, status (failures in red)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(record["time_ns"] / 1e9))
    millis = record["time_ns"] // 1_000_000 % 1000
    failed = record["status"] != 0
    line = Text(no_wrap=True, overflow="crop")
    line.append(f"{stamp}.{millis:03d} ", "dim")
    line.append(f"{record['op']:<12}", FAILURE_STYLE if failed else "")
    line.append(f"{format_size(record['size']) if record['size'] else '':>9} ")
    offset = record["offset"]
    line.append(f"{'-' if offset is None else f'@{offset:#x}':<12} ")
    line.append(record["status_name"], FAILURE_STYLE if failed else "green")
    return line


def recent_ops(snap: Snapshot, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` trace records, newest first (only those are read from the ring)."""
    return list(snap.trace_records(newest=max(0, limit)))[::-1]


def trace_note(snap: Snapshot) -> str | None:
    """Why the ring may hold only failures."""
    if not snap.has_trace:
        return "this writer publishes no trace ring"
    if not snap.calls_are_timed():
        return "trace off: only failed and rejected calls are recorded"
    return None


READMIT_STYLE = "spring_green2"  # the re-admissions' hit rate, beside the first admissions' cyan


def kv_pinned(snap: Snapshot) -> int | None:
    """The blocks live pins hold (part of the used ones); None from a writer before 1.5."""
    if snap.kv is None or "pinned_blocks" in snap.absent.get("kv", ()):
        return None
    return int(snap.kv["pinned_blocks"])


def kv_bar(snap: Snapshot, width: int) -> Text:
    """The KV cache's blocks as one bar: used (held by sequences and pins; the pinned ones drawn
    first in their own colour), cached (kept by the prefix cache, evictable), free."""
    blocks = snap.kv_blocks
    assert blocks is not None
    used, cached, total = blocks
    pinned = min(kv_pinned(snap) or 0, used)
    state_bar = Text(no_wrap=True, overflow="crop")
    bar_width = max(4, width)
    shares = [(pinned, PINNED_STYLE), (used - pinned, CELL_STYLES[stats.CELL_KV_USED]),
              (cached, CELL_STYLES[stats.CELL_KV_CACHED])]
    held = 0  # rounded at each boundary, so the parts add up to the rounded whole
    for count, style in shares:
        end = min(bar_width, round(bar_width * unit((held + count) / total)) if total else 0)
        state_bar.append("█" * max(0, end - len(state_bar)), style)
        held += count
    state_bar.append(FREE_GLYPH * (bar_width - len(state_bar)), CELL_STYLES[stats.CELL_FREE])
    return state_bar


def fitted(pieces: list[Text], width: int) -> Text:
    """The leading ``pieces`` that fit in ``width`` together: the first always, the others in
    order of importance as long as each fits whole (a figure is shown whole or not at all)."""
    line = Text(no_wrap=True, overflow="crop")
    for index, piece in enumerate(pieces):
        if index and len(line) + len(piece) > width:
            break
        line.append_text(piece)
    return line


def kv_counts(snap: Snapshot, width: int) -> Text:
    """The bar's legend: used (and of them pinned), cached, free and total blocks, each in its
    bar's colour; the blocks' size last, when it fits."""
    kv = snap.kv
    assert kv is not None
    used, cached, total = snap.kv_blocks or (0, 0, 0)
    used_share, cached_share = snap.kv_use or (0.0, 0.0)
    pinned = kv_pinned(snap)
    pieces = [Text.assemble(("used ", "bold"),
                            (f"{used:,} {used_share:.1%}", CELL_STYLES[stats.CELL_KV_USED]))]
    if pinned is not None:
        pieces.append(Text.assemble(("  pinned ", "bold"), (f"{pinned:,}", PINNED_STYLE)))
    pieces += [Text.assemble(("  cached ", "bold"),
                             (f"{cached:,} {cached_share:.1%}", CELL_STYLES[stats.CELL_KV_CACHED])),
               Text.assemble(("  free ", "bold"), f"{int(kv['free_blocks']):,}",
                             f"  of {total:,}"),
               Text(f" × {int(kv['block_tokens'])} tok, {format_size(int(kv['block_bytes']))}",
                    "dim")]
    return fitted(pieces, width)


READMIT_NONE = "none yet"  # the re-admission rate's dash: no request was admitted again


def hit_lines(snap: Snapshot, width: int, overall: Iterable[float | None] = (),
              first: Iterable[float | None] = (), again: Iterable[float | None] = ()
              ) -> list[Text]:
    """The prefix-cache hit rate: overall, then first admissions and re-admissions apart, each
    with its sparkline (per refresh). In one line when each sparkline still gets 8 cells, else
    in two; a re-admission rate without any re-admission is a dash and says why. A writer before
    1.5 does not tell them apart: the overall rate and its sparkline."""
    kv = snap.kv
    assert kv is not None
    cached = CELL_STYLES[stats.CELL_KV_CACHED]
    hit = snap.hit_rate
    label = Text.assemble(("hit ", "bold"), f"{'-' if hit is None else f'{hit:.1%}':>6}",
                          (f" of {compact_count(int(kv['query_tokens']), 5)} tok ", "dim"),
                          no_wrap=True)
    rates = snap.hit_rates
    if rates is None:
        return [label + sparkline(list(overall), max(0, width - len(label)), cached)]

    def part(name: str, rate: float | None, history: Iterable[float | None], room: int,
             style: str, why: str) -> Text:
        # ``room`` cells in all, the last a space: the next part never touches this one.
        head = Text.assemble((name, "bold"), f" {'-' if rate is None else f'{rate:.1%}':>6} ",
                             no_wrap=True)
        inner = max(0, room - len(head) - 1)
        if rate is None and why:
            return head + Text(why[:inner].ljust(inner), "dim") + " "
        return head + sparkline(list(history), inner, style) + " "

    first_rate, again_rate = rates
    again_why = READMIT_NONE if int(kv["readmit_query_tokens"]) == 0 else ""
    first_why = "nothing looked up yet" if first_rate is None else ""
    parts = len(label) + 2 * len("readmit  100.0% ")
    if width - parts >= 16:  # one line: two sparklines of 8 cells at least
        room = (width - len(label)) // 2
        return [label + part("first", first_rate, first, room, cached, first_why)
                + part("readmit", again_rate, again, width - len(label) - room, READMIT_STYLE,
                       again_why)]
    return [label + part("first", first_rate, first, width - len(label), cached, first_why),
            Text(" " * len(label), no_wrap=True)
            + part("readmit", again_rate, again, width - len(label), READMIT_STYLE, again_why)]


def format_handle(handle: int) -> str:
    """A sequence's or pin's handle as Python's repr of it shows it (``0x300000005``)."""
    return f"{handle:#x}"


def format_namespace(namespace: int | None, room: int = 20) -> str:
    """A namespace id in at most ``room`` characters: decimal when short, hex when long (a
    hash), its middle cut with "…" beyond, so that ids differing at either end (a tenant in the
    high bits, an adapter in the low ones) keep distinct labels; None is the row that pools the
    untracked namespaces."""
    if namespace is None:
        return "other"
    text = str(namespace) if namespace < 10**6 else f"{namespace:#x}"
    if len(text) <= room:
        return text
    tail = max(0, room - 1) // 2
    return text[:max(0, room - 1 - tail)] + "…" + (text[-tail:] if tail else "")


def block_runs(table: np.ndarray) -> list[tuple[int, int]]:
    """Block ids as runs of consecutive ids, in table order: [17..40, 3..3, 99..101]."""
    ids = np.asarray(table, np.int64)
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(ids)]]) - 1
    return list(zip(ids[starts].tolist(), ids[ends].tolist()))


def block_table_lines(entry: KvSequenceEntry, width: int, height: int = 1) -> list[str]:
    """A sequence's block table as runs (``17-40 3 99-101``) in up to ``height`` lines of
    ``width``; what does not fit is cut with "…" and the count of the ids left out (``… +95``),
    and a table the segment holds only the start of says so (``(first 128 of 900)``)."""
    if entry.blocks == 0:
        return ["no blocks"]
    note = "" if entry.table_complete else f" (first {len(entry.table):,} of {entry.blocks:,})"
    if len(entry.table) == 0:
        return [f"table not published ({entry.blocks:,} blocks)"[:max(0, width)]]
    tokens = [(str(a) if a == b else f"{a}-{b}", b - a + 1) for a, b in block_runs(entry.table)]
    published = len(entry.table)
    # rest[i]: the width of tokens[i:] joined by spaces.
    rest = [0] * (len(tokens) + 1)
    for i in range(len(tokens) - 1, -1, -1):
        rest[i] = len(tokens[i][0]) + (rest[i + 1] + 1 if i + 1 < len(tokens) else 0)
    lines: list[str] = []
    line, drawn, index = "", 0, 0
    while index < len(tokens):
        token, count = tokens[index]
        final = index == len(tokens) - 1
        last_line = len(lines) >= max(1, height) - 1
        added = (" " if line else "") + token
        if last_line and len(line) + (1 if line else 0) + rest[index] + len(note) <= width:
            # All that is left fits.
            return [*lines, " ".join([line] * bool(line) + [t for t, _ in tokens[index:]]) + note]
        reserve = len(note) if final else (
            len(f" … +{published - drawn - count:,}{note}") if last_line else 0)
        if len(line) + len(added) + reserve <= width or (not line and not last_line):
            line, drawn, index = line + added, drawn + count, index + 1
        elif not last_line:
            lines.append(line)
            line = ""
        else:
            line += f"{' ' if line else ''}… +{published - drawn:,}{note}"
            return [*lines, line[:max(0, width)]]
    return [*lines, (line + note)[:max(0, width)]]


def sequence_heading(handle_width: int = 12) -> str:
    """The sequences' column heading, the handles' column ``handle_width`` wide."""
    return f" {'handle':<{handle_width}}{'tokens':>9}{'blocks':>8}{'cached':>9}  {'namespace':<12}"


SEQUENCE_HEADING = sequence_heading()


def _figure(count: int, room: int) -> str:
    """A count with thousands separators, or compacted (``4.3G``, ``14M``) beyond ``room``
    characters: a column's figures never run into the next one."""
    text = f"{count:,}"
    return text if len(text) <= room else compact_count(count, room)


def selected_entry(snap: Snapshot, handle: int | None) -> KvSequenceEntry | None:
    """The entry of the sequence or pin ``handle`` (the longest one when None or gone)."""
    entries = snap.kv_sequences.entries if snap.kv_sequences is not None else []
    return next((e for e in entries if e.handle == handle), entries[0] if entries else None)


def sequences_summary(snap: Snapshot) -> Text:
    """Live sequences and pins, and the longest sequence (tokens, blocks, handle). The count of
    sequences is the KV section's, as fresh as the other figures on screen; the writer lists
    the longest (and counts pins) at its full publishes, at most a second apart."""
    sequences = snap.kv_sequences
    assert sequences is not None and snap.kv is not None
    live = int(snap.kv["live_sequences"])
    line = Text.assemble(("live ", "bold"), f"{live:,}", ("  pins ", "bold"),
                         f"{sequences.pins:,}", no_wrap=True, overflow="crop")
    if sequences.longest_tokens:
        longest = next((e for e in sequences.entries if e.handle == sequences.longest_handle),
                       None)
        # Pins longer than every sequence may fill the list; a sequence's blocks follow from
        # its tokens (each block full but its last).
        block_tokens = int(snap.kv["block_tokens"])
        blocks = (f"{longest.blocks:,}" if longest is not None else
                  f"{-(-sequences.longest_tokens // block_tokens):,}" if block_tokens else "?")
        line.append("  longest ", "bold").append(
            f"{sequences.longest_tokens:,} tok, {blocks} blocks ").append(
            format_handle(sequences.longest_handle), "dim")
    return line


def sequence_row(entry: KvSequenceEntry, selected: bool, handle_width: int = 12) -> Text:
    """A sequence's row under ``sequence_heading(handle_width)``: each figure whole when it
    fits its column with a space before it, else compacted."""
    namespace = format_namespace(entry.namespace, 12)
    row = Text(f"{'▸' if selected else ' '}{format_handle(entry.handle):<{handle_width}}"
               f"{_figure(entry.num_tokens, 8):>9}{_figure(entry.blocks, 7):>8}"
               f"{_figure(entry.cached_tokens, 8):>9}  "
               f"{namespace:<12}", "reverse" if selected else "", no_wrap=True, overflow="crop")
    if entry.pin:
        row.append(" pin", PINNED_STYLE)
    return row


def sequence_lines(snap: Snapshot, width: int, height: int, handle: int | None) -> list[Text]:
    """The sequences panel: the summary, the longest sequences and pins (longest first) with
    the selected one (``handle``, else the longest) marked, and its block table as runs in the
    lines left. Rows scroll to keep the selected one in view."""
    sequences = snap.kv_sequences
    if sequences is None:
        return [Text("this writer publishes no sequences (layout 1.5 on)", "dim")]
    lines = [sequences_summary(snap)]
    if not sequences.entries:
        return [*lines, Text("no live sequences or pins", "dim")]
    chosen = selected_entry(snap, handle)
    assert chosen is not None
    # The table gets up to three lines once four rows fit, and the lines no row needs.
    table_height = max(1, min(3, height - 2 - 4))
    room = max(1, height - 2 - table_height)
    if room > len(sequences.entries):
        table_height += room - len(sequences.entries)
        room = len(sequences.entries)
    at = sequences.entries.index(chosen)
    first = max(0, min(at - room + 1, len(sequences.entries) - room)) if at >= room else 0
    shown = sequences.entries[first:first + room]
    # The handles' column fits the widest shown (a slot reused often has a long handle).
    handle_width = max(12, *(len(format_handle(entry.handle)) + 1 for entry in shown))
    lines.append(Text(sequence_heading(handle_width), "bold", no_wrap=True, overflow="crop"))
    lines += [sequence_row(entry, entry is chosen, handle_width) for entry in shown]
    label = f"blocks of {format_handle(chosen.handle)}: "
    table = block_table_lines(chosen, max(8, width - len(label)), table_height)
    lines.append(Text.assemble((label, "bold"), table[0], no_wrap=True, overflow="crop"))
    lines += [Text(" " * len(label) + more, no_wrap=True, overflow="crop") for more in table[1:]]
    return lines


def share_text(share: float) -> str:
    """A namespace's share in at most 5 characters (``45.2%``, ``100%``, ``2271%``, ``23k%``):
    blocks are counted per table, so a share passes 100% where tables share blocks (forks)."""
    text = f"{share:.1%}"
    return text if len(text) <= 5 else f"{compact_count(round(share * 100), 4)}%"


NAMESPACE_HEADING = f"{'namespace':<10}{'seqs':>5}{'pins':>5}{'blocks':>7}{'share':>6}{'reg':>5}"


def namespace_lines(snap: Snapshot, width: int, height: int) -> list[Text]:
    """Each namespace's share of the cache's blocks: its live sequences and pins, the blocks
    their tables hold (a block in two tables counts in both) and that share of all blocks, and
    the blocks it registered in the prefix table; most blocks first, the "other" row (every
    namespace past the tracked ones) last, kept when the rows are cut to the height. A bar of
    the share when the width allows."""
    rows = snap.kv_namespaces
    if rows is None:
        return [Text("this writer publishes no namespaces (layout 1.5 on)", "dim")]
    if not rows:
        return [Text("no namespace holds blocks", "dim")]
    total = (snap.kv_blocks or (0, 0, 0))[2]
    ordered = sorted(rows, key=lambda r: (r.namespace is None, -r.blocks))
    bar_width = width - len(NAMESPACE_HEADING) - 2 if width >= len(NAMESPACE_HEADING) + 12 else 0
    room = max(1, height - 1)
    shown, left = ordered, []
    if len(ordered) > room:
        # Cut: the other row stays (often the most blocks of all), after the tracked rows
        # that fit with it and the line counting those left out.
        other = [row for row in ordered if row.namespace is None]
        tracked = [row for row in ordered if row.namespace is not None]
        keep = room - 1 - len(other)
        if keep < 0:
            other, keep = [], room - 1
        shown, left = tracked[:keep] + other, tracked[keep:]
    lines = [Text(NAMESPACE_HEADING, "bold", no_wrap=True, overflow="crop")]
    for row in shown:
        share = row.blocks / total if total else 0.0
        line = Text(f"{format_namespace(row.namespace, 9):<10}{compact_count(row.sequences, 4):>5}"
                    f"{compact_count(row.pins, 4):>5}{compact_count(row.blocks, 6):>7}"
                    f"{share_text(share):>6}{compact_count(row.registered_blocks, 4):>5}",
                    "dim" if row.namespace is None else "", no_wrap=True, overflow="crop")
        if bar_width:
            line.append("  ").append_text(bar(share, bar_width, CELL_STYLES[stats.CELL_KV_USED]))
        lines.append(line)
    if left:
        lines.append(Text(f"… {len(left)} more, {sum(r.blocks for r in left):,} blocks", "dim",
                          no_wrap=True))
    return lines
