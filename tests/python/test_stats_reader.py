"""pykvalloc.stats on real segments: pools of this process and of a writer process the test drives,
an idle writer, a killed one, a destroyed pool, and finding segments by pid and name."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from stats_writer import Writer, crafted_segment, prune_lock, unique_name

import pykvalloc
from pykvalloc import stats
from pykvalloc.errors import (
    AmbiguousSegment,
    DeadWriter,
    InconsistentSnapshot,
    KvallocError,
    SegmentError,
    SegmentNotFound,
    SegmentRemoved,
    SegmentUnreadable,
)

MiB = 1 << 20


@pytest.fixture
def named_pool():
    with pykvalloc.Pool(16 * MiB, name=unique_name("reader"), pages="small") as pool:
        yield pool


def assert_same_figures(snap: stats.Snapshot, truth: dict) -> None:
    """Every figure of the segment's summary equals the writer's own ``Pool.stats()`` (given as
    a dict; the stats have more fields than the segment carries)."""
    summary = snap.to_dict()["summary"]
    assert summary["num_orders"] == len(truth["free_blocks"])
    assert {name: summary[name] for name in summary if name in truth} == {
        name: list(value) if name == "free_blocks" else value
        for name, value in truth.items() if name in summary}
    assert set(stats.SUMMARY_COUNTERS) | {"fragmentation", "free_blocks", "page_kind"} <= set(truth)


def fill(pool: pykvalloc.Pool) -> list[pykvalloc.Allocation]:
    blocks = [pool.alloc(64) for _ in range(50)] + [pool.alloc(200_000) for _ in range(5)]
    blocks += [pool.alloc(1000) for _ in range(30)]
    for block in blocks[::4]:
        pool.free(block)
    return [block for block in blocks if not block.freed]


def test_a_snapshot_holds_the_pools_own_figures(named_pool):
    kept = fill(named_pool)
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        snap = segment.snapshot()

    assert_same_figures(snap, dataclasses.asdict(named_pool.stats()))
    assert snap.pool_name == named_pool.name and snap.pid == os.getpid()
    assert snap.path == stats.SHM_DIR / named_pool.segment_name.lstrip("/")
    assert snap.abi == (1, stats.ABI_MINOR) and snap.sequence % 2 == 0
    assert snap.publish_count >= 2 and snap.heartbeat_ns >= snap.start_time_ns
    assert snap.use_fraction == pytest.approx(named_pool.stats().bytes_in_use / (16 * MiB))
    assert snap.kv is None  # no KV cache on this pool

    by_index = {cls.index: cls for cls in named_pool.class_stats()}
    for index, entry in enumerate(snap.classes):
        assert entry["object_size"] == by_index[index].object_size
        assert entry["live_objects"] == by_index[index].live_objects
        assert entry["slabs"] == by_index[index].slabs
    assert len(snap.slabs) == named_pool.stats().slab_count
    assert int(snap.slabs["inuse"].sum()) == sum(1 for b in kept if b.size <= 65536)

    cells, cell_bytes = int(snap.heapmap["cells"]), int(snap.heapmap["cell_bytes"])
    assert cells == len(snap.cell_state) and cells * cell_bytes >= snap.capacity
    used_bytes = int((snap.cell_state != stats.CELL_FREE).sum()) * cell_bytes
    assert used_bytes >= named_pool.stats().capacity - named_pool.stats().bytes_free
    assert snap.cell_state[-1] == stats.CELL_FREE and snap.cell_fill[-1] == 0
    assert not snap.cell_state.flags.writeable  # a view of the private copy, read-only


def test_without_trace_only_failures_are_recorded(named_pool):
    fill(named_pool)
    with pytest.raises(pykvalloc.OutOfMemory):
        named_pool.alloc(15 * MiB)
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        snap = segment.snapshot()
    records = list(snap.trace_records())
    assert snap.trace_written == 1 and len(records) == 1
    assert records[0]["op"] == "alloc" and records[0]["status_name"] == "out of memory"
    assert records[0]["size"] == 15 * MiB and records[0]["offset"] is None
    assert records[0]["thread"] > 0
    assert not snap.calls_are_timed() and snap.latency_samples("alloc") == 0


def test_a_writer_in_another_process(tmp_path):
    with Writer(unique_name("other"), trace=True) as writer:
        writer.ask("alloc 64 100")
        writer.ask("alloc 100000 4")
        writer.ask("free_every 3")
        assert writer.ask(f"fail {64 * MiB}") == "InvalidArgument"
        assert writer.ask(f"fail {15 * MiB}") == "OutOfMemory"
        writer.ask("publish")
        truth = writer.ask("stats")
        with stats.open_segment(str(writer.pid)) as segment:
            snap = segment.snapshot()

    assert snap.pid == writer.pid and snap.pool_name == writer.name
    expected = truth["stats"]
    assert_same_figures(snap, expected)
    assert [int(c["live_objects"]) for c in snap.classes] == [
        c["live_objects"] for c in truth["classes"]]

    # Trace on: every call was timed and recorded, the failures among them.
    calls = expected["alloc_count"] + expected["free_count"]
    assert snap.trace_written == calls + 2
    assert snap.calls_are_timed()
    assert snap.latency_samples("alloc") == expected["alloc_count"] + 2
    assert snap.latency_samples("free") == expected["free_count"]
    p50, p99, p999 = snap.latency_percentiles("alloc").values()
    assert 2 <= p50 <= p99 <= p999 and p999 & (p999 - 1) == 0
    last_two = list(snap.trace_records())[-2:]
    assert [r["status_name"] for r in last_two] == ["invalid", "out of memory"]


def test_snapshots_taken_while_the_writer_churns_are_never_torn():
    # The writer publishes every few calls, back to back; a snapshot either holds the relations
    # true within one publish, or is refused (InconsistentSnapshot), never torn.
    taken = refused = 0
    with Writer(unique_name("churn")) as writer, stats.Segment(writer.path) as segment:
        writer.send("churn 40000")
        while not writer.answered() or taken < 20:
            try:
                snap = segment.snapshot()
            except InconsistentSnapshot:
                refused += 1
                continue
            taken += 1
            s = snap.summary
            free = sum(int(n) * snap.block_size(k) for k, n in enumerate(snap.free_blocks))
            assert free == int(s["bytes_free"])
            assert int(s["alloc_count"]) - int(s["free_count"]) == int(s["live_allocations"])
            assert int(s["bytes_in_use"]) + int(s["bytes_free"]) <= int(s["capacity"])
        assert writer.ask(None) == "churned"
    assert taken >= 20 and refused <= taken


def test_an_idle_writer_is_alive_with_an_old_heartbeat(named_pool):
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        data = bytearray(segment.snapshot().data)
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["heartbeat_ns"] -= 3600 * 10**9  # an hour without a publish
    with crafted_segment(bytes(data)) as path, stats.Segment(path) as segment:
        snap = segment.snapshot()  # the pid is this live process: no DeadWriter
    assert 3599 < snap.heartbeat_age() < 3700


def test_a_killed_writer_is_dead_and_its_last_state_readable():
    with prune_lock(exclusive=False), Writer(unique_name("killed")) as writer:
        writer.ask("alloc 4096 10")
        writer.ask("publish")
        writer.kill()
        assert writer.path.exists()  # nothing removed it
        with stats.Segment(writer.path) as segment:
            with pytest.raises(DeadWriter) as info:
                segment.snapshot()
            last = segment.snapshot(check_writer=False)
    message = str(info.value)
    assert f"process {writer.pid}" in message and "kvalloc ls --prune" in message
    assert isinstance(info.value, SegmentError) and isinstance(info.value, KvallocError)
    assert last.pool_name == writer.name and last.summary["live_allocations"] == 10


def test_a_writer_that_holds_no_liveness_lock_is_dead(named_pool):
    # The lock is the truth where the writer keeps one: a live pid without it is a dead writer's
    # reused pid, or a writer in another pid namespace that is gone.
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        snap = segment.snapshot()
        assert snap.capabilities & stats.CAP_LIVENESS_LOCK
        assert stats.writer_holds_lock(segment.path)
    with crafted_segment(bytes(snap.data), pid=os.getpid()) as path, stats.Segment(path) as segment:
        assert not stats.writer_holds_lock(path)
        with pytest.raises(DeadWriter):
            segment.snapshot()


def test_a_reused_pid_is_a_dead_writer(named_pool):
    # A writer without the liveness lock (an older library) is judged by its pid: the segment
    # names this (live) process, but a pool older than the process cannot be its.
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        data = bytearray(segment.snapshot().data)
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["capabilities"] &= ~np.uint64(stats.CAP_LIVENESS_LOCK)
    born = stats.process_start_time(os.getpid())
    header["start_time_ns"] = int((born - 3600) * 1e9)
    with crafted_segment(bytes(data)) as path, stats.Segment(path) as segment:
        with pytest.raises(DeadWriter):
            segment.snapshot()


@pytest.mark.parametrize("pid", [1 << 22, 2**31 - 1, 2**31, 2**32 - 1, 9_999_999_999])
def test_a_pid_no_linux_process_can_have_is_a_dead_writer(named_pool, pid):
    # A file name allows ten digits and the header's writer_pid is a u32: past 2**31 os.kill
    # raised OverflowError, which `kvalloc ls` and `top` did not expect.
    assert not stats.writer_alive(pid)
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        data = bytearray(segment.snapshot().data)
    header = np.frombuffer(data, stats.HEADER_DTYPE, count=1)
    header["capabilities"] &= ~np.uint64(stats.CAP_LIVENESS_LOCK)  # the pid is all there is
    if pid < 2**32:
        header["writer_pid"] = pid
        with crafted_segment(bytes(data)) as path, stats.Segment(path) as segment:
            with pytest.raises(DeadWriter, match=f"process {pid}"):
                segment.snapshot()
    with crafted_segment(bytes(data), pid=pid) as path:
        found = stats.SegmentFile.from_path(path)
        assert found is not None and found.pid == pid and not found.process_alive()
        assert found in stats.list_segments()
    with crafted_segment(b"\0" * 64, pid=pid) as path:  # not a segment: its name is all there is
        assert not stats.SegmentFile.from_path(path).process_alive()


def test_a_segment_directory_that_cannot_be_listed_is_a_segment_error(tmp_path):
    assert stats.list_segments(tmp_path / "absent") == []  # no directory: no segments
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(SegmentUnreadable, match=f"cannot list the segments in {not_a_directory}"):
        stats.list_segments(not_a_directory)
    if os.geteuid() != 0:  # root lists any directory
        closed = tmp_path / "closed"
        closed.mkdir(mode=0)
        with pytest.raises(SegmentUnreadable, match="Permission denied"):
            stats.list_segments(closed)


def test_the_newest_trace_records_are_read_without_the_rest_of_the_ring(named_pool):
    # A ring of 5 records that has wrapped: 12 written, the newest (11) at index 11 % 5 = 1.
    named_pool.publish()
    with stats.Segment.for_pool(named_pool) as segment:
        data = bytearray(segment.snapshot().data)
    snap = stats.Snapshot(bytes(data))
    at, size = snap._sections[stats.SECTION_TRACE]
    capacity, written = 5, 12
    head = np.frombuffer(data, stats.TRACE_DTYPE, count=1, offset=at)
    assert size >= stats.TRACE_DTYPE.itemsize + capacity * stats.RECORD_DTYPE.itemsize
    head["capacity"], head["written"] = capacity, written
    ring = np.frombuffer(data, stats.RECORD_DTYPE, count=capacity,
                         offset=at + stats.TRACE_DTYPE.itemsize)
    for index in range(written - capacity, written):
        ring[index % capacity]["size"] = index
    snap = stats.Snapshot(bytes(data))
    assert snap.has_trace and snap.trace_written == written
    assert [r["size"] for r in snap.trace_records()] == [7, 8, 9, 10, 11]
    assert [r["size"] for r in snap.trace_records(newest=2)] == [10, 11]
    assert list(snap.trace_tail(3)["size"]) == [9, 10, 11]
    assert len(snap.trace_tail(0)) == 0 and len(snap.trace_tail(99)) == capacity

    # The ring is outside the sequence lock (layout 1.3): the live count read before the copy
    # (12) and after it (14: records 12 and 13 went into the slots of 7 and 8, and 14 may have
    # begun in 9's) leave 10 and 11 whole in the copy, and only those are read.
    raced = stats.Snapshot(bytes(data), trace_bounds=(12, 14))
    assert raced.trace_written == 12
    assert [r["size"] for r in raced.trace_records()] == [10, 11]
    assert list(raced.trace_tail(1)["size"]) == [11]
    # A count read before the copy below the copy's own: the records past it are not trusted.
    assert [r["size"] for r in stats.Snapshot(bytes(data), trace_bounds=(11, 11)).trace_records()] \
        == [7, 8, 9, 10]
    # Lapped during the copy: nothing is whole.
    assert list(stats.Snapshot(bytes(data), trace_bounds=(12, 20)).trace_records()) == []


def test_a_destroyed_pool_and_an_exited_process_say_so():
    pool = pykvalloc.Pool(16 * MiB, name=unique_name("destroyed"))
    segment = stats.Segment.for_pool(pool)
    segment.snapshot()
    pool.close()
    with pytest.raises(SegmentRemoved, match="was destroyed"):
        segment.snapshot()
    assert segment.snapshot(check_writer=False).pool_name == pool.name  # the file, open, survives
    segment.close()
    segment.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        segment.snapshot()

    with Writer(unique_name("exits")) as writer:
        segment = stats.Segment(writer.path)
        writer.stop()
        with pytest.raises(SegmentRemoved, match=f"ended with its process {writer.pid}"):
            segment.snapshot()
        segment.close()


def test_finding_segments(named_pool):
    file_name = named_pool.segment_name.lstrip("/")
    path = stats.SHM_DIR / file_name
    assert any(found.path == path for found in stats.list_segments())
    for target in (named_pool.name, file_name, str(path)):
        assert stats.find_segment(target).path == path
    with pykvalloc.Pool(16 * MiB, name=unique_name("second")):
        with pytest.raises(AmbiguousSegment, match=file_name):
            stats.find_segment(str(os.getpid()))
    assert stats.find_segment(str(os.getpid())).path == path
    with pytest.raises(SegmentNotFound, match="no pool segment matches"):
        stats.find_segment(unique_name("missing"))
    with pytest.raises(SegmentNotFound, match="not named like"):
        stats.find_segment(__file__)
    with pytest.raises(SegmentNotFound):
        stats.Segment(stats.SHM_DIR / f"kvalloc.{os.getpid()}.{unique_name('none')}")
    with pytest.raises(SegmentNotFound, match="has no name"):
        with pykvalloc.Pool(16 * MiB) as anonymous:
            stats.Segment.for_pool(anonymous)


def test_latency_percentiles_are_bucket_upper_bounds():
    buckets = np.zeros(stats.LATENCY_BUCKETS, np.uint64)
    assert stats.latency_percentiles(buckets) is None
    buckets[5] = 990   # [32, 64) ns
    buckets[12] = 9    # [4096, 8192) ns
    buckets[20] = 1    # [1 Mi, 2 Mi) ns
    assert stats.latency_percentiles(buckets) == {0.5: 64, 0.99: 64, 0.999: 8192}
    assert stats.latency_percentiles(buckets, (1.0,)) == {1.0: 1 << 21}


def test_downsampling_keeps_small_live_blocks_visible():
    state = np.array([0, 0, 0, 1, 0, 0, 2, 2, 0, 0, 0, 0], np.uint8)
    fill = np.array([0, 0, 0, 255, 0, 0, 255, 255, 0, 0, 0, 0], np.uint8)
    out_state, out_fill = stats.downsample_cells(state, fill, 4)
    assert out_state.tolist() == [0, 1, 2, 0]
    assert out_fill.tolist() == [0, 85, 170, 0]
    same = stats.downsample_cells(state, fill, 100)
    assert same[0].tolist() == state.tolist()
    assert stats.downsample_cells(state, fill, 0)[0].size == 0


def test_process_facts_from_proc_agree_with_psutil():
    # The reader reads /proc itself (pykvalloc needs numpy alone); psutil, a test dependency,
    # is the second opinion: the same names, and start times within the kernel's rounding.
    import psutil

    pids = [1, os.getpid(), os.getppid(), *sorted(psutil.pids())[:200]]
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name, started = process.name(), process.create_time()
        except psutil.Error:
            continue  # gone meanwhile, or hidden
        ours = stats.process_name(pid), stats.process_start_time(pid)
        if not psutil.pid_exists(pid):
            continue  # gone meanwhile
        assert ours[0] == name, pid
        assert ours[1] is not None and abs(ours[1] - started) < 0.05, pid
    for pid in (0, -1, 1 << 22, 2**31, 9_999_999_999):
        assert stats.process_name(pid) is None and stats.process_start_time(pid) is None
