"""``kvalloc ls``: the pools that publish statistics on this machine.

Every named pool has a segment ``/dev/shm/kvalloc.<pid>.<pool name>``. A row shows the writer's
pid and process name, the pool, its capacity and use, and its state: live, idle (alive but no
publish lately; an idle pool publishes nothing), dead (the process was killed before it could
remove the segment) or unreadable (the file cannot be read as a segment; the row says why).
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
            console.print(_table(entries))
        else:
            console.print(f"no pool segments in {SHM_DIR}")
    emit_json(args, {"segments": [asdict(entry) for entry in entries],
                     "removed": [entry.segment for entry in removed]})
    return 0


_STATE_STYLES = {"live": "green", "idle": "yellow", "dead": "red", "unreadable": "red"}


def _table(entries: list[Entry]) -> Table:
    table = Table(title=f"Pools publishing statistics in {SHM_DIR}", title_justify="left")
    for name, justify in (("pid", "right"), ("process", "left"), ("pool", "left"),
                          ("capacity", "right"), ("in use", "right"), ("use", "right"),
                          ("state", "left"), ("up", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for entry in entries:
        if entry.capacity is None or entry.bytes_in_use is None:
            figures = ["-", "-", "-"]
        else:
            use = f"{entry.bytes_in_use / entry.capacity:.1%}" if entry.capacity else "-"
            if entry.kv_total_blocks:
                use = (f"KV {(entry.kv_used_blocks or 0) / entry.kv_total_blocks:.1%} "
                       f"+{(entry.kv_cached_blocks or 0) / entry.kv_total_blocks:.1%} cached")
            figures = [format_size(entry.capacity), format_size(entry.bytes_in_use), use]
        state = entry.state
        if entry.state == "idle" and entry.heartbeat_age_s is not None:
            state = f"idle {format_age(entry.heartbeat_age_s)}"
        elif entry.problem_kind:
            state = f"{state} ({entry.problem_kind}, {'alive' if entry.alive else 'dead'})"
        # Names as Text: a process or pool name such as "[/]x" is not Rich markup.
        table.add_row(str(entry.pid), Text(entry.process or "-"), Text(entry.pool), *figures,
                      Text(state, _STATE_STYLES[entry.state]),
                      "-" if entry.uptime_s is None else format_age(entry.uptime_s))
    return table
