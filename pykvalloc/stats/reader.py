"""``Segment``: one segment file, open read-only, and the consistent copies taken out of it.

The file is copied with ``os.pread``, never mapped: whoever can write the file can shrink it, and
reading a mapped page past the new end kills the reader with SIGBUS, where ``pread`` returns short
(``TruncatedSegment``). ``multiprocessing.shared_memory`` is not used: its resource tracker unlinks
segments it believes it created, which would delete the engine's segment under it. A copy is
taken under the writer's sequence lock (equal, even sequence before and after it), retried a
bounded number of times; after that ``InconsistentSnapshot`` is raised, and torn data is never
returned. A copy takes the bytes the header states, at most ``MAX_SEGMENT_BYTES``, not the whole
file.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
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
from .discovery import find_segment
from .figures import format_age
from .files import SHM_DIR, open_segment_file
from .layout import (
    ABI_MAJOR,
    HEADER_DTYPE,
    IDENTITY,
    MAGIC,
    MAX_SECTIONS,
    SECTION_TRACE,
    SEGMENT_SIZE_AT,
    SEQUENCE_AT,
    TRACE_DTYPE,
    U64,
    struct_fields,
)
from .liveness import writer_alive, writer_lives
from .snapshot import Snapshot

# The most bytes of a segment this reader copies. A writer's largest is about 5.3 MB, nearly
# all of it its slab table (80 bytes a slab, at most KVA_SHM_SLABS_MAX = 65,536 of them; the
# heap map at most 16,384 cells, the trace ring 1,024 records): a header that states more
# than this, which a planted file may, is not a segment, and a copy of it would cost every
# reader its size in memory and time at each refresh.
MAX_SEGMENT_BYTES = 16 << 20

# How hard snapshot() tries before InconsistentSnapshot: a publish takes microseconds, a large
# pool's about a millisecond, so this rides out a writer publishing back to back yet gives up on
# a stuck one in about 0.1 s.
SNAPSHOT_ATTEMPTS = 64
_MAX_BACKOFF_S = 0.002
# Reads of a header whose magic is zero before it is given up on: a writer stores the magic
# within microseconds of making the file, so a zero that outlasts these is no segment being set
# up (a planted file would otherwise cost every reader the whole backoff, 0.1 s each).
_ZERO_MAGIC_ATTEMPTS = 3


def open_segment(target: str, directory: Path = SHM_DIR) -> Segment:
    """``Segment(find_segment(target).path)``."""
    return Segment(find_segment(target, directory).path)


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
        fd, info = open_segment_file(self.path)
        if info.st_size < IDENTITY.size:
            os.close(fd)
            raise self._truncated(f"the file has {info.st_size} bytes, fewer than the "
                                  f"{IDENTITY.size} of the magic and version")
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
        value: int = U64.unpack(raw)[0]
        return value

    def _trace_written(self, fd: int, head: bytes, stated: int) -> int | None:
        """The live trace ring's ``written`` (kvalloc_stats.h, "The trace ring"), None when the
        segment has no ring. Where it lies is read once from the section table: the writer lays
        the segment out at creation and never moves a section."""
        if self._trace_written_at is None:
            header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
            at = -1
            for entry in header["sections"][:min(int(header["section_count"]), MAX_SECTIONS)]:
                if int(entry["kind"]) == SECTION_TRACE:
                    offset = int(entry["offset"]) + struct_fields(TRACE_DTYPE)["written"][1]
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
        zero_magic = 0
        for attempt in range(max(1, attempts)):
            if zero_magic == _ZERO_MAGIC_ATTEMPTS:
                break
            if attempt:
                time.sleep(min(_MAX_BACKOFF_S, 1e-5 * (1 << min(attempt, 16))))
            head = os.pread(fd, HEADER_DTYPE.itemsize, 0)
            if len(head) < IDENTITY.size:
                raise self._truncated(f"the file has {len(head)} bytes, fewer than the "
                                      f"{IDENTITY.size} of the magic and version")
            magic, major, minor = IDENTITY.unpack_from(head, 0)
            if magic == 0:
                # The writer stores the magic last when it creates the segment: wait a little.
                zero_magic += 1
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
            before = U64.unpack_from(head, SEQUENCE_AT)[0]
            if before % 2:
                continue
            # The writer sets segment_size before the magic and never changes it; the copy
            # takes that many bytes (Snapshot checks the copy's own header against them).
            stated = U64.unpack_from(head, SEGMENT_SIZE_AT)[0]
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
            after = self._u64(fd, SEQUENCE_AT)
            written_after = self._trace_written(fd, head, stated)
            # A file emptied and written again meanwhile holds zeros where the copy should
            # hold the magic, or another sequence: the copy must begin as the header did.
            if after == before == U64.unpack_from(data, SEQUENCE_AT)[0] \
                    and data[:IDENTITY.size] == head[:IDENTITY.size]:
                bounds = (None if written_before is None or written_after is None else
                          (written_before, written_after))
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
