"""The replay report: a rich table for people, JSON for scripts (``{"runs": [...]}``, one run per
configuration), a PNG plot when matplotlib is installed (the optional ``plot`` extra)."""
from __future__ import annotations

import math
from dataclasses import dataclass
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
    if any(r.get("tenants") is not None for r in results):
        out.add_row("tenants",
                    *("-" if r.get("tenants") is None else f"{r.get('tenant_count') or len(r['tenants']):,}"
                      for r in results))
    if any(r.get("system_prompt") is not None for r in results):
        out.add_row("system prompt pinned",
                    *("-" if r.get("system_prompt") is None else
                      f"{r['system_prompt']['pinned_blocks']:,} blocks" for r in results))
    return out


def tenancy_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the tenants and the pinned system prompt did, for the runs that had them."""
    out = []
    for r in rows:
        tenants = r.get("tenants")
        if tenants is not None:
            rates = ", ".join(f"{t['namespace']}: {t['hit_tokens'] / t['query_tokens']:.1%}"
                              for t in tenants[:8] if t["query_tokens"])
            more = f" and {len(tenants) - 8:,} more" if len(tenants) > 8 else ""
            out.append(f"{label(r)}: tenants: each conversation (its first hash id past the system prompt; a "
                       f"request without one is its own) is in namespace hash(id) % {r.get('tenant_count') or 'N'}, "
                       f"and a prefix is shared only "
                       f"within a namespace, as an engine keeps its tenants apart. Turns of one conversation still "
                       f"hit each other, but what all conversations share (the system prompt) is cached once per "
                       f"tenant: each tenant's first request misses it, and the copies take blocks that one copy "
                       f"would leave to the traffic, so the hit rate is lower than in one namespace. First "
                       f"admissions' hit rate per namespace: {rates or '-'}{more}.")
        prompt = r.get("system_prompt")
        if prompt is not None:
            share = prompt["pinned_blocks"] / prompt["capacity_blocks"] if prompt["capacity_blocks"] else 0.0
            out.append(f"{label(r)}: system prompt pinned: the first {prompt['hash_ids']:,} hash "
                       f"id{'s' if prompt['hash_ids'] != 1 else ''} ({prompt['tokens']:,} tokens, opening "
                       f"{prompt['requests_opening']:,} of {r['requests']:,} requests), {prompt['blocks']:,} blocks "
                       f"of {r['block_tokens']} tokens, pinned in each of {prompt['pins']:,} namespaces once a "
                       f"request had cached it there, to the end of the run ({prompt['pinned_blocks']:,} blocks, "
                       f"{share:.1%} of the cache). Eviction never takes a pinned block: "
                       f"{prompt['found_whole']:,} of the {prompt['admissions_after_pin']:,} first admissions that "
                       f"opened with it after its pin found it whole, beside {prompt['evictions']:,} evictions.")
    return out


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What each dash and each figure that looks odd in the table means, for the configurations
    that show one: a note per reason, naming them."""
    ran = [r for r in rows if "error" not in r]
    out = []
    reasons: dict[str, list[str]] = {}
    for r in ran:
        if r.get("prefix_hit_rate") is None:
            reasons.setdefault(r.get("hits_unmeasured") or "not measured", []).append(label(r))
    for reason, names in reasons.items():
        out.append(f"prefix hit rate - ({', '.join(names)}): {reason} (nor is the re-admissions' measured).")
    again = [label(r) for r in ran if r.get("prefix_hit_rate") is not None and r.get("readmission_hit_rate") is None]
    if again:
        out.append(f"hit rate of re-admissions - ({', '.join(again)}): no request was preempted and admitted again.")
    unpreempted = [label(r) for r in ran if not r.get("preemptions") and not r["mode"].startswith("malloc-")]
    if unpreempted:
        out.append(f"KV use at first preemption - ({', '.join(unpreempted)}): nothing was preempted.")
    malloc = [r for r in ran if r["mode"].startswith("malloc-")]
    if malloc:
        full = [label(r) for r in malloc if r.get("peak_kv_use", 0) >= 0.999]
        out.append(f"{', '.join(label(r) for r in malloc)}: each request reserves its whole KV (prompt and answer) "
                   "when admitted, so it never grows and is never preempted (0 preemptions, KV use at first "
                   "preemption -); a request that does not fit waits for reservations to be freed. KV use counts "
                   "reservations, written or not"
                   + (f": the peak of 100.0% ({', '.join(full)}) is the budget full of reservations, and their "
                      "unwritten part is the internal waste." if full else "; their unwritten part is the internal "
                      "waste."))
        if len(malloc) > 1:
            out.append(f"{', '.join(label(r) for r in malloc)} reserve the same sizes at the same moments: their KV "
                       "figures agree; only the call times differ.")
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
    for note in notes(rows) + tenancy_notes(rows):
        console.print(note, style="dim")
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


def report_json(results: Sequence[ReplayResult | dict[str, Any]],
                samples: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The report as JSON values: ``{"runs": [...]}``, one run per configuration, however many;
    with ``samples``, each run's usage samples too (ReplayResult.as_dict)."""
    return {"runs": [r.as_dict(samples) if isinstance(r, ReplayResult) else
                     {k: v for k, v in r.items() if samples or k != "samples"} for r in results]}


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


def _series(result: ReplayResult | dict[str, Any]) -> Optional[tuple[dict[str, Any], list[list[float]]]]:
    """(the run's JSON row, its samples as [time_s, kv_use, hit_rate, ...] rows), or None for a
    run without samples (a failed configuration)."""
    row = result.as_dict(samples=True) if isinstance(result, ReplayResult) else result
    if "error" in row or not row.get("samples"):
        return None
    return row, row["samples"]


#: A run whose simulated time is past this many times the median run's stretches the time axis
#: so far that the others crowd its first part: the axis stops at the longest of the others.
STRETCH = 1.5


@dataclass
class PlotLayout:
    """What ``write_plot`` draws: each run with samples (its row and samples) under its legend
    name, the runs it cannot draw (failed), and where the shared time axis stops."""
    series: list[tuple[dict[str, Any], list[list[float]]]]
    names: list[str]
    not_drawn: list[str]
    x_max: float


def plot_layout(results: Sequence[ReplayResult | dict[str, Any]]) -> PlotLayout:
    """The runs to draw and the time axis they share (see ``write_plot``)."""
    series = [found for found in map(_series, results) if found is not None]
    not_drawn = [label(r.as_dict() if isinstance(r, ReplayResult) else r) for r in results if _series(r) is None]
    ends = sorted(row["simulated_s"] for row, _ in series)
    median = ends[(len(ends) - 1) // 2] if ends else 0.0
    x_max = max([end for end in ends if end <= STRETCH * median] or ends or [1.0])
    names = [label(row) + (f" (runs to {row['simulated_s']:,.0f} s)" if row["simulated_s"] > x_max else "")
             for row, _ in series]
    return PlotLayout(series, names, not_drawn, x_max)


def write_plot(results: Sequence[ReplayResult | dict[str, Any]], path: Path, bins: int = 300) -> None:
    """KV use and (where the trace has prefix ids) the prefix hit rate over simulated time, one
    line per configuration, those replayed in a child process (jemalloc) included. The time axis
    is shared, so that the lines compare the same moments of the same traffic; it stops at the
    longest run but those that outlast the median run by more than ``STRETCH`` times, whose
    lines go off its right edge (their legend says where they end). The hit-rate axis starts
    at 0."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pykvalloc[plot]'") from exc
    layout = plot_layout(results)
    series, x_max = layout.series, layout.x_max
    with_hits = any(row.get("prefix_hit_rate") is not None for row, _ in series)
    figure, axes = plt.subplots(2 if with_hits else 1, 1, sharex=True, figsize=(10, 6.4 if with_hits else 4),
                                squeeze=False)
    use_axis = axes[0][0]
    # The two malloc lines coincide (the same reservations): one wide and pale, one dashed over it.
    styles: dict[str, dict[str, Any]] = {
        "malloc-glibc": {"linewidth": 2.6, "alpha": 0.55}, "malloc-jemalloc": {"linestyle": "--", "linewidth": 1.2},
        "contiguous": {"linestyle": ":", "linewidth": 1.6}}
    peak_hit = 0.0
    for (row, samples), name in zip(series, layout.names):
        style = {"linewidth": 1.0, **styles.get(row["mode"], {})}
        times = [sample[0] for sample in samples]
        x, y = _binned(times, [100 * sample[1] for sample in samples], bins)
        use_axis.plot(x, y, label=name, **style)
        if with_hits and row.get("prefix_hit_rate") is not None:
            x, y = _binned(times, [100 * sample[2] for sample in samples], bins)
            peak_hit = max([peak_hit, *y])
            axes[1][0].plot(x, y, label=name, **style)
    use_axis.set_ylabel("KV use (%, mean per bin)")
    use_axis.set_ylim(0, 105)
    use_axis.legend(loc="lower right", fontsize="small", ncol=2)
    title = f"{Path(series[0][0]['source']).name if series else ''}: KV use over simulated time"
    if layout.not_drawn:
        title += f" (not drawn, failed: {', '.join(layout.not_drawn)})"
    use_axis.set_title(title)
    if with_hits:
        hit_axis = axes[1][0]
        hit_axis.set_ylabel("prefix hit rate (%, cumulative,\nfirst admissions)")
        hit_axis.set_ylim(0, min(100.0, max(5.0, 5 * math.ceil(peak_hit * 1.2 / 5))))
        hit_axis.legend(loc="lower right", fontsize="small", ncol=2)
    axes[-1][0].set_xlim(0, x_max * 1.01)
    axes[-1][0].set_xlabel("simulated time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
