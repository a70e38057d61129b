"""Figures derived from a snapshot for people: latency percentiles from the log2 histograms, the
heap map fitted to a width, ages in words."""

from __future__ import annotations

import math

import numpy as np

from .layout import CELL_FREE, CELL_MIXED, CELL_NAMES, CELL_TIE_ORDER

def latency_percentiles(buckets: np.ndarray, quantiles: tuple[float, ...] = (0.5, 0.99, 0.999)
                        ) -> dict[float, int] | None:
    """For each quantile, the upper bound in ns (``2**(i+1)``) of the log2 bucket ``i`` that
    holds it; None when the histogram is empty."""
    counts = np.asarray(buckets, dtype=np.uint64)
    total = int(counts.sum())
    if total == 0:
        return None
    cumulative = np.cumsum(counts)
    bounds = {}
    for q in quantiles:
        rank = max(1, math.ceil(q * total))
        bucket = int(np.searchsorted(cumulative, rank, side="left"))
        bounds[q] = 1 << (bucket + 1)
    return bounds


def kv_shares(used_blocks: int, cached_blocks: int, total_blocks: int) -> tuple[float, float]:
    """(used, cached) shares of a KV cache's blocks. *KV use* is the share of blocks that
    sequences hold; the blocks the prefix cache keeps (evictable, handed out again on demand)
    are told apart, never added to it. The pool counts the whole KV region as one allocation,
    always 100 % in use, so its bytes in use say nothing of the cache's. The replay report's
    *KV use* is the same share."""
    if total_blocks <= 0:
        return 0.0, 0.0
    return used_blocks / total_blocks, cached_blocks / total_blocks


def use_label(bytes_in_use: int, capacity: int, kv_blocks: tuple[int, int, int] | None) -> str:
    """What ``kvalloc ls``, ``top`` and ``dump`` show as a pool's use: ``KV 75.7% +24.3%
    cached`` for a pool holding a KV cache (``kv_blocks``: used, cached, total; see
    ``kv_shares``), else its bytes in use over capacity, ``12.5%``."""
    if kv_blocks is not None and kv_blocks[2] > 0:
        used, cached = kv_shares(*kv_blocks)
        return f"KV {used:.1%} +{cached:.1%} cached"
    return f"{bytes_in_use / capacity:.1%}" if capacity else "-"


def downsample_cells(state: np.ndarray, fill: np.ndarray, count: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Fits heap-map cells into ``count`` cells (at most as many as there are): each output
    cell takes the most common non-free state among its inputs (free only if all are free, so
    a small live block stays visible; a tie goes to the earlier state in ``CELL_TIE_ORDER``,
    so pinned before used before cached, as the writer paints) and their mean fill. A state
    this reader does not know (a newer writer's) counts as mixed, here and when drawn."""
    cells = len(state)
    if count <= 0 or cells == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    if count >= cells:
        return np.asarray(state, np.uint8), np.asarray(fill, np.uint8)
    edges = (np.arange(count + 1, dtype=np.int64) * cells) // count
    widths = np.diff(edges)
    bins = np.repeat(np.arange(count), widths)
    # A state this reader does not know (a newer writer's) counts as "mixed".
    known = np.where(state < len(CELL_NAMES), state, CELL_MIXED).astype(np.intp)
    votes = np.zeros((count, len(CELL_NAMES)), np.int64)
    np.add.at(votes, (bins, known), 1)
    order = np.asarray(CELL_TIE_ORDER, np.intp)
    busy = votes[:, order]
    out_state = np.where(busy.sum(axis=1) == 0, CELL_FREE, order[busy.argmax(axis=1)])
    out_fill = np.add.reduceat(np.asarray(fill, np.int64), edges[:-1]) // widths
    return out_state.astype(np.uint8), out_fill.astype(np.uint8)


def format_age(seconds: float) -> str:
    """``850 ms``, ``12 s``, ``4 min 2 s``, ``3 h 5 min``, ``2 d 1 h``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    whole = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60),
                                      ("min", 60, "s", 1)):
        if whole >= size:
            return f"{whole // size} {unit} {whole % size // sub_size} {sub}"
    return f"{whole} s"
