"""The replay report: a rich table for people, JSON for scripts (``{"runs": [...]}``, one run per
configuration), a PNG plot when matplotlib is installed (the optional ``plot`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from pykvalloc.replay.simulator import ReplayResult
from pykvalloc.sizes import format_size

#: What each row shows, and how.
_ROWS = (
    ("requests", "requests", "{:,}"),
    ("finished", "finished", "{:,}"),
    ("rejected", "rejected", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("kv_use_at_first_preemption", "KV use at first preemption", "{:.1%}"),
    ("peak_kv_use", "peak KV use", "{:.1%}"),
    ("mean_kv_use", "mean KV use while busy", "{:.1%}"),
    ("internal_waste", "internal waste", "{:.2%}"),
    ("fragmentation", "fragmentation", "{:.2%}"),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
    ("readmission_hit_rate", "hit rate of re-admissions", "{:.1%}"),
    ("alloc_ns_p50", "allocator call p50", "{:,.0f} ns"),
    ("alloc_ns_p99", "allocator call p99", "{:,.0f} ns"),
    ("alloc_ns_p999", "allocator call p99.9", "{:,.0f} ns"),
    ("allocator_share", "allocator share of the run", "{:.2%}"),
    ("wall_s", "wall time", "{:.2f} s"),
    ("simulated_s", "simulated time", "{:,.0f} s"),
)


def _cell(value: Any, fmt: str) -> str:
    # None: not measured (no prefix keys, no preemption) or not run (a failed configuration).
    return "-" if value is None else fmt.format(value)


def label(result: dict[str, Any]) -> str:
    return f"paged/{result['block_tokens']}" if result["mode"] == "paged" else str(result["mode"])


def table(results: Sequence[dict[str, Any]]) -> Table:
    out = Table()
    out.add_column("figure")
    for result in results:
        out.add_column(label(result), justify="right")
    if any("error" in r for r in results):
        out.add_row("status", *("failed" if "error" in r else "ran" for r in results))
    for key, name, fmt in _ROWS:
        out.add_row(name, *(_cell(r.get(key), fmt) for r in results))
    return out


def engine_buffers_table(row: dict[str, Any]) -> Table:
    """What the engine's buffers around the KV cache cost, per kind (``--engine-buffers``)."""
    out = Table(title=f"{label(row)}: the engine's buffers beside the KV cache, same pool",
                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                caption="via: what served them (both: slabs for the small ones, the buddy for the rest); "
                        "p50/p99 of the alloc and free calls, timed around the ctypes call")
    for name in ("kind", "via", "allocs", "mean", "peak", "p50/p99 ns", "total"):
        out.add_column(name, justify="left" if name in ("kind", "via") else "right", no_wrap=True)
    for kind, cost in row["engine_buffers"].items():
        allocations = f"{cost['allocations']:,}"
        if cost["failures"]:
            allocations += f" ({cost['failures']:,} failed)"
        times = "-" if cost["ns_p50"] is None else f"{cost['ns_p50']:,.0f}/{cost['ns_p99']:,.0f}"
        out.add_row(kind, cost["path"], allocations, format_size(round(cost["mean_bytes"])),
                    format_size(cost["peak_live_bytes"]), times, f"{cost['total_ms']:,.0f} ms")
    return out


def failed(config: Any, trace: Any, error: Exception) -> dict[str, Any]:
    """The report row of a configuration whose replay raised: its name and the reason, every
    figure absent, so that the other configurations still make their table."""
    return {"mode": config.mode, "block_tokens": config.block_tokens, "capacity_tokens": config.capacity_tokens,
            "capacity_bytes": config.capacity_tokens * config.geometry.bytes_per_token,
            "source": trace.source, "requests": len(trace.requests), "error": str(error)}


def print_report(results: Sequence[ReplayResult | dict[str, Any]], console: Optional[Console] = None) -> None:
    """The table of one or more replays, given as results or as their JSON form (as_dict)."""
    rows = report_json(results)["runs"]
    console = console or Console()
    report = table(rows)
    wide_enough = console.measure(report, options=console.options.update(max_width=10_000)).maximum
    if not console.is_terminal and console.width < wide_enough:
        # Piped or redirected, Rich assumes 80 columns, which cut a --compare table's headers
        # and wrapped its figures; a file takes a long line.
        console = Console(width=wide_enough, file=console.file)
    first = rows[0]
    capacity = first["capacity_tokens"]
    title = f"Replay of {first['source']}: {capacity:,} tokens of KV"
    if "capacity_bytes" in first:
        title += f" ({first['capacity_bytes'] / 2**30:.1f} GiB)"
    console.print(title, style="bold")  # above the table, not as its title: that wraps to the table's width
    console.print(report)
    for row in rows:
        if row.get("engine_buffers"):
            console.print(engine_buffers_table(row))
    for row in rows:
        if "error" in row:
            console.print(f"{label(row)} failed: {row['error']}", style="red")
        if row.get("stopped"):
            console.print(f"{label(row)}: stopped early, as asked, after {row['simulated_s']:,.0f} simulated seconds: "
                          f"{row['finished']:,} of {row['requests']:,} requests had finished; the figures cover "
                          f"that much", style="yellow")
        if row.get("mode") == "contiguous" and row.get("preemptions"):
            console.print(f"{label(row)}: each request holds one buffer of a power of two of tokens and moves to the "
                          f"next when it outgrows it, so the pool fragments ({row['fragmentation']:.1%}) and wastes "
                          f"({row['internal_waste']:.1%}): {row['preemptions']:,} preemptions where a paged cache "
                          f"of the same size needs far fewer", style="dim")
        if row.get("rejected"):
            console.print(f"{label(row)}: rejected {row['rejected']:,} of {row['requests']:,} requests, which can "
                          f"never complete on this KV cache, even alone (give it more: --kv-size)", style="yellow")
    by_timing: dict[str, list[str]] = {}
    for r in rows:
        if "error" not in r:
            by_timing.setdefault(r["timing"], []).append(label(r))
    if by_timing:
        bounds = {"inside the library": " (percentiles as log2-bucket upper bounds)"}
        where = "; ".join(f"{timing}{bounds.get(timing, '')} for {', '.join(names)}"
                          for timing, names in by_timing.items())
        about_hits = (" A prefix hit counts prompt tokens found cached at a request's first admission; "
                      "re-admissions after a preemption find their own blocks and are counted apart."
                      if any(r.get("prefix_hit_rate") is not None for r in rows) else "")
        console.print(f"Allocator calls were timed {where}.{about_hits}", style="dim")


def report_json(results: Sequence[ReplayResult | dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The report as JSON values: ``{"runs": [...]}``, one run per configuration, however many."""
    return {"runs": [r.as_dict() if isinstance(r, ReplayResult) else r for r in results]}


def _binned(times: list[float], values: list[float], bins: int) -> tuple[list[float], list[float]]:
    """Means of values over equal spans of time: a step-by-step series is too dense to read."""
    if not times:
        return [], []
    span = (times[-1] - times[0]) / bins or 1.0
    sums: dict[int, list[float]] = {}
    for t, v in zip(times, values):
        sums.setdefault(int((t - times[0]) / span), []).append(v)
    keys = sorted(sums)
    return [times[0] + (k + 0.5) * span for k in keys], [sum(sums[k]) / len(sums[k]) for k in keys]


def write_plot(results: Sequence[ReplayResult | dict[str, Any]], path: Path, bins: int = 300) -> None:
    """KV use and (where the trace has prefix ids) the prefix hit rate over simulated time, one
    line per configuration run in this process (one replayed in a child brings no samples)."""
    runs = [r for r in results if isinstance(r, ReplayResult) and r.samples]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pykvalloc[plot]'") from exc
    with_hits = any(s.hit_rate for r in runs for s in r.samples)
    figure, axes = plt.subplots(2 if with_hits else 1, 1, sharex=True, figsize=(10, 6 if with_hits else 3.6),
                                squeeze=False)
    use_axis = axes[0][0]
    for result in runs:
        name = label(result.as_dict())
        times = [s.time_s for s in result.samples]
        x, y = _binned(times, [100 * s.kv_use for s in result.samples], bins)
        use_axis.plot(x, y, label=name, linewidth=1.0)
        if with_hits:
            x, y = _binned(times, [100 * s.hit_rate for s in result.samples], bins)
            axes[1][0].plot(x, y, label=name, linewidth=1.0)
    use_axis.set_ylabel("KV use (%, mean per bin)")
    use_axis.set_ylim(0, 105)
    use_axis.legend(loc="lower right", fontsize="small", ncol=2)
    use_axis.set_title(f"{Path(runs[0].source).name if runs else ''}: KV use over simulated time")
    if with_hits:
        axes[1][0].set_ylabel("prefix hit rate (%, cumulative,\nfirst admissions)")
    axes[-1][0].set_xlabel("simulated time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
