"""``kvalloc ls``: the pools that publish statistics on this machine.

Every named pool has a segment ``/dev/shm/kvalloc.<pid>.<pool name>``. A row shows the writer's
pid, the pool, its state, its use (a KV cache's: ``KV 75.7% +24.3% cached``, the blocks sequences
hold and those the prefix cache keeps; else bytes in use), then the process name, capacity, bytes
in use and uptime, which are dropped, last first, when the terminal is too narrow. The state is
live, idle (alive but no publish lately; an idle pool publishes nothing), dead (the process was
killed before it could remove the segment) or unreadable (the file cannot be read as a segment;
the row says why).
Whether the writer lives is judged as ``kvalloc dump`` and ``top`` judge it: by the liveness lock
the writer holds on its segment, whatever pid namespace it runs in, else by its pid.
``--prune`` removes the segments of dead writers; live ones are never touched: each file is
judged again, under the writer's lock, at the moment it is removed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pykvalloc.errors import SegmentError, SegmentNotFound
from pykvalloc.sizes import format_size
from pykvalloc.stats import (
    IDLE_AFTER_S,
    SHM_DIR,
    Segment,
    SegmentFile,
    format_age,
    list_segments,
    lock_abandoned,
    process_name,
    use_label,
    writer_lives,
)

from .arguments import add_command
from .output import add_report_options, emit_json, wants_table


@dataclass(frozen=True)
class Entry:
    """One segment as ``kvalloc ls`` reports it."""

    segment: str
    pid: int
    process: str | None
    pool: str
    alive: bool             # the writer process runs
    state: str              # "live", "idle", "dead" or "unreadable"
    capacity: int | None = None
    bytes_in_use: int | None = None
    uptime_s: float | None = None
    heartbeat_age_s: float | None = None
    problem: str | None = None  # what is wrong with an unreadable segment
    problem_kind: str | None = None  # the same in a word or two (SegmentError.kind)
    # A KV cache's blocks: the pool counts its whole KV region as one allocation (always 100 %
    # in use), so its use is told by the blocks sequences hold, and those the prefix cache keeps.
    kv_used_blocks: int | None = None
    kv_cached_blocks: int | None = None
    kv_total_blocks: int | None = None


def describe(found: SegmentFile) -> Entry | None:
    """Reads what there is to say about one segment, whatever state its writer is in; None
    when the file went away after it was listed. A file that cannot be opened or parsed is an
    "unreadable" entry, never left out."""
    try:
        with Segment(found.path) as segment:
            snap = segment.snapshot(check_writer=False)
    except SegmentNotFound:
        return None
    except SegmentError as exc:
        alive = found.process_alive()
        return Entry(str(found.path), found.pid, process_name(found.pid) if alive else None,
                     found.name, alive, "unreadable", problem=str(exc), problem_kind=exc.kind)
    alive = writer_lives(found.path, snap.capabilities, snap.pid, snap.start_time_ns)
    age = snap.heartbeat_age()
    state = "dead" if not alive else "idle" if age >= IDLE_AFTER_S else "live"
    kv = snap.kv
    return Entry(str(found.path), found.pid, process_name(found.pid) if alive else None,
                 snap.pool_name, alive, state, snap.capacity, snap.bytes_in_use,
                 snap.uptime() if alive else None, age,
                 kv_used_blocks=None if kv is None else int(kv["used_blocks"]),
                 kv_cached_blocks=None if kv is None else int(kv["cached_blocks"]),
                 kv_total_blocks=None if kv is None else int(kv["total_blocks"]))


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "ls", "list the pools publishing statistics, and prune dead ones", __doc__)
    parser.add_argument("--prune", action="store_true",
                        help="remove the segments whose process is gone")
    add_report_options(parser, "the list")
    parser.set_defaults(run=run)


def prune(path: Path, pid: int, *, before_unlink: Callable[[], None] | None = None) -> bool:
    """Removes the segment file at ``path`` (``pid``: the one of its name) if its writer is
    dead at the moment of removal; whether it did. The file is opened and its writer judged
    again under the writer's liveness lock (``lock_abandoned``), which no writer can take while
    it is held; it is unlinked only while the path still names that very file, which a pool
    created meanwhile at the same path does not. ``before_unlink`` runs between the judgement
    and the unlink (tests step in there). Raises ``SegmentUnreadable`` for what is no segment
    file (a directory, a FIFO, a socket, a symbolic link) and the ``OSError`` of an unlink the
    system refuses."""
    try:
        fd = lock_abandoned(path, pid)
    except SegmentNotFound:
        return False  # removed meanwhile
    if fd is None:
        return False
    try:
        judged = os.fstat(fd)
        if before_unlink is not None:
            before_unlink()
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (judged.st_dev, judged.st_ino):
            return False  # another file took the path: it was not judged
        os.unlink(path)
        return True
    finally:
        os.close(fd)  # drops the lock


def _prune_or_say_why(found: SegmentFile) -> bool:
    """``prune``, with what stops it printed."""
    try:
        return prune(found.path, found.pid)
    except SegmentError as exc:  # no segment file (a FIFO, a link, a directory), or unopenable
        print(f"kvalloc ls: not removed: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"kvalloc ls: cannot remove {found.path}: {exc.strerror}", file=sys.stderr)
    return False


def run(args: argparse.Namespace) -> int:
    judged = [(found, describe(found)) for found in list_segments()]
    entries, removed = [], []
    for found, entry in judged:
        if args.prune and entry is not None and not entry.alive:
            if _prune_or_say_why(found):
                removed.append(entry)
                continue
            # Alive when judged again, another file at the path, or no file to remove: listed
            # as it is now.
            entry = describe(found)
        if entry is not None:
            entries.append(entry)
    for entry in removed:
        print(f"removed {entry.segment} (pool {entry.pool!r}, process {entry.pid} is gone)", file=sys.stderr)
    if wants_table(args):
        console = Console(highlight=False)
        if entries:
            console.print(_table(entries, console.width))
        else:
            console.print(f"no pool segments in {SHM_DIR}")
    emit_json(args, {"segments": [asdict(entry) for entry in entries],
                     "removed": [entry.segment for entry in removed]})
    return 0


_STATE_STYLES = {"live": "green", "idle": "yellow", "dead": "red", "unreadable": "red"}

# The columns in the order shown, those that matter first, and the order the rest are dropped in
# when the table is wider than the terminal (or, piped, than Rich's 80 columns): what a user needs
# to act on a row (the pid for ``kvalloc dump``, the pool, its state and use) stays; the rest goes
# before anything is cut.
_COLUMNS = (("pid", "right"), ("pool", "left"), ("state", "left"), ("use", "right"),
            ("process", "left"), ("capacity", "right"), ("in use", "right"), ("up", "right"))
_DROPPED_FIRST = ("up", "in use", "capacity", "process")


def _cells(entry: Entry) -> dict[str, Text | str]:
    if entry.capacity is None or entry.bytes_in_use is None:
        capacity = in_use = use = "-"
    else:
        kv = (None if entry.kv_total_blocks is None else
              (entry.kv_used_blocks or 0, entry.kv_cached_blocks or 0, entry.kv_total_blocks))
        capacity, in_use = format_size(entry.capacity), format_size(entry.bytes_in_use)
        use = use_label(entry.bytes_in_use, entry.capacity, kv)
    state = entry.state
    if entry.state == "idle" and entry.heartbeat_age_s is not None:
        state = f"idle {format_age(entry.heartbeat_age_s)}"
    elif entry.problem_kind:
        state = f"{state} ({entry.problem_kind}, {'alive' if entry.alive else 'dead'})"
    # Names as Text: a process or pool name such as "[/]x" is not Rich markup.
    return {"pid": str(entry.pid), "process": Text(entry.process or "-"), "pool": Text(entry.pool),
            "capacity": capacity, "in use": in_use, "use": use,
            "state": Text(state, _STATE_STYLES[entry.state]),
            "up": "-" if entry.uptime_s is None else format_age(entry.uptime_s)}


def _table(entries: list[Entry], width: int | None = None) -> Table:
    """The table of ``entries``, without the columns that ``width`` has no room for (see
    ``_DROPPED_FIRST``); the pool's name is the one column cut, with an ellipsis, and only once
    every droppable column is gone."""
    rows = [_cells(entry) for entry in entries]
    shown = [name for name, _ in _COLUMNS]
    pool_room: int | None = None
    while True:
        table = Table(title=f"Pools publishing statistics in {SHM_DIR}", title_justify="left")
        for name, justify in _COLUMNS:
            if name in shown:
                # Every column but the pool's holds its widest cell whatever the width.
                widest = max([len(name), *(_cell_len(row[name]) for row in rows)])
                pool = name == "pool"
                table.add_column(name, justify=justify,  # type: ignore[arg-type]
                                 no_wrap=True, overflow="ellipsis",
                                 min_width=None if pool else widest,
                                 max_width=pool_room if pool else None)
        for row in rows:
            table.add_row(*(row[name] for name in shown))
        natural = _natural_width(table)
        if width is None or natural <= width:
            return table
        droppable = [name for name in _DROPPED_FIRST if name in shown]
        if droppable:
            shown.remove(droppable[0])
        elif pool_room is None:
            pools = max([len("pool"), *(_cell_len(row["pool"]) for row in rows)])
            pool_room = max(len("pool"), pools - (natural - width))
        else:
            return table  # the essential columns alone are wider: the terminal cuts the line


def _cell_len(cell: Text | str) -> int:
    return cell.cell_len if isinstance(cell, Text) else Text(cell).cell_len


def _natural_width(table: Table) -> int:
    console = Console(width=10_000)
    return console.measure(table, options=console.options.update(max_width=10_000)).maximum
