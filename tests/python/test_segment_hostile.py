"""Whatever a local user puts in /dev/shm under a segment's name, the readers neither hang, follow
a link, read more than a segment may hold, nor crash: each kind of thing is a specific error (or,
for a file longer than its segment, a reading of the segment alone), ``kvalloc ls`` lists it,
``--prune`` leaves what is no segment file and says why, and ``kvalloc top`` reports it and goes
on. Each thing is named for a writer that is gone (a pid no process has), so that prune would
remove a segment of that name.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from stats_writer import absent_pid, entry_for, prune_lock, segment_bytes, unique_name
from support import clean_env

from pykvalloc import stats
from kvalloc_cli import main
from pykvalloc.errors import DeadWriter, SegmentUnreadable
from kvalloc_tui.app import KvallocTop
from kvalloc_tui.widgets import Banner

HUGE = 4 << 30  # a sparse file longer than a segment may be (MAX_SEGMENT_BYTES)

# What each kind is called in the readers' messages.
KIND_NAMES = {"fifo": "a FIFO", "socket": "a socket", "directory": "a directory",
              "symlink": "a symbolic link", "dangling symlink": "a symbolic link"}


@contextmanager
def planted(kind: str) -> Iterator[Path]:
    """A thing of ``kind`` at a segment's path in SHM_DIR; removed afterwards."""
    pid = absent_pid()
    path = stats.SHM_DIR / f"kvalloc.{pid}.{unique_name(kind.replace(' ', '-'))}"
    target = stats.SHM_DIR / f"kvalloc-test-target-{unique_name()}"  # no segment's name
    held = None
    try:
        if kind == "fifo":
            os.mkfifo(path)  # an open for reading would wait for a writer that never comes
        elif kind == "socket":
            held = socket.socket(socket.AF_UNIX)
            held.bind(str(path))
        elif kind == "directory":
            path.mkdir()
        elif kind == "symlink":
            target.write_bytes(segment_bytes(writer_pid=pid))
            path.symlink_to(target)
        elif kind == "dangling symlink":
            path.symlink_to(target)
        elif kind == "huge":
            # A real segment's bytes at its start, the rest a hole: the header states the
            # segment's size, far less than the file's.
            path.write_bytes(segment_bytes(writer_pid=pid))
            os.truncate(path, HUGE)
        yield path
    finally:
        if held is not None:
            held.close()
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        target.unlink(missing_ok=True)


def command(*argv: str) -> tuple[int, str, str]:
    """``kvalloc ARGV`` in this process: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kind", list(KIND_NAMES))
def test_what_is_no_segment_file_is_unreadable_listed_and_left_by_prune(kind):
    with prune_lock(exclusive=True), planted(kind) as path:
        said = KIND_NAMES[kind]
        with pytest.raises(SegmentUnreadable, match=said) as info:
            stats.Segment(path)
        assert info.value.path == str(path)
        assert not stats.SegmentFile.from_path(path).process_alive()  # by the name's pid

        status, _, err = command("dump", str(path))
        assert status == 1 and err.startswith("kvalloc dump: ") and err.count("\n") == 1
        assert str(path) in err and said in err and "Traceback" not in err

        status, out, err = command("ls", "--json")
        assert status == 0, err
        entry = entry_for(json.loads(out), path)
        assert entry["state"] == "unreadable" and not entry["alive"]
        assert entry["problem_kind"] == "unreadable" and said in entry["problem"]

        status, out, err = command("ls", "--json", "--prune")
        assert status == 0
        assert os.path.lexists(path) and str(path) not in json.loads(out)["removed"]
        assert "kvalloc ls: not removed: " in err and str(path) in err and said in err
        assert entry_for(json.loads(out), path)["state"] == "unreadable"


def test_a_huge_file_is_read_only_as_far_as_its_header_states_and_pruned_when_dead():
    with prune_lock(exclusive=True), planted("huge") as path:
        stated = len(segment_bytes())
        with stats.Segment(path) as segment:
            assert len(segment.snapshot(check_writer=False).data) == stated
            with pytest.raises(DeadWriter):
                segment.snapshot()
        status, out, err = command("ls", "--json")
        assert status == 0 and entry_for(json.loads(out), path)["state"] == "dead"
        status, out, err = command("ls", "--json", "--prune")
        assert status == 0 and str(path) in json.loads(out)["removed"]
        assert not path.exists()


# A reader that may not read the file it meets. Run by root, it becomes the unprivileged user
# 65534 (argv[2] "drop"), having imported all it needs while it still could (the interpreter
# may live where that user cannot read).
AS_ANOTHER_USER = r"""
import contextlib, io, json, os, sys
from pykvalloc import stats
from kvalloc_cli import build_parser, main
from pykvalloc.errors import SegmentError

path = sys.argv[1]
build_parser()  # imports every subcommand
if sys.argv[2] == "drop":
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)

def command(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()

def entry(out):
    return next(e for e in json.loads(out)["segments"] if e["segment"] == path)

results = {}
try:
    stats.Segment(path)
    results["api"] = "read"
except SegmentError as exc:
    results["api"] = f"{type(exc).__name__}: {exc}"
results["dump"] = command("dump", path)
status, out, err = command("ls", "--json")
results["ls"] = [status, entry(out)]
status, out, err = command("ls", "--json", "--prune")
results["prune"] = [status, json.loads(out)["removed"], err]
print(json.dumps(results))
"""


def test_a_file_of_another_owner_is_unreadable_listed_and_left():
    # Run as root, the reader is another user and the file is the planter's alone (0600); run
    # as another user, the reader is the owner of a file no one may read (0000), which it meets
    # the same way.
    root = os.geteuid() == 0
    with prune_lock(exclusive=True), planted("huge") as path:
        os.truncate(path, len(segment_bytes()))
        os.chmod(path, 0o600 if root else 0)
        done = subprocess.run([sys.executable, "-c", AS_ANOTHER_USER, str(path),
                               "drop" if root else "stay"],
                              capture_output=True, text=True, env=clean_env(), timeout=120)
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout)
        assert results["api"] == f"SegmentUnreadable: cannot open {path}: Permission denied"
        status, _, err = results["dump"]
        assert status == 1 and err == f"kvalloc dump: cannot open {path}: Permission denied\n"
        status, entry = results["ls"]
        assert status == 0 and entry["state"] == "unreadable" and not entry["alive"]
        status, removed, err = results["prune"]
        assert status == 0 and str(path) not in removed
        assert f"not removed: cannot open {path}: Permission denied" in err
        assert path.exists() and os.stat(path).st_uid == os.geteuid()


@pytest.mark.parametrize("kind", ["fifo", "socket", "symlink"])
def test_top_reports_what_is_no_segment_file_and_goes_on(kind):
    async def scenario(path: Path) -> None:
        app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
        async with app.run_test(size=(100, 24)) as pilot:
            banner = app.screen.query_one(Banner)
            for _ in range(3000):  # 60 s at least: a bound against a hang only
                if banner.message:
                    break
                await pilot.pause(0.02)
            assert banner.message, "hung: no banner within 60 s"
            assert banner.message.startswith("Read failed, retrying: ") and str(path) in banner.message
            assert KIND_NAMES[kind] in banner.message
            await pilot.pause(0.3)  # more ticks, each trying again
            assert app.is_running and app.current.ended is None

    with planted(kind) as path:
        asyncio.run(scenario(path))
