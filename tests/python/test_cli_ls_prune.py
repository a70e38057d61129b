"""``kvalloc ls --prune`` removes only the very file it judged dead, and only while it is still dead.

Between the listing, which judges every segment, and the removal, the path of a dead writer's
segment may come to name a live pool's: a process that got the dead writer's pid creates a pool
of the same name (the library removes the leftover and publishes its own segment there). Prune
must then leave the live segment alone. The interleavings are made deterministic: the test
steps in between judging and removing, through ``ls.describe`` or the hook of ``ls.prune``.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stats_writer import entry_for, listing, prune_lock, segment_bytes, unique_name
from support import clean_env

from pykvalloc import stats
from kvalloc_cli import ls, main
from pykvalloc.stats import SHM_DIR

# A process that creates a named pool when told to ("create NAME"), answers with the segment's
# name, and keeps the pool until its stdin closes.
CREATOR = r"""
import sys
import pykvalloc

pools = []
for line in sys.stdin:
    command, name = line.split()
    pools.append(pykvalloc.Pool(16 << 20, name=name, pages="small"))
    pools[-1].publish()
    print(pools[-1].segment_name, flush=True)
"""


class Creator:
    """``CREATOR`` running in a second process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", CREATOR], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=clean_env())

    @property
    def pid(self) -> int:
        return self.process.pid

    def create(self, name: str) -> Path:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"create {name}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        assert answer, "the creator died"
        return SHM_DIR / answer.lstrip("/")

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.process.stdout.close()


@contextmanager
def dead_segment(pid: int, name: str) -> Iterator[Path]:
    """A segment at ``kvalloc.<pid>.<name>`` whose writer is gone: the header names ``pid`` and
    says the writer keeps the liveness lock, which nobody holds. Made as the library makes its
    own (mode 0600), so that a pool of that name created by ``pid`` replaces it."""
    path = SHM_DIR / f"kvalloc.{pid}.{name}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, segment_bytes(writer_pid=pid))
    finally:
        os.close(fd)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def test_a_live_pool_created_at_a_dead_segments_path_after_it_was_judged_is_kept(capsys,
                                                                                monkeypatch):
    creator = Creator()
    name = unique_name("reused")
    try:
        with prune_lock(exclusive=True), dead_segment(creator.pid, name) as path:
            judged = []
            describe = ls.describe

            def describe_then_reuse(found: stats.SegmentFile) -> ls.Entry | None:
                entry = describe(found)
                if found.path == path and not judged:
                    judged.append(entry)
                    # The pid's process creates a pool of the same name: the library removes
                    # the leftover and publishes its own segment at the same path.
                    assert creator.create(name) == path
                return entry

            monkeypatch.setattr(ls, "describe", describe_then_reuse)
            listed = listing(capsys, "--prune")
            assert [entry.state for entry in judged] == ["dead"]
            assert str(path) not in listed["removed"]
            assert path.exists() and stats.writer_holds_lock(path)
            # Listed as it is now, the live pool it became.
            entry = entry_for(listed, path)
            assert entry is not None and entry["alive"] and entry["pool"] == name
            monkeypatch.undo()
            assert main(["dump", str(path), "--json"]) == 0
            dumped = json.loads(capsys.readouterr().out)
            assert (dumped["pool"], dumped["pid"]) == (name, creator.pid)
    finally:
        creator.close()


def test_a_live_segment_put_at_the_path_while_prune_holds_the_lock_is_kept():
    # Between prune's judgement under the lock and its unlink, something renames a live
    # segment over the path: the path no longer names the file judged dead, so nothing is
    # removed.
    name = unique_name("swapped")
    live = SHM_DIR / f"kvalloc-test-{name}"  # not named like a segment until it is renamed
    with dead_segment(os.getpid(), name) as path:
        live.write_bytes(segment_bytes())
        with open(live, "rb") as writer:
            fcntl.flock(writer, fcntl.LOCK_SH)  # a live writer's liveness lock
            swapped_in = os.fstat(writer.fileno())
            try:
                assert not ls.prune(path, os.getpid(),
                                    before_unlink=lambda: os.replace(live, path))
                assert (os.stat(path).st_ino, os.stat(path).st_dev) == (swapped_in.st_ino,
                                                                        swapped_in.st_dev)
                assert stats.writer_holds_lock(path)
            finally:
                live.unlink(missing_ok=True)


def test_prune_removes_a_dead_segment_and_says_so():
    name = unique_name("pruned")
    with dead_segment(os.getpid(), name) as path:
        assert ls.prune(path, os.getpid())
        assert not path.exists()
        assert not ls.prune(path, os.getpid())  # gone: nothing to do


def test_prune_leaves_a_segment_whose_writer_lives():
    name = unique_name("alive")
    with dead_segment(os.getpid(), name) as path, open(path, "rb") as writer:
        fcntl.flock(writer, fcntl.LOCK_SH)
        assert not ls.prune(path, os.getpid())
        assert path.exists()
