"""``kvalloc demo``: fill a fresh pool with a KV-cache-like mix and show what it looks like.

The mix imitates what an inference engine keeps: many tiny per-token metadata records, fixed
4 KiB KV pages, a few prefill buffers and two large per-layer KV regions whose size is not a
power of two (allocated exactly, without rounding up). Part of some is freed again, as finished
sequences would be, so the tables show a partly used, partly fragmented pool. Every count
scales with --capacity; it runs headless in well under a second.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ..pool import Allocation, PageMode, Pool, Stats
from ..sizes import format_size, parse_size

MIN_CAPACITY = 16 << 20  # the smallest pool that still holds one slab of each kind and the blocks
POOL_NAME = "kvalloc-demo"


@dataclass(frozen=True)
class Batch:
    """``count`` allocations of ``size`` bytes; every ``free_every``-th is freed again."""

    label: str
    size: int
    count: int
    free_every: int  # 0: none are freed
    exact: bool = False  # Pool.alloc_exact: rounded to min_block, not to a power of two


def workload(capacity: int) -> list[Batch]:
    """The mix for a pool of ``capacity`` bytes; it allocates about half of it."""
    return [
        Batch("token metadata", 64, capacity // (16 << 10), free_every=2),
        Batch("KV pages", 4 << 10, capacity // (32 << 10), free_every=3),
        Batch("prefill buffers", capacity // 64, 8, free_every=3),
        Batch("KV layers, exact", capacity * 3 // 32, 2, free_every=0, exact=True),
    ]


def _capacity(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < MIN_CAPACITY:
        raise argparse.ArgumentTypeError(f"the demo needs at least {format_size(MIN_CAPACITY)}")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="allocate a KV-cache-like mix in a fresh pool and print its statistics",
        description=__doc__.split("\n\n", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=_capacity, default=64 << 20, metavar="SIZE",
                        help="bytes in the pool, e.g. 64M or 1G (default 64M)")
    parser.add_argument("--pages", choices=[mode.name.lower() for mode in PageMode],
                        default="auto",
                        help="how the pool is backed (default auto: the best the machine has)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    batches = workload(args.capacity)
    with Pool(args.capacity, name=POOL_NAME, pages=args.pages) as pool:
        kept = _allocate_and_free(pool, batches)
        console.print(_describe(batches))
        console.print(_numpy_round_trip(pool, kept))
        pool.check()
        console.print("kva_check: every invariant holds\n")
        stats = pool.stats()
        console.print(_summary_table(stats))
        console.print(_orders_table(stats))
        console.print(_classes_table(pool))
    return 0


def _allocate_and_free(pool: Pool, batches: list[Batch]) -> list[Allocation]:
    kept: list[Allocation] = []
    for batch in batches:
        for index in range(batch.count):
            allocation = pool.alloc_exact(batch.size) if batch.exact else pool.alloc(batch.size)
            if batch.free_every and index % batch.free_every == 0:
                pool.free(allocation)
            else:
                kept.append(allocation)
    return kept


def _describe(batches: list[Batch]) -> str:
    parts = []
    for batch in batches:
        freed = (batch.count + batch.free_every - 1) // batch.free_every if batch.free_every else 0
        parts.append(f"  {batch.count:>7,} x {format_size(batch.size):>8}  {batch.label:<18} "
                     f"{freed:>6,} freed again")
    return f"Pool {POOL_NAME!r}: allocated\n" + "\n".join(parts)


def _numpy_round_trip(pool: Pool, kept: list[Allocation]) -> str:
    # Write through one view and read through a second, independent one: both must see the
    # same pool memory.
    page = next(allocation for allocation in kept if allocation.size == 4 << 10)
    writer = page.view(np.int32)
    writer[:] = np.arange(writer.size, dtype=np.int32)
    reader = page.view(np.int32, shape=(writer.size // 32, 32))
    ok = bool((reader.ravel() == np.arange(writer.size)).all())
    return (f"numpy: {writer.size:,} int32 written through one view, read back through "
            f"another: {'ok' if ok else 'MISMATCH'}")


def _percent(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _summary_table(stats: Stats) -> Table:
    table = Table(title="Pool statistics", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("of capacity", justify="right")
    rows = [
        ("backing", f"{stats.page_kind.label}, {format_size(stats.page_size)} pages", ""),
        ("capacity", format_size(stats.capacity), ""),
        ("in use (usable bytes)", format_size(stats.bytes_in_use),
         _percent(stats.bytes_in_use, stats.capacity)),
        ("free buddy blocks", format_size(stats.bytes_free),
         _percent(stats.bytes_free, stats.capacity)),
        ("held by slabs", format_size(stats.slab_bytes),
         _percent(stats.slab_bytes, stats.capacity)),
        ("  free inside slabs", format_size(stats.slab_free_bytes), ""),
        ("largest free block", format_size(stats.largest_free), ""),
        ("fragmentation", f"{stats.fragmentation:.1%}", ""),
        ("live allocations", f"{stats.live_allocations:,}", ""),
        ("allocations / frees", f"{stats.alloc_count:,} / {stats.free_count:,}", ""),
        ("live slabs", f"{stats.slab_count:,}", ""),
        ("host metadata", format_size(stats.metadata_bytes), ""),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _orders_table(stats: Stats) -> Table:
    table = Table(title="Free buddy blocks per order", title_justify="left")
    for name in ("order", "block size", "free blocks", "free bytes"):
        table.add_column(name, justify="right")
    for order, count in enumerate(stats.free_blocks):
        size = stats.block_size(order)
        table.add_row(str(order), format_size(size), f"{count:,}",
                      format_size(count * size) if count else "-")
    return table


def _classes_table(pool: Pool) -> Table:
    table = Table(title="Slab size classes in use", title_justify="left")
    for name in ("object size", "live objects", "slabs", "objects per slab"):
        table.add_column(name, justify="right")
    for cls in pool.class_stats():
        if cls.slabs:
            table.add_row(format_size(cls.object_size), f"{cls.live_objects:,}", f"{cls.slabs:,}",
                          f"{cls.objects_per_slab:,}")
    return table
