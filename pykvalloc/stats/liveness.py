"""Whether the writer of a segment lives, by one rule (``writer_lives``) for ``kvalloc ls``,
``dump`` and ``top``: by its liveness lock when the segment says the writer keeps one (that holds
across pid namespaces), else from its pid and that pid's start time (against reuse), read from
/proc. Never from the heartbeat: a live pool that makes no slow-path calls publishes nothing, so
an old heartbeat with a live writer means idle, not dead."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import numpy as np

from .files import OPEN_FLAGS, open_segment_file
from .layout import (
    ABI_MAJOR,
    CAP_LIVENESS_LOCK,
    CAPABILITIES_AT,
    CAPABILITIES_END,
    HEADER_DTYPE,
    IDENTITY,
    MAGIC,
    U64,
)

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
        fd = os.open(path, OPEN_FLAGS)
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
    when it cannot be opened or is not a regular file (``open_segment_file``)."""
    fd, _ = open_segment_file(Path(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        head = os.pread(fd, HEADER_DTYPE.itemsize, 0)
        capabilities, start_time_ns = 0, None
        if len(head) >= CAPABILITIES_END and U64.unpack_from(head, 0)[0] == MAGIC:
            capabilities = U64.unpack_from(head, CAPABILITIES_AT)[0]
            major = IDENTITY.unpack_from(head, 0)[1]
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
