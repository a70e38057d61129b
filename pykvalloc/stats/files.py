"""Opening a file that is named like a segment, without trusting what is at its path: the file
is opened read-only, never through a symbolic link and never blocking (a FIFO named like a segment
must not hang the reader), and must be a regular file. ``SegmentNotFound`` says there is no file,
``SegmentUnreadable`` that it cannot be opened or is no regular file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import SegmentNotFound, SegmentUnreadable

#: Where pools publish their segments.
SHM_DIR = Path("/dev/shm")

# Read-only, close-on-exec; never through a symbolic link, and never blocking: opening a FIFO
# for reading would wait for a writer that may never come.
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def open_segment_file(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path`` (``OPEN_FLAGS``) and its status; the caller
    closes it. ``SegmentNotFound`` when there is no file, ``SegmentUnreadable`` when it cannot be
    opened or is not a regular file (a directory, a FIFO, a device, a symbolic link)."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        raise SegmentNotFound(f"no segment {path}", path=str(path)) from None
    except OSError as exc:
        # A symbolic link (ELOOP), a socket (ENXIO): say what is there, not the errno's words.
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        why = exc.strerror if stat.S_ISREG(mode) else f"it is {file_kind(mode)}"
        raise SegmentUnreadable(f"cannot open {path}: {why}", path=str(path)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SegmentUnreadable(f"{path} is {file_kind(info.st_mode)}, not a segment file",
                                    path=str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO"), for a message."""
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"
