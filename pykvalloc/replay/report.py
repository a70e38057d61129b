"""The replay report: a rich table for people, JSON for scripts, a PNG plot when matplotlib is
installed (the optional ``plot`` extra)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from .simulator import ReplayResult

#: What each row shows, and how.
_ROWS = (
    ("requests", "requests", "{:,}"),
    ("finished", "finished", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("kv_use_at_first_preemption", "KV use at first preemption", "{:.1%}"),
    ("peak_kv_use", "peak KV use", "{:.1%}"),
    ("mean_kv_use", "mean KV use", "{:.1%}"),
    ("internal_waste", "internal waste", "{:.2%}"),
    ("fragmentation", "fragmentation", "{:.2%}"),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
    ("alloc_ns_p50", "allocator call p50", "{:,.0f} ns"),
    ("alloc_ns_p99", "allocator call p99", "{:,.0f} ns"),
    ("alloc_ns_p999", "allocator call p99.9", "{:,.0f} ns"),
    ("allocator_share", "allocator share of the run", "{:.2%}"),
    ("wall_s", "wall time", "{:.2f} s"),
    ("simulated_s", "simulated time", "{:,.0f} s"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def label(result: dict[str, Any]) -> str:
    return f"paged/{result['block_tokens']}" if result["mode"] == "paged" else str(result["mode"])


def table(results: Sequence[dict[str, Any]], title: str) -> Table:
    out = Table(title=title)
    out.add_column("figure")
    for result in results:
        out.add_column(label(result), justify="right")
    for key, name, fmt in _ROWS:
        out.add_row(name, *(_cell(r.get(key), fmt) for r in results))
    return out


def print_report(results: Sequence[ReplayResult | dict[str, Any]], console: Optional[Console] = None) -> None:
    """The table of one or more replays, given as results or as their JSON form (as_dict)."""
    console = console or Console()
    rows = [r.as_dict() if isinstance(r, ReplayResult) else r for r in results]
    first = rows[0]
    capacity = first["capacity_tokens"]
    title = f"Replay of {first['source']}: {capacity:,} tokens of KV"
    if "capacity_bytes" in first:
        title += f" ({first['capacity_bytes'] / 2**30:.1f} GiB)"
    console.print(table(rows, title))
    timed = {label(r): r["timing"] for r in rows}
    console.print("allocator calls timed " + "; ".join(f"{name}: {where}" for name, where in timed.items())
                  + ". Inside the library, call percentiles are log2-bucket upper bounds.", style="dim")


def write_json(results: Sequence[ReplayResult | dict[str, Any]], path: Path) -> None:
    rows = [r.as_dict() if isinstance(r, ReplayResult) else r for r in results]
    payload: Any = rows[0] if len(rows) == 1 else rows
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plot(results: Sequence[ReplayResult | dict[str, Any]], path: Path) -> None:
    """KV use and prefix hit rate over simulated time, one line per configuration run in this
    process (one replayed in a child process brings no samples)."""
    results = [r for r in results if isinstance(r, ReplayResult)]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pykvalloc[plot]'") from exc
    figure, (use_axis, hit_axis) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    for result in results:
        times = [s.time_s for s in result.samples]
        name = label(result.as_dict())
        use_axis.plot(times, [100 * s.kv_use for s in result.samples], label=name, linewidth=0.8)
        hit_axis.plot(times, [100 * s.hit_rate for s in result.samples], label=name, linewidth=0.8)
    use_axis.set_ylabel("KV use (%)")
    hit_axis.set_ylabel("prefix hit rate (%)")
    hit_axis.set_xlabel("simulated time (s)")
    use_axis.legend(loc="lower right", fontsize="small")
    use_axis.set_title(results[0].source)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
