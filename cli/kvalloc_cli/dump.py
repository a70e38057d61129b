"""``kvalloc dump PID|NAME``: one snapshot of a live pool, for scripts and bug reports.

The pool is found by pid, pool name or segment file (``kvalloc ls`` lists them) and read through
its statistics segment, so the engine is neither stopped nor signalled. The tables show a KV
cache first (its blocks, pinned ones included, the hit rates of first admissions and
re-admissions, the longest sequences with their block tables, each namespace's share, its call
latencies), then the summary, the free blocks per buddy order with the kernel's
unusable-free-space index, the heap map in coloured cells, the slab classes in use and call
latency; ``--trace`` adds the ring of recent operations. ``--json`` prints every figure as JSON
instead, ``-o FILE`` writes that JSON to FILE.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvalloc_tui import render

from pykvalloc.pool import PageKind
from pykvalloc.sizes import format_size
from pykvalloc import stats
from pykvalloc.stats import Snapshot, format_age, open_segment, process_name

from .arguments import add_command
from .output import add_report_options, emit_json, wants_table

HEAP_MAP_ROWS = 8  # at most; a small pool fills fewer
BAR_WIDTH = 20
STRIP_WIDTH = 24


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "dump", "print one snapshot of a live pool's statistics", __doc__)
    parser.add_argument("target", metavar="PID|NAME",
                        help="the writer's pid, the pool name, or the segment file")
    add_report_options(parser, "every figure")
    parser.add_argument("--trace", action="store_true",
                        help="also print the ring of recent operations")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with open_segment(args.target) as segment:
        snap = segment.snapshot()
    process = process_name(snap.pid)
    if wants_table(args):
        _print_tables(snap, process, args.trace)
    emit_json(args, {"process": process, **snap.to_dict(trace=args.trace)})
    return 0


def _print_tables(snap: Snapshot, process: str | None, trace: bool) -> None:
    console = Console(highlight=False)
    console.print(render.header_line(snap, process, render.writer_state(snap), console.width))
    console.print(Text(f"{snap.path}  layout {snap.abi[0]}.{snap.abi[1]}  publish "
                       f"#{snap.publish_count:,}, {format_age(snap.heartbeat_age())} ago  "
                       f"sequence {snap.sequence:,}", "dim"))
    if snap.kv is not None:
        console.print(_kv_table(snap, console.width))  # a pool holding a KV cache: that first
        for part in _kv_sequences(snap, console.width):
            console.print(part)
        console.print(_kv_namespaces_table(snap))
        console.print(_kv_latency_table(snap))
    console.print(_summary_table(snap))
    console.print(_orders_table(snap))
    console.print(_heap_map(snap, console.width))
    console.print(_classes_table(snap))
    console.print(_latency_table(snap))
    if snap.kv is None:
        console.print(_kv_table(snap, console.width))
    if trace:
        console.print(_trace_table(snap))


def _summary_table(snap: Snapshot) -> Table:
    table = Table(title="Pool statistics", title_justify="left",
                  caption="peaks: since the pool's creation or its last reset_peaks()"
                  if snap.pool_peaks is not None else None, caption_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("of capacity", justify="right")
    s = snap.summary
    capacity = snap.capacity
    try:
        backing = PageKind(int(s["page_kind"])).label
    except ValueError:  # a kind newer than this package
        backing = f"page kind {int(s['page_kind'])}"

    def share(name: str) -> tuple[str, str]:
        return format_size(int(s[name])), render.percent(int(s[name]), capacity)

    for row in (
        ("backing", f"{backing}, {format_size(int(s['page_size']))} pages", ""),
        ("capacity", format_size(capacity), ""),
        ("in use (usable bytes)", *share("bytes_in_use")),
        *_pool_peak_rows(snap, capacity),
        ("free buddy blocks", *share("bytes_free")),
        ("held by slabs", *share("slab_bytes")),
        ("  free inside slabs", format_size(int(s["slab_free_bytes"])), ""),
        ("largest free block", format_size(int(s["largest_free"])), ""),
        ("fragmentation", f"{snap.fragmentation:.1%}", ""),
        ("live allocations", f"{int(s['live_allocations']):,}", ""),
        ("allocations / frees", f"{int(s['alloc_count']):,} / {int(s['free_count']):,}", ""),
        ("failed / rejected calls",
         f"{int(s['alloc_failures']):,} / {int(s['rejected_calls']):,}", ""),
        ("live slabs", f"{int(s['slab_count']):,}", ""),
        ("host metadata", format_size(int(s["metadata_bytes"])), ""),
    ):
        table.add_row(*row)
    return table


def _pool_peak_rows(snap: Snapshot, capacity: int) -> list[tuple[str, str, str]]:
    peaks = snap.pool_peaks
    if peaks is None:
        return []  # a writer before layout 1.4
    blocks, in_use = peaks
    return [("  peak", format_size(in_use), render.percent(in_use, capacity)),
            ("peak in buddy blocks", format_size(blocks), render.percent(blocks, capacity))]


def _kv_latency_table(snap: Snapshot) -> Table | Text:
    if snap.kv_latency is None:
        return Text("This writer publishes no KV call latencies (layout 1.4 on).", "dim")
    period = snap.kv_call_sample_period
    table = Table(title="KV call latency (upper bounds of log2 buckets)", title_justify="left",
                  min_width=60)
    for name in ("call", "timed", "p50", "p99", "p999"):
        table.add_column(name, justify="right")
    assert snap.kv is not None
    for index, kind in enumerate(stats.KV_CALL_KINDS):
        bounds = snap.kv_latency_percentiles(kind)
        cells = (["-"] * 3 if bounds is None else
                 [f"≤{render.format_ns(bounds[q])}" for q in (0.5, 0.99, 0.999)])
        table.add_row(kind, f"{int(snap.kv['call_timed'][index]):,}", *cells)
    if period and period > 1:
        table.caption = f"a sample: about one call in {period} of each kind is timed (trace on times all)"
        table.caption_justify = "left"
    return table


def _orders_table(snap: Snapshot) -> Table:
    table = Table(title="Free buddy blocks per order (unusable: the kernel's unusable free space "
                        "index)", title_justify="left")
    for name in ("order", "block", "free blocks", "free bytes", "unusable"):
        table.add_column(name, justify="right")
    table.add_column("share of free bytes", no_wrap=True, min_width=BAR_WIDTH)
    free = int(snap.summary["bytes_free"])
    for order in range(snap.num_orders):
        count, size = int(snap.free_blocks[order]), snap.block_size(order)
        table.add_row(str(order), format_size(size), f"{count:,}",
                      format_size(count * size) if count else "-",
                      f"{float(snap.unusable_index[order]):.3f}",
                      render.bar(count * size / free if free else 0.0, BAR_WIDTH))
    return table


def _heap_map(snap: Snapshot, width: int) -> Panel | Text:
    if snap.cell_state is None:
        return Text("this writer publishes no heap map", "dim")
    columns = max(8, width - 4)
    rows = max(1, min(HEAP_MAP_ROWS, math.ceil(len(snap.cell_state) / columns)))
    shown = min(columns * rows, len(snap.cell_state))
    return Panel(render.heap_map(snap, columns, rows), title="heap map", title_align="left",
                 subtitle=render.heap_legend(snap, shown), subtitle_align="left", expand=False)


def _classes_table(snap: Snapshot) -> Table | Text:
    rows = render.class_rows(snap)
    if not rows:
        return Text("No slabs.", "dim")
    table = Table(title="Slab size classes in use", title_justify="left")
    for name in ("object size", "live objects", "room", "slabs"):
        table.add_column(name, justify="right")
    table.add_column("occupancy (mean of its slabs)", no_wrap=True, min_width=STRIP_WIDTH + 2)
    for size, live, room, slabs, mean in rows:
        table.add_row(format_size(size), f"{live:,}", f"{room:,}", f"{slabs:,}",
                      Text.assemble(("▕", "dim"),
                                    render.strip(render.resample(mean, STRIP_WIDTH)),
                                    ("▏", "dim")))
    return table


def _latency_table(snap: Snapshot) -> Table | Text:
    if snap.latency is None:
        return Text("This writer publishes no latency histograms.", "dim")
    table = Table(title="Call latency (upper bounds of log2 buckets)", title_justify="left",
                  min_width=60)
    for name in ("call", "samples", "p50", "p99", "p999"):
        table.add_column(name, justify="right")
    for kind in ("alloc", "free"):
        bounds = snap.latency_percentiles(kind)
        cells = (["-"] * 3 if bounds is None else
                 [f"≤{render.format_ns(bounds[q])}" for q in (0.5, 0.99, 0.999)])
        table.add_row(kind, f"{snap.latency_samples(kind):,}", *cells)
    if not snap.calls_are_timed():
        table.caption = render.UNTIMED_NOTE
        table.caption_justify = "left"
    return table


def _kv_table(snap: Snapshot, width: int) -> Table | Text:
    if snap.kv is None:
        return Text("KV cache: no KV cache attached", "dim")
    table = Table(title="KV cache", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    kv = snap.kv
    hit = snap.hit_rate
    table.add_row("blocks: " + ("pinned, " if render.kv_pinned(snap) is not None else "")
                  + "used, cached, free", render.kv_bar(snap, min(40, max(8, width - 42))))
    if snap.kv_peaks is not None:
        table.caption = "peaks: since the cache's creation or its last reset_peaks()"
        table.caption_justify = "left"
    for label, value in (
        ("use", snap.use_label),
        ("blocks", f"{int(kv['total_blocks']):,} × {int(kv['block_tokens'])} tokens, "
                   f"{format_size(int(kv['block_bytes']))} each"),
        ("used / cached / free", f"{int(kv['used_blocks']):,} / {int(kv['cached_blocks']):,} / "
                                 f"{int(kv['free_blocks']):,}"),
        *_kv_pinned_rows(snap),
        ("prefix hit rate", "-" if hit is None else
         f"{hit:.1%} ({int(kv['hit_tokens']):,} of {int(kv['query_tokens']):,} tokens)"),
        *_kv_hit_rows(snap),
        *_kv_peak_rows(snap),
        ("live sequences", f"{int(kv['live_sequences']):,}"),
        ("evictions", f"{int(kv['evictions']):,}"),
        ("forks / copies on write", f"{int(kv['forks']):,} / {int(kv['cow_copies']):,}"),
    ):
        table.add_row(label, value)
    return table


def _kv_pinned_rows(snap: Snapshot) -> list[tuple[str, str]]:
    pinned = render.kv_pinned(snap)
    if pinned is None:
        return []  # a writer before layout 1.5
    return [("  of them pinned", f"{pinned:,}")]


def _kv_hit_rows(snap: Snapshot) -> list[tuple[str, str]]:
    """The hit rates of first admissions and of re-admissions apart (layout 1.5 on), each a
    dash with its reason when nothing of its kind was looked up."""
    rates = snap.hit_rates
    if rates is None or snap.kv is None:
        return []
    kv = snap.kv
    again_hit, again_query = int(kv["readmit_hit_tokens"]), int(kv["readmit_query_tokens"])
    first_hit = int(kv["hit_tokens"]) - again_hit
    first_query = int(kv["query_tokens"]) - again_query
    first, again = rates
    return [("  first admissions", "- (nothing looked up yet)" if first is None else
             f"{first:.1%} ({first_hit:,} of {first_query:,} tokens)"),
            ("  re-admissions", f"- ({render.READMIT_NONE})" if again is None else
             f"{again:.1%} ({again_hit:,} of {again_query:,} tokens)")]


def _kv_sequences(snap: Snapshot, width: int) -> list[Table | Text]:
    """The longest live sequences and pins, longest first, then each one's block table as runs
    (up to three lines; see render.block_table_lines)."""
    sequences = snap.kv_sequences
    if sequences is None:
        return [Text("This writer publishes no KV sequences (layout 1.5 on).", "dim")]
    table = Table(title="KV sequences (the longest, longest first)", title_justify="left",
                  caption=render.sequences_summary(snap).plain, caption_justify="left")
    for name in ("handle", "tokens", "blocks", "cached", "namespace", "pin"):
        table.add_column(name, justify="left" if name in ("handle", "namespace") else "right")
    for entry in sequences.entries:
        table.add_row(render.format_handle(entry.handle), f"{entry.num_tokens:,}",
                      f"{entry.blocks:,}", f"{entry.cached_tokens:,}",
                      render.format_namespace(entry.namespace), "pin" if entry.pin else "")
    if not sequences.entries:
        return [table, Text("No live sequences or pins.", "dim")]
    tables = Text(no_wrap=True, overflow="crop")
    for entry in sequences.entries:
        label = f"blocks of {render.format_handle(entry.handle)}: "
        runs = render.block_table_lines(entry, max(16, width - len(label)), 3)
        for index, line in enumerate(runs):
            if len(tables):
                tables.append("\n")
            tables.append(label if index == 0 else " " * len(label), "bold" if index == 0 else "")
            tables.append(line)
    return [table, tables]


def _kv_namespaces_table(snap: Snapshot) -> Table | Text:
    rows = snap.kv_namespaces
    if rows is None:
        return Text("This writer publishes no KV namespaces (layout 1.5 on).", "dim")
    if not rows:
        return Text("KV namespaces: no namespace holds blocks.", "dim")
    total = (snap.kv_blocks or (0, 0, 0))[2]
    table = Table(title="KV namespaces (share: blocks their tables hold, of all blocks)",
                  title_justify="left", caption="registered: blocks it keyed in the prefix "
                  "table; other: every namespace past the tracked ones", caption_justify="left")
    for name in ("namespace", "sequences", "pins", "blocks", "share", "registered"):
        table.add_column(name, justify="left" if name == "namespace" else "right")
    for row in sorted(rows, key=lambda r: (r.namespace is None, -r.blocks)):
        table.add_row(render.format_namespace(row.namespace), f"{row.sequences:,}",
                      f"{row.pins:,}", f"{row.blocks:,}", render.percent(row.blocks, total),
                      f"{row.registered_blocks:,}")
    return table


def _kv_peak_rows(snap: Snapshot) -> list[tuple[str, str]]:
    peaks = snap.kv_peaks
    blocks = snap.kv_blocks
    if peaks is None or blocks is None:
        return []  # a writer before layout 1.4
    used, cached, in_use = peaks
    total = blocks[2]
    return [("peak used / cached",
             f"{used:,} ({render.percent(used, total)}) / {cached:,} ({render.percent(cached, total)})"),
            ("peak bytes in use", format_size(in_use))]


def _trace_table(snap: Snapshot) -> Table:
    table = Table(title=f"Recent operations ({snap.trace_written:,} recorded, oldest first)",
                  title_justify="left")
    for name, justify in (("time", "left"), ("thread", "right"), ("call", "left"),
                          ("size", "right"), ("offset", "right"), ("status", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for record in snap.trace_records():
        failed = record["status"] != 0
        stamp = time.strftime("%H:%M:%S", time.localtime(record["time_ns"] / 1e9))
        table.add_row(
            f"{stamp}.{record['time_ns'] // 1000 % 1_000_000:06d}", str(record["thread"]),
            record["op"], format_size(record["size"]) if record["size"] else "",
            "-" if record["offset"] is None else f"{record['offset']:#x}",
            Text(record["status_name"], render.FAILURE_STYLE if failed else "green"),
            style=render.FAILURE_STYLE if failed else None)
    note = render.trace_note(snap)
    if note:
        table.caption = note
    return table
