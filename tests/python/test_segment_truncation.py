"""A segment that shrinks, grows back and is rewritten under its readers never crashes them.

The readers under test (the Python API, ``kvalloc dump``, ``kvalloc ls`` and ``kvalloc top``)
run in a fresh interpreter each, so that a SIGBUS, which kills the process reading a page that
the file no longer has, shows as the child's exit status instead of taking pytest down. The
file they read belongs to a real second process: a live writer (it holds the liveness lock)
that truncates its segment, restores it and publishes into it under the sequence lock, in a
loop, while they read it thousands of times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from stats_writer import segment_bytes, unique_name
from support import clean_env

from pykvalloc import stats

# What a reader may answer about a segment that changes under it: a whole copy, or the error
# that names what it met. Anything else (a crash, another exception) fails.
# What a reader may say of the hostile writer's file: a whole copy, or one of these errors. A
# header read while the writer's rewrite of the first page is half done can hold the magic
# without its version (UnsupportedVersion: 0.0), and a loaded machine makes that window wide.
ALLOWED = {"ok", "TruncatedSegment", "CorruptSegment", "BadMagic", "InconsistentSnapshot",
           "UnsupportedVersion"}

# The start of each script below (argv: the template, a pool name): a segment of its own in
# SHM_DIR, the template's bytes with this process as the writer, which holds the liveness lock
# (a shared flock, as the library's writer does). It leaves ``data`` (the bytes), ``header`` (a
# view of their header), ``path`` and ``fd`` (open for writing).
LIVE_SEGMENT = r"""
import fcntl, json, os, sys
import numpy as np
from pykvalloc import stats

template, name = sys.argv[1], sys.argv[2]
data = bytearray(open(template, "rb").read())
header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
header["writer_pid"] = os.getpid()
path = stats.SHM_DIR / f"kvalloc.{os.getpid()}.{name}"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
os.pwrite(fd, data, 0)
"""

# A live writer that publishes under the sequence lock (odd, the bytes, even). Until a line
# arrives on its stdin, it cycles: two publishes (every fifth of them a corrupt one, a section
# outside the segment), the file cut short with its header intact or not, truncated to
# nothing, grown back full of zeros, written again. It prints its segment's path, then, at the
# end, how many cycles it ran.
HOSTILE = LIVE_SEGMENT + r"""
import select, time

summary = header["sections"][0][0]
assert int(summary["kind"]) == stats.SECTION_SUMMARY
sequence_at = stats.HEADER_DTYPE.fields["sequence"][1]
sequence = int(header["sequence"][0]) & ~1

def publish(corrupt):
    global sequence
    sequence += 1
    os.pwrite(fd, sequence.to_bytes(8, "little"), sequence_at)
    header["sequence"] = sequence
    header["publish_count"] += 1
    offset = int(summary["offset"])
    if corrupt:
        summary["offset"] = 1 << 40
    os.pwrite(fd, data, 0)
    summary["offset"] = offset
    sequence += 1
    os.pwrite(fd, sequence.to_bytes(8, "little"), sequence_at)

try:
    publish(False)
    print(path, flush=True)
    cuts = (8, 100, stats.HEADER_DTYPE.itemsize + 8, len(data) // 2)
    cycles = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        cycles += 1
        publish(cycles % 5 == 0)
        time.sleep(0.0005)
        publish(False)
        time.sleep(0.0005)
        os.ftruncate(fd, cuts[cycles % len(cuts)])
        time.sleep(0.0002)
        os.ftruncate(fd, 0)
        time.sleep(0.0002)
        os.ftruncate(fd, len(data))
        time.sleep(0.0001)
    print(cycles, flush=True)
finally:
    os.unlink(path)
"""

# Reads the segment at argv[2] argv[3] times or more, in the way argv[1] names, and prints a
# JSON object: how many reads ended in each outcome. It reads on until it has met both a whole
# copy and a truncated file (at most twenty times as many reads), so that a run that never met
# the truncation cannot pass for one that survived it.
READER = r"""
import asyncio, collections, contextlib, io, json, sys
from pathlib import Path
from pykvalloc import errors, stats
from pykvalloc.errors import SegmentError

mode, path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
outcomes = collections.Counter()

def enough(done):
    met = outcomes["ok"] and outcomes["TruncatedSegment"]
    return done >= count and met or done >= 20 * count

def read_api():
    kept, done = None, 0
    while not enough(done):
        done += 1
        try:
            if done % 2:                 # one descriptor kept across reads, as top keeps it
                if kept is None:
                    kept = stats.Segment(path)
                kept.snapshot()
            else:                        # opened for each read, as dump opens it
                with stats.Segment(path) as fresh:
                    fresh.snapshot()
            outcomes["ok"] += 1
        except SegmentError as exc:
            outcomes[type(exc).__name__] += 1

# The command shows no class names: the reader's error is told by the words of its message in
# dump's line, by its kind word in an ls entry.
PHRASES = (("is truncated: ", "TruncatedSegment"), ("is corrupt: ", "CorruptSegment"),
           ("not a kvalloc statistics segment", "BadMagic"), ("its magic stayed zero", "BadMagic"),
           ("no consistent snapshot", "InconsistentSnapshot"))
KINDS = {cls.kind: cls.__name__ for cls in (errors.TruncatedSegment, errors.CorruptSegment,
                                            errors.BadMagic, errors.InconsistentSnapshot)}

def named(message):
    return next((name for phrase, name in PHRASES if phrase in message), message)

def command(*argv):
    from kvalloc_cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()

def read_cli():
    done = 0
    while not enough(done):
        done += 1
        if done % 6:
            status, out, err = command("dump", path, "--json")
            if status == 0:
                assert json.loads(out)["segment"] == path
                outcomes["ok"] += 1
            else:
                assert status == 1 and err.startswith("kvalloc dump: ") and err.count("\n") == 1, err
                outcomes[named(err)] += 1
        else:
            status, out, err = command("ls", "--json")
            assert status == 0, err
            entry = next(e for e in json.loads(out)["segments"] if e["segment"] == path)
            assert entry["alive"], entry
            kind = entry["problem_kind"]
            outcomes[KINDS.get(kind, kind) if entry["problem"] else "ok"] += 1

def read_top():
    from kvalloc_tui.app import KvallocTop
    from kvalloc_tui.widgets import Banner
    banners = collections.Counter()

    class Counting(KvallocTop):
        def on_sampled(self, message):
            super().on_sampled(message)
            error = message.error
            outcomes["ok" if error is None else type(error).__name__] += 1
            banners[self.screen.query_one(Banner).message.split(":")[0]] += 1

    async def scenario():
        # The timer ticks seldom: the loop below ticks, at once after each sample.
        app = Counting(stats.SegmentFile.from_path(Path(path)), interval=10)
        async with app.run_test(size=(100, 30)) as pilot:
            done = 0
            while not enough(done):
                app.tick()
                await pilot.pause(0.001)
                done = sum(outcomes.values())
            assert app.is_running and app.current.ended is None
        print(json.dumps(banners))

    asyncio.run(scenario())

{"api": read_api, "cli": read_cli, "top": read_top}[mode]()
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A real pool's segment, for the second process to serve."""
    path = tmp_path_factory.mktemp("segment") / "template"
    path.write_bytes(segment_bytes())
    return path


@contextmanager
def hostile_writer(template: Path) -> Iterator[str]:
    """The second process of ``HOSTILE`` at work; yields its segment's path. Afterwards checks
    that it ran whole cycles and ended by itself."""
    process = subprocess.Popen([sys.executable, "-c", HOSTILE, str(template),
                                unique_name("shrinking")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env())
    assert process.stdin is not None and process.stdout is not None
    path = process.stdout.readline().strip()
    try:
        assert path, process.stderr.read()  # type: ignore[union-attr]
        yield path
        out, err = process.communicate("stop\n", timeout=60)
        assert process.returncode == 0, err
        assert int(out) > 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if path:
            Path(path).unlink(missing_ok=True)


def run_reader(script: str, *args: str) -> dict[str, int]:
    """Runs ``script`` in a fresh interpreter; its last line of output, decoded. Fails on any
    exit but a clean one: a signal (SIGBUS is -7) or an uncaught exception."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode, reads", [("api", 3000), ("cli", 150), ("top", 60)])
def test_readers_survive_a_segment_truncated_restored_and_rewritten_under_them(template, mode,
                                                                              reads):
    with hostile_writer(template) as path:
        outcomes = run_reader(READER, mode, path, str(reads))
    assert sum(outcomes.values()) >= reads
    assert set(outcomes) <= ALLOWED, outcomes
    assert outcomes["ok"] and outcomes["TruncatedSegment"], outcomes


# The same file read before and after its writer's process cuts it short in each way, with no
# race: every cut is TruncatedSegment, and once the file is whole again the same Segment reads
# it again.
CUT_UNDER_A_SEGMENT = LIVE_SEGMENT + r"""
from pykvalloc.errors import SegmentError

try:
    segment = stats.Segment(path)
    results = {"before": segment.snapshot().segment_size}
    for cut in (0, 8, 100, stats.HEADER_DTYPE.itemsize, len(data) // 2, len(data) - 1):
        os.ftruncate(fd, cut)
        try:
            segment.snapshot()
            results[cut] = "read"
        except SegmentError as exc:
            results[cut] = f"{type(exc).__name__}: {exc}"
        os.pwrite(fd, data[cut:], cut)
        results[f"after {cut}"] = segment.snapshot().segment_size
    print(json.dumps(results))
finally:
    os.unlink(path)
"""


def test_a_segment_cut_short_after_it_was_opened_is_truncated_not_a_crash(template):
    results = run_reader(CUT_UNDER_A_SEGMENT, str(template), unique_name("cut"))
    size = template.stat().st_size
    assert results.pop("before") == size
    for cut in (0, 8, 100, stats.HEADER_DTYPE.itemsize, size // 2, size - 1):
        assert results.pop(str(cut)).startswith("TruncatedSegment: "), cut
        assert results.pop(f"after {cut}") == size, cut
    assert results == {}


# kvalloc top watching a segment that its writer's process truncates between two refreshes:
# the banner says it is truncated and the app goes on; once the file is whole again it shows
# the pool's figures again and the banner is clear.
TOP_OVER_A_CUT = LIVE_SEGMENT + r"""
import asyncio
from kvalloc_tui.app import KvallocTop
from kvalloc_tui.widgets import Banner

async def until(pilot, predicate):
    for _ in range(3000):  # 60 s at least: a bound against a hang only
        if predicate():
            return
        await pilot.pause(0.02)
    raise AssertionError("hung: never came in 60 s")

async def scenario():
    app = KvallocTop(stats.SegmentFile.from_path(path), interval=0.1)
    async with app.run_test(size=(100, 30)) as pilot:
        banner = app.screen.query_one(Banner)
        await until(pilot, lambda: app.current and app.current.last)
        first = app.current.last
        os.ftruncate(fd, 0)
        await until(pilot, lambda: banner.message)
        seen = banner.message
        os.pwrite(fd, data, 0)
        await until(pilot, lambda: app.current.last is not first and not banner.message)
        print(json.dumps({"banner": seen, "running": app.is_running,
                          "ended": app.current.ended,
                          "size": app.current.last.segment_size}))

try:
    asyncio.run(scenario())
finally:
    os.unlink(path)
"""


def test_top_says_a_segment_was_truncated_between_refreshes_and_goes_on(template):
    result = run_reader(TOP_OVER_A_CUT, str(template), unique_name("topcut"))
    assert result["banner"].startswith("Read failed, retrying: "), result
    assert " is truncated: " in result["banner"], result
    assert result["running"] and result["ended"] is None
    assert result["size"] == template.stat().st_size
