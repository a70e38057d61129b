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


def label(result: ReplayResult) -> str:
    if result.config.mode == "paged":
        return f"paged/{result.config.block_tokens}"
    return result.config.mode


def table(results: Sequence[ReplayResult], title: str) -> Table:
    out = Table(title=title)
    out.add_column("figure")
    for result in results:
        out.add_column(label(result), justify="right")
    for key, name, fmt in _ROWS:
        out.add_row(name, *(_cell(getattr(r, key), fmt) for r in results))
    return out


def print_report(results: Sequence[ReplayResult], console: Optional[Console] = None) -> None:
    console = console or Console()
    first = results[0]
    capacity = first.config.capacity_tokens
    title = (f"Replay of {first.source}: {capacity:,} tokens of KV "
             f"({capacity * first.config.geometry.bytes_per_token / 2**30:.1f} GiB)")
    console.print(table(results, title))
    timed = {label(r): r.timing for r in results}
    console.print("allocator calls timed " + "; ".join(f"{name}: {where}" for name, where in timed.items())
                  + ". Inside the library, call percentiles are log2-bucket upper bounds.", style="dim")


def write_json(results: Sequence[ReplayResult], path: Path) -> None:
    payload: Any = results[0].as_dict() if len(results) == 1 else [r.as_dict() for r in results]
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plot(results: Sequence[ReplayResult], path: Path) -> None:
    """KV use and prefix hit rate over simulated time, one line per configuration."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pykvalloc[plot]'") from exc
    figure, (use_axis, hit_axis) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    for result in results:
        times = [s.time_s for s in result.samples]
        use_axis.plot(times, [100 * s.kv_use for s in result.samples], label=label(result), linewidth=0.8)
        hit_axis.plot(times, [100 * s.hit_rate for s in result.samples], label=label(result), linewidth=0.8)
    use_axis.set_ylabel("KV use (%)")
    hit_axis.set_ylabel("prefix hit rate (%)")
    hit_axis.set_xlabel("simulated time (s)")
    use_axis.legend(loc="lower right", fontsize="small")
    use_axis.set_title(results[0].source)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
