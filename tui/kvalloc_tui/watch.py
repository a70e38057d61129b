"""What the inspector knows about one pool: its segment, the latest snapshot, a short history.

The app owns one ``PoolWatch`` per pool it has shown. Snapshots are taken on a worker thread
(``take``, which opens the segment under a lock) and handed to ``record`` on the UI thread: every
other field changes on the UI thread only.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

from pykvalloc.errors import SegmentError, SegmentNotFound, WriterGone
from pykvalloc.stats import Segment, SegmentFile, Snapshot, list_segments, process_name

HISTORY = 600  # samples kept for the sparklines: 10 minutes at the default interval


class PoolWatch:
    """One pool's segment and what has been read from it."""

    def __init__(self, found: SegmentFile) -> None:
        self.file = found
        self.segment: Segment | None = None
        self.last: Snapshot | None = None
        self.process: str | None = None
        self.use: deque[float] = deque(maxlen=HISTORY)
        self.fragmentation: deque[float] = deque(maxlen=HISTORY)
        self.ended: str | None = None   # why the pool publishes no more, once it does not
        self.problem: str | None = None  # the latest read error that may pass (a torn copy)
        self._lock = threading.Lock()   # close() waits for a snapshot under way
        self._closed = False

    @property
    def path(self) -> Path:
        return self.file.path

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
            self.last = snap
            self.problem = None
            self.use.append(snap.use_fraction)
            self.fragmentation.append(snap.fragmentation)
        elif isinstance(error, (WriterGone, SegmentNotFound)):
            self.ended = str(error)
        elif error is not None:
            self.problem = f"{type(error).__name__}: {error}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self.segment is not None:
                self.segment.close()


def live_segments() -> list[SegmentFile]:
    """Segments whose writer process runs, by pid then name."""
    return [found for found in list_segments() if found.process_alive()]
