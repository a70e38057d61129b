"""What the inspector knows about one pool: its segment, the latest snapshot, a short history.

The app owns one ``PoolWatch`` per pool it has shown. Snapshots are taken on a worker thread
(``take``, which opens the segment under a lock) and handed to ``record`` on the UI thread: every
other field changes on the UI thread only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

from pykvalloc.errors import (
    BadMagic,
    SegmentError,
    SegmentNotFound,
    UnsupportedVersion,
    WriterGone,
)
from pykvalloc.stats import Segment, SegmentFile, Snapshot, list_segments, process_name

HISTORY = 600  # samples kept for the sparklines: 10 minutes at the default interval

# Errors that another read of the same file cannot mend: it is not a segment, or one of a
# layout this reader does not understand. The file is tried again, slowly, in case another
# takes its place.
LASTING_ERRORS = (BadMagic, UnsupportedVersion)
LASTING_RETRY_S = 5.0


def _rate(hits: int, looked_up: int) -> float | None:
    """The hit rate between two snapshots' counters. They only grow in one cache; a drop is
    another cache (or a reset): no figure then, nor when nothing was looked up."""
    return hits / looked_up if looked_up > 0 and 0 <= hits <= looked_up else None


class PoolWatch:
    """One pool's segment and what has been read from it."""

    def __init__(self, found: SegmentFile) -> None:
        self.file = found
        self.segment: Segment | None = None
        self.last: Snapshot | None = None
        self.process: str | None = None
        self.use: deque[float] = deque(maxlen=HISTORY)
        self.fragmentation: deque[float] = deque(maxlen=HISTORY)
        # A KV cache's: the prefix-cache hit rate of the tokens looked up since the previous
        # snapshot (None when none were), and evictions per second since then.
        self.kv_use: deque[float] = deque(maxlen=HISTORY)
        self.hit_rate: deque[float | None] = deque(maxlen=HISTORY)
        # The same apart for first admissions and re-admissions (a writer of layout 1.5 on).
        self.first_hit_rate: deque[float | None] = deque(maxlen=HISTORY)
        self.readmit_hit_rate: deque[float | None] = deque(maxlen=HISTORY)
        self.evictions: deque[float] = deque(maxlen=HISTORY)
        # The handle of the sequence or pin whose block table is shown (None: the longest).
        self.selected_sequence: int | None = None
        self.ended: str | None = None   # why the pool publishes no more, once it does not
        self.problem: str | None = None  # the latest read error (a torn copy passes; see lasting)
        self.lasting = False            # whether that error will not pass by itself
        self._retry_at = 0.0            # time.monotonic() before which no read is tried
        self._lock = threading.Lock()   # close() waits for a snapshot under way
        self._closed = False

    @property
    def path(self) -> Path:
        return self.file.path

    def due(self) -> bool:
        """Whether a snapshot should be taken now: not once the pool ended, and only every
        ``LASTING_RETRY_S`` after an error that will not pass by itself."""
        return not self.ended and time.monotonic() >= self._retry_at

    def take(self) -> Snapshot | None:
        """Reads a snapshot (any thread); raises the reader's SegmentError. None once closed."""
        with self._lock:
            if self._closed:
                return None
            if self.segment is None:
                self.segment = Segment(self.path)
            return self.segment.snapshot()

    def record(self, snap: Snapshot | None, error: SegmentError | None) -> None:
        """Keeps a snapshot or the reason there is none (UI thread)."""
        if snap is not None:
            if self.process is None:
                self.process = process_name(snap.pid)
            self._record_kv(self.last, snap)
            self.last = snap
            self.problem = None
            self.lasting = False
            self.use.append(snap.use_fraction)
            self.fragmentation.append(snap.fragmentation)
        elif isinstance(error, (WriterGone, SegmentNotFound)):
            self.ended = str(error)
            # A destroyed pool's memory is freed only when the last descriptor or mapping of
            # its file goes; the snapshot kept in ``last`` is all the screen needs.
            self._release(forget=False)
        elif error is not None:
            self.problem = str(error)
            self.lasting = isinstance(error, LASTING_ERRORS)
            if self.lasting:
                self._retry_at = time.monotonic() + LASTING_RETRY_S
                self._release(forget=True)  # the next try opens the file at the path then

    def _record_kv(self, before: Snapshot | None, snap: Snapshot) -> None:
        if snap.kv is None or snap.kv_use is None:
            return
        self.kv_use.append(snap.kv_use[0])
        if before is None or before.kv is None:
            return

        def grown(name: str) -> int:
            assert snap.kv is not None and before.kv is not None
            return int(snap.kv[name]) - int(before.kv[name])

        hits, looked_up = grown("hit_tokens"), grown("query_tokens")
        self.hit_rate.append(_rate(hits, looked_up))
        if snap.hit_rates is not None and before.hit_rates is not None:
            again_hits, again_looked_up = grown("readmit_hit_tokens"), grown("readmit_query_tokens")
            self.first_hit_rate.append(_rate(hits - again_hits, looked_up - again_looked_up))
            self.readmit_hit_rate.append(_rate(again_hits, again_looked_up))
        seconds = (snap.taken_ns - before.taken_ns) / 1e9
        evicted = int(snap.kv["evictions"]) - int(before.kv["evictions"])
        self.evictions.append(evicted / seconds if seconds > 0 and evicted >= 0 else 0.0)

    def replaced(self) -> bool:
        """Whether, after the pool ended, a new pool publishes at its path: a pool destroyed and
        created again by the same process under the same name has the same segment path, but
        the file is another (``Segment.removed``) and its writer lives."""
        if not self.ended:
            return False
        if self.segment is not None and not self.segment.removed():
            return False  # the same file: a killed writer's leftover
        return self.file.process_alive()

    def _release(self, forget: bool) -> None:
        # Unless forgotten, the Segment stays, closed, for the identity of the file it opened
        # (``replaced``).
        with self._lock:
            if self.segment is not None:
                self.segment.close()
                if forget:
                    self.segment = None

    def close(self) -> None:
        with self._lock:
            self._closed = True  # no snapshot starts after this; one under way finishes first
        self._release(forget=False)


def live_segments() -> list[SegmentFile]:
    """Segments whose writer process runs, by pid then name. Raises the ``SegmentError`` of a
    segment directory that cannot be listed."""
    return [found for found in list_segments() if found.process_alive()]


def named(target: str, segments: list[SegmentFile]) -> list[SegmentFile]:
    """The segments that ``target`` names, by ``find_segment``'s rules: a file name, else a
    writer's pid, else a pool name."""
    found = [s for s in segments if s.path.name == target]
    if not found and target.isascii() and target.isdigit():
        found = [s for s in segments if s.pid == int(target)]
    return found or [s for s in segments if s.name == target]
