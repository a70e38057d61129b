"""Helpers of the statistics-segment tests: an engine in another process that the test drives,
crafted segment files, and a lock against test runs pruning beside each other.

``Writer`` starts a fresh interpreter that owns a named pool and obeys one command per line on
its stdin, answering one line of JSON on its stdout. The reader under test then reads a segment
written by another process, as ``kvalloc top`` does beside a real engine.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support import clean_env

from pykvalloc.stats import SHM_DIR

ENGINE = r"""
import dataclasses, json, sys
import pykvalloc

name, capacity, trace = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
pool = pykvalloc.Pool(capacity, name=name, trace=trace, pages="small")
held = []

def answer(value):
    print(json.dumps(value), flush=True)

answer({"segment": pool.segment_name})
for line in sys.stdin:
    command, *args = line.split()
    if command == "alloc":                      # alloc SIZE COUNT
        size, count = int(args[0]), int(args[1])
        held.extend(pool.alloc(size) for _ in range(count))
        answer(len(held))
    elif command == "free_every":               # free_every N: frees every N-th held block
        step = int(args[0])
        for block in held[::step]:
            pool.free(block)
        held = [block for block in held if not block.freed]
        answer(len(held))
    elif command == "fail":                     # fail SIZE: an allocation that cannot succeed
        try:
            pool.alloc(int(args[0]))
        except pykvalloc.KvallocError as exc:
            answer(type(exc).__name__)
    elif command == "publish":
        pool.publish()
        answer("published")
    elif command == "stats":
        answer({"stats": dataclasses.asdict(pool.stats()),
                "classes": [dataclasses.asdict(c) for c in pool.class_stats()]})
    elif command == "churn":                    # churn N: allocs, frees, a publish every 4
        live = []
        for i in range(int(args[0])):
            if len(live) > 32 or (live and i % 3 == 0):
                pool.free(live.pop(i % len(live)))
            else:
                live.append(pool.alloc(64 << (i % 15)))
            if i % 4 == 0:
                pool.publish()
        for block in live:
            pool.free(block)
        answer("churned")
    elif command == "close":
        pool.close()
        answer("closed")
"""


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Writer:
    """A process owning a named pool; see the module docstring."""

    def __init__(self, name: str, capacity: int = 16 << 20, trace: bool = False) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, "-c", ENGINE, name, str(capacity), "1" if trace else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=clean_env())
        self.segment_name = self.ask(None)["segment"]
        self.path = SHM_DIR / self.segment_name.lstrip("/")

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, command: str | None) -> Any:
        """Sends one command (None: only reads) and returns the decoded answer."""
        assert self.process.stdout is not None
        if command is not None:
            self.send(command)
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the writer died: {self.process.stderr.read()}")  # type: ignore
        return json.loads(line)

    def send(self, command: str) -> None:
        """Sends a command without waiting for its answer (read it with ``ask(None)``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def answered(self) -> bool:
        """Whether an answer is waiting on the writer's stdout."""
        return bool(select.select([self.process.stdout], [], [], 0)[0])

    def kill(self) -> None:
        """SIGKILL: no atexit handler runs, so the segment stays behind."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)

    def stop(self) -> None:
        """A normal exit: the library removes the segment."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=60)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.stop()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        self.path.unlink(missing_ok=True)  # a killed writer leaves its segment


@contextmanager
def writer_named(process_name: str, capacity: int = 16 << 20) -> Iterator[tuple[str, Path]]:
    """A process that calls itself ``process_name`` (its comm, what ps shows) and publishes a
    named pool: (the pool's name, its segment). Killed and its segment removed afterwards."""
    name = unique_name("named")
    code = ("import pykvalloc, sys\n"
            f"open('/proc/self/comm', 'w').write({process_name!r})\n"
            f"pool = pykvalloc.Pool({capacity}, name={name!r}, pages='small')\n"
            "pool.publish()\n"
            "print(pool.segment_name, flush=True)\n"
            "sys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=clean_env())
    assert process.stdout is not None and process.stdin is not None
    path = SHM_DIR / process.stdout.readline().strip().lstrip("/")
    try:
        yield name, path
    finally:
        process.stdin.close()
        process.wait(timeout=60)
        process.stdout.close()
        path.unlink(missing_ok=True)


@contextmanager
def crafted_segment(data: bytes, pid: int | None = None,
                    locked: bool | None = None) -> Iterator[Path]:
    """``data`` as a segment file named for ``pid`` and a unique pool name; removed afterwards.
    Without ``pid`` it stands for a live writer, this process, and like one it holds the
    writer's liveness lock (a shared flock) while it exists; ``locked`` says otherwise."""
    path = SHM_DIR / f"kvalloc.{pid or os.getpid()}.{unique_name('crafted')}"
    path.write_bytes(data)
    try:
        with open(path, "rb") as held:
            if locked if locked is not None else pid is None:
                fcntl.flock(held, fcntl.LOCK_SH)
            yield path
    finally:
        path.unlink(missing_ok=True)


def listing(capsys: Any, *options: str) -> dict:
    """``kvalloc ls --json OPTIONS`` run in this process (pytest's ``capsys`` takes its output),
    decoded."""
    from kvalloc_cli import main

    assert main(["ls", "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def entry_for(listed: dict, path: Path) -> dict | None:
    """The entry of ``path`` in a decoded ``kvalloc ls --json``, None if it is not listed."""
    return next((e for e in listed["segments"] if e["segment"] == str(path)), None)


def absent_pid() -> int:
    """A pid no process has: above the kernel's pid_max. It stands for a writer in another pid
    namespace, whose pid means nothing here."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def segment_bytes(writer_pid: int | None = None) -> bytes:
    """A consistent copy of a real, freshly created pool's segment, its header's writer pid
    set to ``writer_pid`` when given."""
    import numpy as np

    import pykvalloc
    from pykvalloc import stats

    with pykvalloc.Pool(16 << 20, name=unique_name("copied"), pages="small") as pool:
        pool.publish()
        with stats.Segment.for_pool(pool) as segment:
            data = bytearray(segment.snapshot().data)
    if writer_pid is not None:
        np.frombuffer(data, stats.HEADER_DTYPE, count=1)["writer_pid"] = writer_pid
    return bytes(data)


@contextmanager
def prune_lock(exclusive: bool) -> Iterator[None]:
    """``kvalloc ls --prune`` removes every dead writer's segment on the machine, those of a test
    run going on beside this one included. Tests that prune hold this lock exclusively; tests
    that read a killed writer's segment hold it shared."""
    with open(Path(tempfile.gettempdir()) / "pykvalloc-tests-prune.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)



def kv_segment_bytes() -> bytes:
    """A consistent copy of a real named KV cache's segment (layout 1.5: the KV section, the KV
    sequences and namespaces sections), taken with two sequences live."""
    import pykvalloc
    from pykvalloc import stats

    name = unique_name("kvcopied")
    with pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64, name=name,
                           pages="small") as cache:
        held = [cache.allocate(40), cache.allocate(100, namespace=7)]
        cache.publish()
        with stats.open_segment(name) as segment:
            data = segment.snapshot().data
        for seq in held:
            seq.free()
    return data


def write_kv_sections(data: bytes, *, live: int = 0, pins: int = 0,
                      longest: tuple[int, int] = (0, 0),
                      entries: list[dict[str, Any]] | None = None,
                      namespaces: list[dict[str, Any]] | None = None) -> bytes:
    """``data`` (a segment with the KV sequences and namespaces sections) with those sections
    written as a writer would: ``entries`` each a dict of a kva_shm_kv_sequence's fields (its
    ``table`` a list of block ids, ``table_len`` its length unless given), ``namespaces`` each a
    dict of a kva_shm_kv_namespace's fields; what is not given is zero. The layout fields the
    writer set at creation (entry sizes, capacities) stay as they are."""
    import numpy as np

    from pykvalloc import stats

    out = bytearray(data)
    table = np.frombuffer(out, stats.HEADER_DTYPE, count=1)[0]["sections"]
    where = {int(e["kind"]): (int(e["offset"]), int(e["size"])) for e in table}
    if entries is not None:
        offset, _ = where[stats.SECTION_KV_SEQUENCES]
        head = np.frombuffer(out, stats.KV_SEQUENCES_DTYPE, count=1, offset=offset)
        head["count"] = len(entries)
        head["live_sequences"], head["live_pins"] = live, pins
        head["longest_tokens"], head["longest_handle"] = longest
        size = int(head["entry_size"][0])
        for i, fields in enumerate(entries):
            at = offset + stats.KV_SEQUENCES_DTYPE.itemsize + i * size
            entry = np.frombuffer(out, stats.KV_SEQUENCE_DTYPE, count=1, offset=at)
            entry[0] = np.zeros((), stats.KV_SEQUENCE_DTYPE)
            ids = list(fields.get("table", ()))
            for name, value in fields.items():
                if name != "table":
                    entry[name] = value
            entry["table"][0][:len(ids)] = ids
            if "table_len" not in fields:
                entry["table_len"] = len(ids)
    if namespaces is not None:
        offset, _ = where[stats.SECTION_KV_NAMESPACES]
        head = np.frombuffer(out, stats.KV_NAMESPACES_DTYPE, count=1, offset=offset)
        head["count"] = len(namespaces)
        size = int(head["entry_size"][0])
        for i, fields in enumerate(namespaces):
            at = offset + stats.KV_NAMESPACES_DTYPE.itemsize + i * size
            row = np.frombuffer(out, stats.KV_NAMESPACE_DTYPE, count=1, offset=at)
            row[0] = np.zeros((), stats.KV_NAMESPACE_DTYPE)
            for name, value in fields.items():
                row[name] = value
    return bytes(out)
