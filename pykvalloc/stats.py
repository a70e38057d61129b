"""Reading a named pool's live statistics segment, from any process (layout: kvalloc_stats.h).

A pool created with a name publishes its state in ``/dev/shm/kvalloc.<pid>.<name>``. This module
finds those files, opens one read-only and copies consistent snapshots out of it:

    >>> from pykvalloc import stats
    >>> with stats.open_segment("engine") as segment:       # a pid, a pool name or a path
    ...     snap = segment.snapshot()
    ...     print(snap.pool_name, snap.summary["bytes_in_use"], snap.latency_percentiles("alloc"))

Rules it keeps, because the writer is another program that may be buggy, older, newer, killed
half way, or not a kvalloc at all:

* The file is opened read-only with ``os.open`` and copied with ``os.pread``, never mapped:
  whoever can write the file can shrink it, and reading a mapped page past the new end kills
  the reader with SIGBUS, where ``pread`` returns short (``TruncatedSegment``).
  ``multiprocessing.shared_memory`` is not used: its resource tracker unlinks segments it
  believes it created, which would delete the engine's segment under it.
* No offset or count read from the segment is used before it is checked against the segment's
  real size; each way the segment can be wrong raises its own ``SegmentError`` subclass.
* A snapshot is a private copy taken under the writer's sequence lock (equal, even sequence
  before and after the copy), retried a bounded number of times; after that
  ``InconsistentSnapshot`` is raised. Torn data is never returned.
* The file is opened without following a symbolic link and without blocking (a FIFO named like
  a segment must not hang the reader), and must be a regular file; a snapshot copies the
  bytes the header states, at most ``MAX_SEGMENT_BYTES``, not the whole file.
  Each way the file itself can be wrong raises ``SegmentNotFound`` (it is gone) or
  ``SegmentUnreadable`` (it cannot be opened or read, or is not a regular file).
* The writer's liveness is judged by one rule, ``writer_lives``: by its liveness lock when the
  segment says the writer keeps one (that holds across pid namespaces), else from its pid (and
  that pid's start time, against reuse); never from the heartbeat: a live pool that makes no
  slow-path calls publishes nothing, so an old heartbeat with a live writer means idle, not
  dead.
* A writer of an older minor version (same ``abi_major``) wrote shorter structs: the fields it
  did not write are listed in ``Snapshot.absent`` and are None in ``Snapshot.to_dict()``.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import re
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._strict_json import json_ready
from .errors import (
    AmbiguousSegment,
    BadMagic,
    CorruptSegment,
    DeadWriter,
    InconsistentSnapshot,
    SegmentError,
    SegmentNotFound,
    SegmentRemoved,
    SegmentUnreadable,
    TruncatedSegment,
    UnsupportedVersion,
)

__all__ = [
    "SHM_DIR",
    "SegmentFile",
    "Segment",
    "Snapshot",
    "list_segments",
    "find_segment",
    "open_segment",
    "writer_alive",
    "writer_holds_lock",
    "lock_abandoned",
    "writer_lives",
    "MAX_SEGMENT_BYTES",
    "process_name",
    "process_start_time",
    "latency_percentiles",
    "downsample_cells",
    "format_age",
    "CELL_FREE",
    "CELL_BLOCK",
    "CELL_SLAB",
    "CELL_MIXED",
    "CELL_KV_USED",
    "CELL_KV_CACHED",
    "CELL_NAMES",
    "OP_NAMES",
]

SHM_DIR = Path("/dev/shm")

# ---- the layout of kvalloc_stats.h -------------------------------------------------------------

MAGIC = 0x315441545341564B  # "KVASTAT1" as a little-endian u64
ABI_MAJOR = 1
ABI_MINOR = 3
MAX_SECTIONS = 16
LATENCY_BUCKETS = 40
STRIP_CELLS = 64

SECTION_SUMMARY, SECTION_HEAPMAP, SECTION_CLASSES, SECTION_SLABS = 1, 2, 3, 4
SECTION_ARENAS, SECTION_LATENCY, SECTION_KV, SECTION_TRACE = 5, 6, 7, 8
SECTION_NAMES = {SECTION_SUMMARY: "summary", SECTION_HEAPMAP: "heap map",
                 SECTION_CLASSES: "classes", SECTION_SLABS: "slabs", SECTION_ARENAS: "arenas",
                 SECTION_LATENCY: "latency", SECTION_KV: "kv", SECTION_TRACE: "trace"}

CAP_TRACE_ALL = 1 << 8        # trace on: every call recorded and timed
CAP_LIVENESS_LOCK = 1 << 9    # the writer holds a shared flock on the segment while alive

CELL_FREE, CELL_BLOCK, CELL_SLAB, CELL_MIXED, CELL_KV_USED, CELL_KV_CACHED = range(6)
CELL_NAMES = ("free", "block", "slab", "mixed", "kv used", "kv cached")

OP_NAMES = {1: "alloc", 2: "free", 3: "alloc_aligned", 4: "alloc_exact", 5: "trim"}
STATUS_NAMES = {0: "ok", 1: "out of memory", 2: "invalid", 3: "double free", 4: "bad pointer",
                5: "backend", 6: "corrupt"}
NO_OFFSET = (1 << 64) - 1

# align=True lays the fields out as a C compiler does; "<" because the segment is little-endian
# whatever machine reads it. tests/python/test_stats_layout.py checks every offset against the
# compiler's.
SECTION_DTYPE = np.dtype([("kind", "<u4"), ("reserved", "<u4"), ("offset", "<u8"),
                          ("size", "<u8")], align=True)
HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("abi_major", "<u2"), ("abi_minor", "<u2"), ("header_size", "<u4"),
    ("capabilities", "<u8"), ("sequence", "<u8"), ("segment_size", "<u8"),
    ("writer_pid", "<u4"), ("section_count", "<u4"), ("start_time_ns", "<u8"),
    ("heartbeat_ns", "<u8"), ("publish_count", "<u8"), ("pool_name", "S64"),
    ("sections", SECTION_DTYPE, (MAX_SECTIONS,)),
], align=True)
SUMMARY_COUNTERS = ("capacity", "min_block", "slab_chunk", "max_alloc_size", "bytes_in_use",
                    "bytes_free", "slab_bytes", "slab_free_bytes", "largest_free",
                    "live_allocations", "alloc_count", "free_count", "alloc_failures",
                    "rejected_calls", "slab_count", "metadata_bytes", "page_size")
SUMMARY_ADDED_1_1 = ("publish_interval_ms", "backend", "numa_node", "flags", "mapped_bytes")
SUMMARY_DTYPE = np.dtype(
    [(name, "<u8") for name in SUMMARY_COUNTERS]
    + [("page_kind", "<u4"), ("num_orders", "<u4"), ("fragmentation", "<f8"),
       ("free_blocks", "<u8", (48,)), ("unusable_index", "<f8", (48,)),
       # 1.1
       ("publish_interval_ms", "<u4"), ("backend", "<u4"), ("numa_node", "<i4"), ("flags", "<u4"),
       ("mapped_bytes", "<u8")], align=True)
HEAPMAP_DTYPE = np.dtype([("cells", "<u4"), ("cell_blocks", "<u4"), ("cell_bytes", "<u8")],
                         align=True)
COUNTED_DTYPE = np.dtype([("count", "<u4"), ("entry_size", "<u4")], align=True)  # classes, arenas
CLASS_DTYPE = np.dtype([("object_size", "<u4"), ("objects_per_slab", "<u4"),
                        ("live_objects", "<u8"), ("slabs", "<u8"), ("allocs", "<u8"),
                        ("frees", "<u8")], align=True)
SLABS_DTYPE = np.dtype([("count", "<u4"), ("capacity", "<u4")], align=True)
SLAB_DTYPE = np.dtype([("chunk", "<u4"), ("size_class", "<u2"), ("reserved", "<u2"),
                       ("inuse", "<u4"), ("objects", "<u4"), ("strip", "u1", (STRIP_CELLS,))],
                      align=True)
ARENA_DTYPE = np.dtype([("slabs", "<u8"), ("slab_bytes", "<u8"), ("spare_slabs", "<u8"),
                        ("word_claims", "<u8"), ("numa_node", "<i8")], align=True)
LATENCY_DTYPE = np.dtype([("alloc", "<u8", (LATENCY_BUCKETS,)),
                          ("free", "<u8", (LATENCY_BUCKETS,))], align=True)
KV_COUNTERS = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "hit_tokens",
               "query_tokens", "evictions", "cow_copies", "forks", "live_sequences",
               "block_bytes")
KV_DTYPE = np.dtype([("present", "<u4"), ("block_tokens", "<u4")]
                    + [(name, "<u8") for name in KV_COUNTERS], align=True)
TRACE_DTYPE = np.dtype([("capacity", "<u4"), ("entry_size", "<u4"), ("written", "<u8")],
                       align=True)
RECORD_DTYPE = np.dtype([("time_ns", "<u8"), ("offset", "<u8"), ("size", "<u8"),
                         ("thread", "<u4"), ("op", "u1"), ("status", "u1"),
                         ("reserved", "<u2")], align=True)

# The bytes of a struct that every writer of this major version writes, for the structs a later
# minor version grew at their end: an older writer's shorter struct lacks the fields after them.
# Layout 1.0 ends the summary before its 1.1 fields; the arena entry of 1.2 first lacked
# numa_node. (Before 1.2 an arena entry held other counters under the same bytes, see
# Snapshot.__init__.)
_OLDEST_SIZE = {SUMMARY_DTYPE: SUMMARY_DTYPE.fields["publish_interval_ms"][1],
                ARENA_DTYPE: ARENA_DTYPE.fields["numa_node"][1]}
ARENAS_SINCE_MINOR = 2

# The most bytes of a segment this reader copies. A segment's size is all but its slab
# table (80 bytes per slab chunk): 1 GiB holds 13 million chunks, a 26 TiB pool at the default
# 2 MiB chunk (800 GiB at the smallest, 64 KiB). A larger file, or a header that states more, is
# not a segment a snapshot should copy several times a second.
MAX_SEGMENT_BYTES = 1 << 30

_U64 = struct.Struct("<Q")
_IDENTITY = struct.Struct("<QHH")  # magic, abi_major, abi_minor: where every version has them
_SEQUENCE_AT = HEADER_DTYPE.fields["sequence"][1]
_CAPABILITIES_AT = HEADER_DTYPE.fields["capabilities"][1]
_CAPABILITIES_END = _CAPABILITIES_AT + 8
_SEGMENT_SIZE_AT = HEADER_DTYPE.fields["segment_size"][1]

# Read-only, close-on-exec; never through a symbolic link, and never blocking: opening a FIFO
# for reading would wait for a writer that may never come.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK

# The pid in a segment's file name is the writer's; the pool name follows the library's rule.
_FILE_RE = re.compile(r"kvalloc\.([0-9]{1,10})\.([A-Za-z0-9_.-]{1,63})\Z")

# Linux pids are below the kernel's PID_MAX_LIMIT (2**22 on 64-bit, less on 32-bit), whatever
# pid_max says. A file name or header may state any number up to 10 digits or 2**32 - 1 (another
# pid namespace's writer, garbage): such a pid names no process here, and os.kill would raise
# OverflowError past 2**31.
_PID_LIMIT = 1 << 22

# A process whose start is this much later than the pool's creation cannot have created it: its
# pid was reused. The slack covers the kernel's start-time rounding (boot time in whole seconds).
_PID_REUSE_SLACK_S = 2.0

# A live writer whose latest publish is older than this is shown as idle. The library publishes
# only from calls that leave the fast paths, so a pool in steady use can be idle too.
IDLE_AFTER_S = 2.0

# How hard snapshot() tries before InconsistentSnapshot: a publish takes microseconds, a large
# pool's about a millisecond, so this rides out a writer publishing back to back yet gives up on
# a stuck one in about 0.1 s.
SNAPSHOT_ATTEMPTS = 64
_MAX_BACKOFF_S = 0.002


# ---- finding segments --------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentFile:
    """A file that by its name is a pool's segment: ``kvalloc.<pid>.<name>`` in ``SHM_DIR``."""

    path: Path
    pid: int
    name: str

    @classmethod
    def from_path(cls, path: Path) -> SegmentFile | None:
        match = _FILE_RE.match(path.name)
        return cls(path, int(match.group(1)), match.group(2)) if match else None

    def process_alive(self) -> bool:
        """Whether the writer lives, by ``writer_lives``: by its liveness lock when the segment
        says it keeps one, else by the pid of the file name (without the pool's start time, a
        reused pid counts as alive here; ``Segment.snapshot`` knows better). A file that cannot
        be read as a segment says nothing of a lock: its pid is all there is."""
        try:
            fd, _ = _open_segment_file(self.path)
        except SegmentNotFound:
            return False
        except SegmentUnreadable:
            return writer_alive(self.pid)
        try:
            head = os.pread(fd, _CAPABILITIES_END, 0)
        finally:
            os.close(fd)
        capabilities = 0
        if len(head) == _CAPABILITIES_END and _U64.unpack_from(head, 0)[0] == MAGIC:
            capabilities = _U64.unpack_from(head, _CAPABILITIES_AT)[0]
        return writer_lives(self.path, capabilities, self.pid)


def list_segments(directory: Path = SHM_DIR) -> list[SegmentFile]:
    """Every file named like a segment in ``directory``, ordered by pid then pool name. No
    directory means no segments; one that cannot be listed (permission, not a directory) raises
    ``SegmentUnreadable``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SegmentUnreadable(f"cannot list the segments in {directory}: {exc.strerror}",
                                path=str(directory)) from exc
    found = (SegmentFile.from_path(directory / name) for name in names)
    return sorted((f for f in found if f is not None), key=lambda f: (f.pid, f.name))


def find_segment(target: str, directory: Path = SHM_DIR) -> SegmentFile:
    """The segment named by ``target``: a path, a file name (``kvalloc.<pid>.<name>``), a pid or
    a pool name. A pid or a name that matches several raises ``AmbiguousSegment``; between a
    live and a dead writer's segment of the same name, the live one is taken."""
    if os.sep in target:
        path = Path(target)
        if not os.path.lexists(path):  # a link is not followed, but found: opening it says why
            raise SegmentNotFound(f"no segment {target}", path=target)
        found = SegmentFile.from_path(path)
        if found is None:
            raise SegmentNotFound(f"{target} is not named like a kvalloc segment "
                                  "(kvalloc.<pid>.<pool name>)", path=target)
        return found
    segments = list_segments(directory)
    matches = [s for s in segments if s.path.name == target]
    if not matches and target.isdigit():
        matches = [s for s in segments if s.pid == int(target)]
    if not matches:
        matches = [s for s in segments if s.name == target]
    if len(matches) > 1:
        alive = [s for s in matches if s.process_alive()]
        matches = alive or matches
    if not matches:
        raise SegmentNotFound(f"no pool segment matches {target!r} in {directory} "
                              f"(segments there: {_a_few(segments)})")
    if len(matches) > 1:
        raise AmbiguousSegment(f"{target!r} matches {len(matches):,} segments: "
                               f"{_a_few(matches)}; name one of them")
    return matches[0]


# An error names at most this many segments: a /dev/shm may hold thousands.
_NAMED_IN_ERRORS = 5


def _a_few(segments: list[SegmentFile]) -> str:
    """The first ``_NAMED_IN_ERRORS`` segments' file names and how many more there are."""
    if not segments:
        return "none"
    named = ", ".join(s.path.name for s in segments[:_NAMED_IN_ERRORS])
    more = len(segments) - _NAMED_IN_ERRORS
    return f"{named} and {more:,} more" if more > 0 else named


def open_segment(target: str, directory: Path = SHM_DIR) -> Segment:
    """``Segment(find_segment(target).path)``."""
    return Segment(find_segment(target, directory).path)


def writer_alive(pid: int, start_time_ns: int | None = None) -> bool:
    """Whether process ``pid`` runs and, given the pool's creation time, is old enough to have
    created it (a younger process has only reused the pid of a dead writer). A pid outside
    (0, ``_PID_LIMIT``) names no process."""
    if not 0 < pid < _PID_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    if start_time_ns is None:
        return True
    try:
        created = process_start_time(pid)
    except (OSError, ValueError):
        return True  # it exists, but /proc does not say when it started
    if created is None:
        return False
    return created <= start_time_ns / 1e9 + _PID_REUSE_SLACK_S


def writer_lives(path: str | os.PathLike[str], capabilities: int, pid: int,
                 start_time_ns: int | None = None) -> bool:
    """Whether the writer of the segment at ``path`` lives: the one rule of ``kvalloc ls``,
    ``dump`` and ``top``. A writer that keeps the liveness lock (``capabilities`` says so) lives
    while it holds it, whatever pid namespace it runs in; otherwise, or when the file cannot be
    opened to test the lock, its ``pid`` and the pool's ``start_time_ns`` decide
    (``writer_alive``)."""
    if capabilities & CAP_LIVENESS_LOCK:
        try:
            return writer_holds_lock(path)
        except OSError:
            pass  # the lock cannot be tested: the pid is all there is
    return writer_alive(pid, start_time_ns)


def writer_holds_lock(path: str | os.PathLike[str]) -> bool:
    """Whether the writer of the segment at ``path`` still holds its liveness lock: a shared flock
    the library keeps for the writer's whole life, which the kernel drops however the process
    ends. Unlike a pid, this holds across pid namespaces (a reader in another container). A file
    that cannot be opened raises its ``OSError``."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if we took it
    return False


def lock_abandoned(path: str | os.PathLike[str], pid: int) -> int | None:
    """A descriptor of the segment file at ``path`` that holds the writer's liveness lock
    exclusively, when its writer is dead; None, and nothing held, when it lives. ``pid`` is
    the one of the file name. Closing the descriptor drops the lock.

    The writer is judged from that descriptor under that lock, by ``writer_lives``' rule: no
    writer holds its shared lock while this one is held, so a writer that keeps the lock (the
    header says so) is dead, and stays dead until the descriptor is closed; the writer of any
    other file is judged by the pid and start time its header states, or by ``pid`` when it has
    no header of this layout. A lock held by someone else (a writer, or another reader judging
    the file) counts as alive. ``SegmentNotFound`` when there is no file, ``SegmentUnreadable``
    when it cannot be opened or is not a regular file (``_open_segment_file``)."""
    fd, _ = _open_segment_file(Path(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        head = os.pread(fd, HEADER_DTYPE.itemsize, 0)
        capabilities, start_time_ns = 0, None
        if len(head) >= _CAPABILITIES_END and _U64.unpack_from(head, 0)[0] == MAGIC:
            capabilities = _U64.unpack_from(head, _CAPABILITIES_AT)[0]
            major = _IDENTITY.unpack_from(head, 0)[1]
            if len(head) == HEADER_DTYPE.itemsize and major == ABI_MAJOR:
                header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
                pid, start_time_ns = int(header["writer_pid"]), int(header["start_time_ns"])
        dead = bool(capabilities & CAP_LIVENESS_LOCK) or not writer_alive(pid, start_time_ns)
    except BlockingIOError:
        dead = False  # the lock is held
    except BaseException:
        os.close(fd)
        raise
    if dead:
        return fd
    os.close(fd)
    return None


def _open_segment_file(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path`` (``_OPEN_FLAGS``) and its status; the caller
    closes it. ``SegmentNotFound`` when there is no file, ``SegmentUnreadable`` when it cannot be
    opened or is not a regular file (a directory, a FIFO, a device, a symbolic link)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise SegmentNotFound(f"no segment {path}", path=str(path)) from None
    except OSError as exc:
        # A symbolic link (ELOOP), a socket (ENXIO): say what is there, not the errno's words.
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        why = exc.strerror if stat.S_ISREG(mode) else f"it is {_file_kind(mode)}"
        raise SegmentUnreadable(f"cannot open {path}: {why}", path=str(path)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SegmentUnreadable(f"{path} is {_file_kind(info.st_mode)}, not a segment file",
                                    path=str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def process_name(pid: int) -> str | None:
    """The name of process ``pid``, None when it is gone or hidden. The kernel keeps a name of at
    most 15 bytes; a name cut there is completed from the program the command line names."""
    if not 0 < pid < _PID_LIMIT:
        return None
    try:
        name, _ = _proc_stat(pid)
    except (OSError, ValueError):
        return None
    if len(name) >= _COMM_BYTES:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                program = cmdline.read().split(b"\0", 1)[0].decode("utf-8", "replace")
        except OSError:
            return name
        whole = os.path.basename(program)
        if whole.startswith(name):
            return whole
    return name


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch: the boot time plus the start
    the kernel counts in clock ticks since boot, so whole seconds at best (the boot time is
    whole). None when there is no such process; ``OSError`` when /proc hides it."""
    if not 0 < pid < _PID_LIMIT:
        return None
    try:
        _, fields = _proc_stat(pid)
    except FileNotFoundError:
        return None
    return _boot_time() + int(fields[_STARTTIME_FIELD]) / os.sysconf("SC_CLK_TCK")


# The length of the kernel's process name (TASK_COMM_LEN less the terminating NUL).
_COMM_BYTES = 15
# Where the start time lies among the fields of /proc/<pid>/stat after the name (field 22 of
# proc(5), the name being field 2).
_STARTTIME_FIELD = 22 - 3


def _proc_stat(pid: int) -> tuple[str, list[bytes]]:
    """The name in /proc/<pid>/stat and the fields after it. A name may hold spaces and
    parentheses, so it ends at the last ')'."""
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        raw = stat_file.read()
    start, end = raw.index(b"("), raw.rindex(b")")
    return raw[start + 1:end].decode("utf-8", "replace"), raw[end + 1:].split()


def _boot_time() -> float:
    """When the machine booted, in whole seconds since the epoch (btime in /proc/stat)."""
    with open("/proc/stat", "rb") as proc_stat:
        for line in proc_stat:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise ValueError("/proc/stat states no boot time")


# ---- the open segment ---------------------------------------------------------------------------


class Segment:
    """One segment, open read-only. ``snapshot()`` copies a consistent state out of it.

    The segment is read with ``os.pread`` on its descriptor, never through a mapping: anyone
    who may write the file can shrink it at any moment, and a process that reads a mapped page
    past the file's new end is killed by SIGBUS, however recently it checked the size. A read
    past the end returns fewer bytes instead, which the copy checks. The descriptor stays
    readable after the writer removes the file, so the segment remembers the file's identity
    (device, inode) to tell that the pool is gone. Thread safe: snapshots and ``close()`` are
    serialized.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._trace_written_at: int | None = None  # -1: no ring
        fd, info = _open_segment_file(self.path)
        if info.st_size < _IDENTITY.size:
            os.close(fd)
            raise self._truncated(f"the file has {info.st_size} bytes, fewer than the "
                                  f"{_IDENTITY.size} of the magic and version")
        self._identity = (info.st_dev, info.st_ino)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def for_pool(cls, pool: Any) -> Segment:
        """The segment of a named ``pykvalloc.Pool`` of this process."""
        name = pool.segment_name
        if name is None:
            raise SegmentNotFound(f"{pool!r} has no name, so no statistics segment")
        return cls(SHM_DIR / name.lstrip("/"))

    def close(self) -> None:
        """Closes the segment's descriptor; idempotent. The writer's file is never touched."""
        with self._lock:
            if self._fd is not None:
                self._closer()
                self._fd = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pykvalloc.stats.Segment {self.path}{'' if self._fd is not None else ' closed'}>"

    def removed(self) -> bool:
        """Whether the file this segment opened is no longer at its path (pool destroyed)."""
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return (info.st_dev, info.st_ino) != self._identity

    def snapshot(self, *, check_writer: bool = True,
                 attempts: int = SNAPSHOT_ATTEMPTS) -> Snapshot:
        """A consistent copy of the segment, parsed and bounds-checked.

        With ``check_writer`` (the default), a removed segment raises ``SegmentRemoved`` and a
        dead writer ``DeadWriter``; without it the last published state of either is returned
        (for ``kvalloc ls`` and post-mortems).
        """
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self!r} is closed")
            try:
                data, trace_bounds = self._consistent_copy(self._fd, attempts)
            except SegmentError:
                raise
            except OSError as exc:
                raise SegmentUnreadable(f"cannot read {self.path}: {exc.strerror}",
                                        path=str(self.path)) from exc
        snap = Snapshot(data, self.path, trace_bounds=trace_bounds)
        if check_writer:
            self._check_writer(snap)
        return snap

    def _u64(self, fd: int, at: int) -> int:
        """The u64 at byte ``at`` of the file, read now."""
        raw = os.pread(fd, 8, at)
        if len(raw) < 8:
            raise self._truncated(f"the file ended before byte {at + 8} as it was read")
        return _U64.unpack(raw)[0]

    def _trace_written(self, fd: int, head: bytes, stated: int) -> int | None:
        """The live trace ring's ``written`` (kvalloc_stats.h, "The trace ring"), None when the
        segment has no ring. Where it lies is read once from the section table: the writer lays
        the segment out at creation and never moves a section."""
        if self._trace_written_at is None:
            header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
            at = -1
            for entry in header["sections"][:min(int(header["section_count"]), MAX_SECTIONS)]:
                if int(entry["kind"]) == SECTION_TRACE:
                    offset = int(entry["offset"]) + TRACE_DTYPE.fields["written"][1]
                    if offset % 8 == 0 and offset + 8 <= stated:
                        at = offset
                    break
            self._trace_written_at = at
        if self._trace_written_at < 0:
            return None
        return self._u64(fd, self._trace_written_at)

    def _consistent_copy(self, fd: int, attempts: int) -> tuple[bytes, tuple[int, int] | None]:
        """A copy under the sequence lock, with the trace ring's ``written`` read before and
        after it (None without a ring): the ring is outside the lock since layout 1.3."""
        failure: type[SegmentError] = InconsistentSnapshot
        reason = "the writer was publishing at every attempt"
        for attempt in range(max(1, attempts)):
            if attempt:
                time.sleep(min(_MAX_BACKOFF_S, 1e-5 * (1 << min(attempt, 16))))
            head = os.pread(fd, HEADER_DTYPE.itemsize, 0)
            if len(head) < _IDENTITY.size:
                raise self._truncated(f"the file has {len(head)} bytes, fewer than the "
                                      f"{_IDENTITY.size} of the magic and version")
            magic, major, minor = _IDENTITY.unpack_from(head, 0)
            if magic == 0:
                # The writer stores the magic last when it creates the segment: wait for it.
                failure = BadMagic
                reason = "its magic stayed zero (not yet set up, or not a segment)"
                continue
            if magic != MAGIC:
                raise BadMagic(f"{self.path} is not a kvalloc statistics segment (magic "
                               f"{magic:#018x}, expected {MAGIC:#018x})", path=str(self.path))
            if major != ABI_MAJOR:
                raise UnsupportedVersion(
                    f"{self.path} has layout version {major}.{minor}; this reader understands "
                    f"{ABI_MAJOR}.x (use the pykvalloc that matches the engine's libkvalloc)",
                    path=str(self.path))
            if len(head) < HEADER_DTYPE.itemsize:
                raise self._truncated(f"the file has {len(head)} bytes, fewer than the "
                                      f"{HEADER_DTYPE.itemsize} of the header")
            failure, reason = InconsistentSnapshot, "the writer was publishing at every attempt"
            before = _U64.unpack_from(head, _SEQUENCE_AT)[0]
            if before % 2:
                continue
            # The writer sets segment_size before the magic and never changes it; the copy
            # takes that many bytes (Snapshot checks the copy's own header against them).
            stated = _U64.unpack_from(head, _SEGMENT_SIZE_AT)[0]
            file_size = os.fstat(fd).st_size
            if stated > file_size:
                raise self._truncated(f"the header states {stated} bytes, the file has "
                                      f"{file_size}")
            if stated > MAX_SEGMENT_BYTES:
                raise CorruptSegment(f"{self.path} is corrupt: the header states {stated} bytes, "
                                     f"more than the {MAX_SEGMENT_BYTES} a segment may have",
                                     path=str(self.path))
            # The read side of the sequence lock: sequence (in the header read above), copy,
            # sequence again, each read a system call of its own. Python has no fences; x86-64
            # never reorders loads with loads, and elsewhere the system calls and the
            # interpreter's own atomic operations between these steps order them in practice.
            # The file may shrink at any moment: a read that comes back short is a truncation.
            written_before = self._trace_written(fd, head, stated)
            length = max(stated, HEADER_DTYPE.itemsize)
            data = os.pread(fd, length, 0)
            if len(data) < length:
                raise self._truncated(f"the header states {stated} bytes, the file ended after "
                                      f"{len(data)} as it was copied")
            after = self._u64(fd, _SEQUENCE_AT)
            written_after = self._trace_written(fd, head, stated)
            # A file emptied and written again meanwhile holds zeros where the copy should
            # hold the magic, or another sequence: the copy must begin as the header did.
            if after == before == _U64.unpack_from(data, _SEQUENCE_AT)[0] \
                    and data[:_IDENTITY.size] == head[:_IDENTITY.size]:
                bounds = None if written_before is None else (written_before, written_after)
                return data, bounds
        raise failure(f"no consistent snapshot of {self.path} in {attempts} attempts: {reason}",
                      path=str(self.path))

    def _check_writer(self, snap: Snapshot) -> None:
        if self.removed():
            # The lock went with the file: only the pid can tell a destroyed pool from an
            # ended process now.
            alive = writer_alive(snap.pid, snap.start_time_ns)
            how = "was destroyed" if alive else f"ended with its process {snap.pid}"
            raise SegmentRemoved(f"pool {snap.pool_name!r} {how}: its segment {self.path} was "
                                 "removed", path=str(self.path))
        if not writer_lives(self.path, snap.capabilities, snap.pid, snap.start_time_ns):
            raise DeadWriter(
                f"process {snap.pid}, writer of pool {snap.pool_name!r}, is gone "
                f"(last publish {format_age(snap.heartbeat_age())} ago); its segment "
                f"{self.path} is a leftover that `kvalloc ls --prune` removes",
                path=str(self.path))

    def _truncated(self, why: str) -> TruncatedSegment:
        return TruncatedSegment(f"{self.path} is truncated: {why}", path=str(self.path))


# ---- a snapshot --------------------------------------------------------------------------------


class Snapshot:
    """One consistent copy of a segment, with numpy views over its sections.

    Every array is read-only and views the private copy, never the live file. Sections the
    writer does not publish are None (``kv`` is None also when no KV cache is attached).
    ``absent`` names, per section, the fields a writer of an older minor version did not write:
    they read as zero in the arrays and as None in ``to_dict()``.
    """

    def __init__(self, data: bytes, path: Path | None = None, *,
                 trace_bounds: tuple[int, int] | None = None) -> None:
        """``trace_bounds``: the live ring's ``written`` before and after the copy was taken
        (``Segment.snapshot`` passes them), which say which of its records the copy holds whole;
        without them the copy's own count is trusted, as for a copy of a quiet segment."""
        self.data = data
        self.path = path
        self._trace_bounds = trace_bounds
        self.taken_ns = time.time_ns()
        if len(data) < HEADER_DTYPE.itemsize:
            raise self._truncated(f"{len(data)} bytes, fewer than the {HEADER_DTYPE.itemsize} "
                                  "of the header")
        self.header = np.frombuffer(data, HEADER_DTYPE, count=1)[0]
        h = self.header
        self.abi = (int(h["abi_major"]), int(h["abi_minor"]))
        self.sequence = int(h["sequence"])
        self.pid = int(h["writer_pid"])
        self.pool_name = bytes(h["pool_name"]).split(b"\0", 1)[0].decode("utf-8", "replace")
        self.start_time_ns = int(h["start_time_ns"])
        self.heartbeat_ns = int(h["heartbeat_ns"])
        self.publish_count = int(h["publish_count"])
        self.capabilities = int(h["capabilities"])

        size, header_size = int(h["segment_size"]), int(h["header_size"])
        if size > len(data):
            raise self._truncated(f"the header states {size} bytes, the file has {len(data)}")
        if not HEADER_DTYPE.itemsize <= header_size <= size:
            raise self._corrupt(f"header_size {header_size} is outside "
                                f"[{HEADER_DTYPE.itemsize}, {size}]")
        self.segment_size = size
        self._header_size = header_size
        self._newer = self.abi[1] > ABI_MINOR
        self._sections = self._section_table()
        self.absent: dict[str, tuple[str, ...]] = {}

        self.summary: np.void = self._summary()
        orders = int(self.summary["num_orders"])
        self.num_orders = orders
        self.free_blocks: np.ndarray = self.summary["free_blocks"][:orders]
        self.unusable_index: np.ndarray = self.summary["unusable_index"][:orders]
        self.heapmap: np.void | None = None
        self.cell_state: np.ndarray | None = None
        self.cell_fill: np.ndarray | None = None
        self._read_heapmap()
        self.classes = self._counted(SECTION_CLASSES, CLASS_DTYPE)
        # Before 1.2 an arena entry held other counters (allocations, frees, failures, bytes in
        # use of the pool's one arena) under the same bytes: not read as today's fields.
        self.arenas = (self._counted(SECTION_ARENAS, ARENA_DTYPE)
                       if self.abi[1] >= ARENAS_SINCE_MINOR else None)
        self.slabs = self._slabs()
        latency = self._fixed(SECTION_LATENCY, LATENCY_DTYPE)
        self.latency: dict[str, np.ndarray] | None = (
            None if latency is None else {"alloc": latency["alloc"], "free": latency["free"]})
        kv = self._fixed(SECTION_KV, KV_DTYPE)
        self.kv: np.void | None = kv if kv is not None and kv["present"] else None
        self.trace_written = 0
        self._trace_first = 0  # the oldest record the copy holds whole
        self._ring: np.ndarray | None = self._trace_ring()

    # -- parsing, every offset checked before use ----------------------------------------------

    def _section_table(self) -> dict[int, tuple[int, int]]:
        count = int(self.header["section_count"])
        if count > MAX_SECTIONS:
            raise self._corrupt(f"section_count {count} exceeds the table's {MAX_SECTIONS}")
        sections: dict[int, tuple[int, int]] = {}
        for entry in self.header["sections"][:count]:
            kind, offset, size = int(entry["kind"]), int(entry["offset"]), int(entry["size"])
            if kind == 0:
                continue
            what = SECTION_NAMES.get(kind, f"kind {kind}")
            if offset < self._header_size or offset % 8 or offset > self.segment_size \
                    or size > self.segment_size - offset:
                raise self._corrupt(f"the {what} section [{offset}, +{size}) is not inside the "
                                    f"{self.segment_size}-byte segment past its header, or is "
                                    "misaligned")
            sections.setdefault(kind, (offset, size))
        return sections

    def _fixed(self, kind: int, dtype: np.dtype) -> np.void | None:
        where = self._sections.get(kind)
        if where is None:
            return None
        offset, size = where
        if size < dtype.itemsize:
            return self._older(kind, dtype, offset, 1, size)[0]
        return np.frombuffer(self.data, dtype, count=1, offset=offset)[0]

    def _older(self, kind: int, dtype: np.dtype, offset: int, count: int, written: int
               ) -> np.ndarray:
        """``count`` structs of ``written`` bytes each, fewer than ``dtype`` has: an older minor
        version wrote them before fields were added at their end. A copy in ``dtype`` with the
        fields it did not write zeroed and listed in ``absent``; fewer bytes than the oldest
        layout of the struct is corruption."""
        name = SECTION_NAMES[kind]
        oldest = _OLDEST_SIZE.get(dtype, dtype.itemsize)
        if written < oldest:
            raise self._corrupt(f"the {name} section holds structs of {written} bytes, fewer "
                                f"than the {oldest} of their oldest layout")
        fields = dtype.fields
        present = [f for f in dtype.names if fields[f][1] + fields[f][0].itemsize <= written]
        written_dtype = np.dtype({"names": present, "formats": [fields[f][0] for f in present],
                                  "offsets": [fields[f][1] for f in present],
                                  "itemsize": written})
        entries = np.ndarray((count,), written_dtype, buffer=self.data, offset=offset)
        copy = np.zeros(count, dtype)
        for f in present:
            copy[f] = entries[f]
        copy.flags.writeable = False
        self.absent[name] = tuple(f for f in dtype.names if f not in present)
        return copy

    def _array(self, kind: int, head: int, dtype: np.dtype, count: int, entry_size: int = 0
               ) -> np.ndarray:
        """``count`` entries after ``head`` bytes of a section. A writer of a newer minor version
        may have grown each entry at its end: its stride is then the entry size the section
        states (layout 1.1 on), or else what the section size says."""
        offset, size = self._sections[kind]
        stride = dtype.itemsize
        if entry_size:
            stride = entry_size
        elif self._newer and count:
            stride = (size - head) // count
        if stride < 1 or head + count * stride > size:
            raise self._corrupt(f"the {SECTION_NAMES[kind]} section has {size} bytes, too few "
                                f"for {count} entries of {stride}")
        if stride < dtype.itemsize:
            return self._older(kind, dtype, offset + head, count, stride)
        return np.ndarray((count,), dtype, buffer=self.data, offset=offset + head,
                          strides=(stride,))

    def _summary(self) -> np.void:
        summary = self._fixed(SECTION_SUMMARY, SUMMARY_DTYPE)
        if summary is None:
            raise self._corrupt("it has no summary section")
        if int(summary["num_orders"]) > 48:
            raise self._corrupt(f"num_orders {int(summary['num_orders'])} exceeds 48")
        return summary

    def _read_heapmap(self) -> None:
        head = self._fixed(SECTION_HEAPMAP, HEAPMAP_DTYPE)
        if head is None:
            return
        offset, size = self._sections[SECTION_HEAPMAP]
        cells = int(head["cells"])
        start = size - 2 * cells if self._newer else HEAPMAP_DTYPE.itemsize
        if start < HEAPMAP_DTYPE.itemsize or start + 2 * cells > size:
            raise self._corrupt(f"the heap map section has {size} bytes, too few for "
                                f"{cells} cells")
        self.heapmap = head
        self.cell_state = np.frombuffer(self.data, np.uint8, cells, offset + start)
        self.cell_fill = np.frombuffer(self.data, np.uint8, cells, offset + start + cells)

    def _counted(self, kind: int, dtype: np.dtype) -> np.ndarray | None:
        head = self._fixed(kind, COUNTED_DTYPE)
        if head is None:
            return None
        return self._array(kind, COUNTED_DTYPE.itemsize, dtype, int(head["count"]), int(head["entry_size"]))

    def _slabs(self) -> np.ndarray | None:
        head = self._fixed(SECTION_SLABS, SLABS_DTYPE)
        if head is None:
            return None
        count, capacity = int(head["count"]), int(head["capacity"])
        if count > capacity:
            raise self._corrupt(f"the slabs section counts {count} slabs in room for {capacity}")
        return self._array(SECTION_SLABS, SLABS_DTYPE.itemsize, SLAB_DTYPE, capacity)[:count]

    def _trace_ring(self) -> np.ndarray | None:
        """The trace ring as the writer stores it (record i at i % capacity), bounds-checked but
        not reordered: ``trace_tail`` orders only the records asked for."""
        head = self._fixed(SECTION_TRACE, TRACE_DTYPE)
        if head is None:
            return None
        capacity, written = int(head["capacity"]), int(head["written"])
        ring = self._array(SECTION_TRACE, TRACE_DTYPE.itemsize, RECORD_DTYPE, capacity,
                           int(head["entry_size"]))
        # The records whole in the copy (kvalloc_stats.h, "The trace ring"): below the count
        # read before the copy, and from the last one the writer may have begun meanwhile less
        # a lap of the ring.
        first = written - capacity
        if self._trace_bounds is not None:
            before, after = self._trace_bounds
            written, first = before, max(before, after + 1) - capacity
        self.trace_written = written
        self._trace_first = max(0, first)
        return ring

    @property
    def has_trace(self) -> bool:
        """Whether the writer publishes a trace ring (it may hold no record yet)."""
        return self._ring is not None

    def trace_tail(self, newest: int | None = None) -> np.ndarray | None:
        """The newest ``newest`` records of the ring (all it holds when None), oldest first; None
        when the writer publishes no ring. Only those records are copied: a ring may hold
        hundreds of thousands, of which a screen shows a few."""
        ring = self._ring
        if ring is None:
            return None
        capacity = len(ring)
        kept = max(0, min(self.trace_written - self._trace_first, capacity))
        if newest is not None:
            kept = min(kept, max(0, newest))
        # Record i of the ring sits at i % capacity.
        order = np.arange(self.trace_written - kept, self.trace_written, dtype=np.uint64)
        return ring[(order % np.uint64(max(capacity, 1))).astype(np.intp)]

    @functools.cached_property
    def trace(self) -> np.ndarray | None:
        """The whole ring, oldest first (``trace_tail()``); None without one."""
        return self.trace_tail()

    def _corrupt(self, why: str) -> CorruptSegment:
        return CorruptSegment(f"{self.path or 'segment'} is corrupt: {why}",
                              path=str(self.path) if self.path else None)

    def _truncated(self, why: str) -> TruncatedSegment:
        return TruncatedSegment(f"{self.path or 'segment'} is truncated: {why}",
                                path=str(self.path) if self.path else None)

    # -- figures derived from the copy ---------------------------------------------------------

    def heartbeat_age(self, now_ns: int | None = None) -> float:
        """Seconds since the writer's latest publish."""
        return max(0, (now_ns or self.taken_ns) - self.heartbeat_ns) / 1e9

    def uptime(self, now_ns: int | None = None) -> float:
        """Seconds since the pool was created."""
        return max(0, (now_ns or self.taken_ns) - self.start_time_ns) / 1e9

    @property
    def capacity(self) -> int:
        return int(self.summary["capacity"])

    @property
    def bytes_in_use(self) -> int:
        return int(self.summary["bytes_in_use"])

    @property
    def use_fraction(self) -> float:
        """``bytes_in_use`` (usable bytes of live allocations) over the capacity."""
        return self.bytes_in_use / self.capacity if self.capacity else 0.0

    @property
    def fragmentation(self) -> float:
        return float(self.summary["fragmentation"])

    def block_size(self, order: int) -> int:
        return int(self.summary["min_block"]) << order

    def latency_samples(self, kind: str) -> int:
        return int(self.latency[kind].sum()) if self.latency is not None else 0

    def latency_percentiles(self, kind: str, quantiles: tuple[float, ...] = (0.5, 0.99, 0.999)
                            ) -> dict[float, int] | None:
        """Upper bounds (ns) of the log2 buckets that hold each quantile of ``kind`` ("alloc"
        or "free") calls; None without samples."""
        return None if self.latency is None else latency_percentiles(self.latency[kind], quantiles)

    def calls_are_timed(self) -> bool:
        """Whether the latency histograms count calls: the library times calls, every one of
        them, only in a pool created with trace on (the segment says so in its capabilities);
        otherwise it reads no clock and the histograms stay empty."""
        return bool(self.capabilities & CAP_TRACE_ALL)

    @property
    def hit_rate(self) -> float | None:
        """KV prefix-cache hits over queried tokens; None without a KV cache or queries."""
        if self.kv is None or not int(self.kv["query_tokens"]):
            return None
        return int(self.kv["hit_tokens"]) / int(self.kv["query_tokens"])

    def heap_cells(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The heap map fitted to ``count`` cells (states, fills); see ``downsample_cells``."""
        if self.cell_state is None or self.cell_fill is None:
            return np.zeros(0, np.uint8), np.zeros(0, np.uint8)
        return downsample_cells(self.cell_state, self.cell_fill, count)

    def trace_records(self, newest: int | None = None) -> Iterator[dict[str, Any]]:
        """The recent-operations ring, oldest first, as plain dicts: its newest ``newest``
        records, or all of them (see ``trace_tail``)."""
        records = self.trace if newest is None else self.trace_tail(newest)
        if records is None:
            return
        for record in records:
            offset = int(record["offset"])
            yield {"time_ns": int(record["time_ns"]), "op": OP_NAMES.get(int(record["op"]),
                                                                          str(int(record["op"]))),
                   "status": int(record["status"]),
                   "status_name": STATUS_NAMES.get(int(record["status"]),
                                                   str(int(record["status"]))),
                   "offset": None if offset == NO_OFFSET else offset,
                   "size": int(record["size"]), "thread": int(record["thread"])}

    def to_dict(self, *, trace: bool = False) -> dict[str, Any]:
        """Everything in the snapshot as JSON-ready Python values (``kvalloc dump --json``)."""
        summary = {name: int(self.summary[name]) for name in SUMMARY_COUNTERS}
        summary.update(page_kind=int(self.summary["page_kind"]), num_orders=self.num_orders,
                       fragmentation=self.fragmentation,
                       free_blocks=[int(n) for n in self.free_blocks],
                       unusable_index=[float(x) for x in self.unusable_index])
        # The 1.1 fields are None when the writer predates them (``absent`` says so); numa_node
        # is None also for a region bound to no node, as in ``Pool.stats()``.
        absent = self.absent.get("summary", ())
        summary.update({name: None if name in absent else int(self.summary[name])
                        for name in SUMMARY_ADDED_1_1})
        if summary["numa_node"] is not None and summary["numa_node"] < 0:
            summary["numa_node"] = None
        result: dict[str, Any] = {
            "pool": self.pool_name, "pid": self.pid, "segment": str(self.path),
            "abi": f"{self.abi[0]}.{self.abi[1]}", "sequence": self.sequence,
            "publish_count": self.publish_count, "start_time_ns": self.start_time_ns,
            "heartbeat_ns": self.heartbeat_ns, "taken_ns": self.taken_ns,
            "summary": summary,
        }
        if self.heapmap is not None:
            assert self.cell_state is not None and self.cell_fill is not None
            result["heapmap"] = {
                "cells": int(self.heapmap["cells"]),
                "cell_blocks": int(self.heapmap["cell_blocks"]),
                "cell_bytes": int(self.heapmap["cell_bytes"]),
                "state": self.cell_state.tolist(), "fill": self.cell_fill.tolist()}
        if self.classes is not None:
            result["classes"] = _records(self.classes)
        if self.slabs is not None:
            result["slabs"] = [dict(entry, strip=list(entry["strip"]))
                               for entry in _records(self.slabs)]
        if self.arenas is not None:
            result["arenas"] = _records(self.arenas, self.absent.get("arenas", ()))
        if self.latency is not None:
            result["latency"] = {
                kind: {"buckets": [int(n) for n in self.latency[kind]],
                       "samples": self.latency_samples(kind),
                       **{f"p{_quantile_label(q)}_ns": bound for q, bound in
                          (self.latency_percentiles(kind) or {}).items()}}
                for kind in ("alloc", "free")}
        result["kv"] = None if self.kv is None else {
            "block_tokens": int(self.kv["block_tokens"]),
            **{name: int(self.kv[name]) for name in KV_COUNTERS}}
        if trace:
            result["trace_written"] = self.trace_written
            result["trace"] = list(self.trace_records())
        return json_ready(result)


def _records(array: np.ndarray, absent: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    names = [name for name in array.dtype.names if name != "reserved"]
    return [{name: None if name in absent else _plain(entry[name]) for name in names}
            for entry in array]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value.item()


def _quantile_label(q: float) -> str:
    # 0.5 -> "50", 0.99 -> "99", 0.999 -> "999"
    return f"{q * 100:g}".replace(".", "")


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


def downsample_cells(state: np.ndarray, fill: np.ndarray, count: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Fits heap-map cells into ``count`` cells (at most as many as there are): each output
    cell takes the most common non-free state among its inputs (free only if all are free, so
    a small live block stays visible) and their mean fill."""
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
    busy = votes[:, 1:]
    out_state = np.where(busy.sum(axis=1) == 0, CELL_FREE, 1 + busy.argmax(axis=1))
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
