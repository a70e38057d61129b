"""Finding segments: the files named like one in a directory (``/dev/shm``), and the one a pid,
a pool name, a file name or a path names."""

from __future__ import annotations

import os
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import AmbiguousSegment, SegmentNotFound, SegmentUnreadable
from .files import SHM_DIR, open_segment_file
from .layout import CAPABILITIES_AT, CAPABILITIES_END, MAGIC, U64
from .liveness import writer_alive, writer_lives

# The pid in a segment's file name is the writer's; the pool name follows the library's rule.
_FILE_RE = re.compile(r"kvalloc\.([0-9]{1,10})\.([A-Za-z0-9_.-]{1,63})\Z")
# A target that can name a writer's pid: as many digits as a file name's pid may have.
_PID_TEXT = re.compile(r"[0-9]{1,10}\Z")


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
            fd, _ = open_segment_file(self.path)
        except SegmentNotFound:
            return False
        except SegmentUnreadable:
            return writer_alive(self.pid)
        try:
            head = os.pread(fd, CAPABILITIES_END, 0)
        finally:
            os.close(fd)
        capabilities = 0
        if len(head) == CAPABILITIES_END and U64.unpack_from(head, 0)[0] == MAGIC:
            capabilities = U64.unpack_from(head, CAPABILITIES_AT)[0]
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
            raise SegmentNotFound(f"no segment {_shown(target)}", path=target)
        found = SegmentFile.from_path(path)
        if found is None:
            raise SegmentNotFound(f"{_shown(target)} is not named like a kvalloc segment "
                                  "(kvalloc.<pid>.<pool name>)", path=target)
        return found
    segments = list_segments(directory)
    matches = [s for s in segments if s.path.name == target]
    if not matches and _PID_TEXT.match(target):
        matches = [s for s in segments if s.pid == int(target)]
    if not matches:
        matches = [s for s in segments if s.name == target]
    if len(matches) > 1:
        alive = [s for s in matches if s.process_alive()]
        matches = alive or matches
    if not matches:
        raise SegmentNotFound(f"no pool segment matches {_shown(target)} in {directory} "
                              f"(segments there: {_a_few(segments)})")
    if len(matches) > 1:
        raise AmbiguousSegment(f"{_shown(target)} matches {len(matches):,} segments: "
                               f"{_a_few(matches)}; name one of them")
    return matches[0]


# An error names at most this many segments: a /dev/shm may hold thousands.
_NAMED_IN_ERRORS = 5

# A target as an error shows it: whole up to the longest path a segment's name makes (a pool name
# of 63 characters, a pid of 10 digits, /dev/shm), cut short beyond, as a 5,000-digit one is.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = 100


def _shown(target: str) -> str:
    return _SHOWN.repr(target)


def _a_few(segments: list[SegmentFile]) -> str:
    """The first ``_NAMED_IN_ERRORS`` segments' file names and how many more there are."""
    if not segments:
        return "none"
    named = ", ".join(s.path.name for s in segments[:_NAMED_IN_ERRORS])
    more = len(segments) - _NAMED_IN_ERRORS
    return f"{named} and {more:,} more" if more > 0 else named
