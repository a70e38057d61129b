"""``kvalloc ls``: live pools with their figures, and --prune for what killed writers left."""

from __future__ import annotations

import json
import os
import resource

import psutil
import pytest
from stats_writer import (
    Writer,
    absent_pid,
    crafted_segment,
    entry_for,
    listing,
    prune_lock,
    segment_bytes,
    unique_name,
    writer_named,
)
from support import run_kvalloc

import pykvalloc
from kvalloc_cli import ls, main
from pykvalloc.stats import SHM_DIR, list_segments


def test_ls_shows_a_live_pool(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # other runs' pools may widen the table
    name = unique_name("ls")
    with pykvalloc.Pool(16 << 20, name=name) as pool:
        blocks = [pool.alloc(4096) for _ in range(64)]
        pool.publish()
        entry = entry_for(listing(capsys), pykvalloc.stats.SHM_DIR / pool.segment_name[1:])
        assert entry is not None
        assert entry["pid"] == os.getpid() and entry["pool"] == name
        assert entry["process"] == psutil.Process().name()
        assert entry["capacity"] == 16 << 20
        assert entry["bytes_in_use"] == pool.stats().bytes_in_use == 64 * 4096
        assert entry["alive"] and entry["state"] in ("live", "idle")

        assert main(["ls"]) == 0
        table = capsys.readouterr().out
        row = next(line for line in table.splitlines() if name in line)
        assert str(os.getpid()) in row and "16 MiB" in row and "1.6%" in row
        del blocks


def test_prune_removes_only_the_segments_of_dead_processes(capsys):
    with prune_lock(exclusive=True), Writer(unique_name("prune-dead")) as dead, \
            Writer(unique_name("prune-live")) as live:
        dead.ask("alloc 4096 3")
        dead.ask("publish")
        dead.kill()
        before = listing(capsys)
        assert entry_for(before, dead.path)["state"] == "dead"
        assert entry_for(before, dead.path)["process"] is None
        assert entry_for(before, live.path)["alive"]

        after = listing(capsys, "--prune")
        assert str(dead.path) in after["removed"] and not dead.path.exists()
        assert entry_for(after, dead.path) is None
        assert live.path.exists() and entry_for(after, live.path)["alive"]

        assert main(["ls", "--prune"]) == 0
        assert str(dead.path) not in capsys.readouterr().out


def test_an_unreadable_segment_of_a_live_process_is_listed_not_pruned(capsys):
    with prune_lock(exclusive=True), crafted_segment(b"not a segment, just bytes" * 40) as path:
        entry = entry_for(listing(capsys, "--prune"), path)
        assert path.exists()
        assert entry["state"] == "unreadable" and entry["alive"]
        assert entry["problem_kind"] == "not a segment" and "not a kvalloc statistics segment" in entry["problem"]


def listed_by_another_process(*options: str) -> dict:
    done = run_kvalloc("ls", "--json", *options, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_writer_holding_its_liveness_lock_lives_whatever_its_pid():
    # A writer in another pid namespace: its pid means nothing here, but it holds the lock.
    # ls, ls --prune and dump follow the lock, as kvalloc_stats.h makes it the authority.
    pid = absent_pid()
    with prune_lock(exclusive=True), \
            crafted_segment(segment_bytes(writer_pid=pid), pid=pid, locked=True) as path:
        dumped = run_kvalloc("dump", str(path), "--json")
        assert dumped.returncode == 0, dumped.stderr
        entry = entry_for(listed_by_another_process(), path)
        assert entry["alive"] and entry["state"] in ("live", "idle")
        assert entry["uptime_s"] is not None

        pruned = listed_by_another_process("--prune")
        assert path.exists() and str(path) not in pruned["removed"]
        assert entry_for(pruned, path)["alive"]


def test_a_writer_without_its_liveness_lock_is_dead_though_its_pid_runs():
    # The pid in the name and the header is this process, alive; the lock is free, so the
    # writer that held it has ended (the pid may be another process in another namespace).
    with prune_lock(exclusive=True), \
            crafted_segment(segment_bytes(writer_pid=os.getpid()), pid=os.getpid(),
                            locked=False) as path:
        dumped = run_kvalloc("dump", str(path))
        assert dumped.returncode == 1 and dumped.stderr.startswith(f"kvalloc dump: process {os.getpid()}, writer")
        assert "is gone" in dumped.stderr
        entry = entry_for(listed_by_another_process(), path)
        assert not entry["alive"] and entry["state"] == "dead"

        pruned = listed_by_another_process("--prune")
        assert str(path) in pruned["removed"] and not path.exists()


def test_a_segment_that_cannot_be_opened_is_listed_as_unreadable(capsys):
    # A symbolic link is never followed (O_NOFOLLOW): the reader cannot open it, as it cannot
    # open another user's segment. It is listed with the reason, not left out, and its live
    # writer's entry is not pruned.
    with prune_lock(exclusive=True), crafted_segment(segment_bytes()) as target:
        link = SHM_DIR / f"kvalloc.{os.getpid()}.{unique_name('link')}"
        link.symlink_to(target)
        try:
            entry = entry_for(listing(capsys, "--prune"), link)
            assert entry is not None and os.path.lexists(link)
            assert entry["state"] == "unreadable" and entry["alive"]
            assert entry["problem_kind"] == "unreadable" and entry["problem"].startswith("cannot open")
            assert "symbolic link" in entry["problem"]
        finally:
            link.unlink()


def test_stray_files_are_listed_as_unreadable_beside_the_live_pools():
    # A directory, a FIFO and a 3 GiB sparse file named like segments. Reading them must not
    # crash (mmap of a directory), hang (opening a FIFO) or run out of memory (mapping 3 GiB
    # under a 2.5 GiB address-space limit), and must not hide the live pool beside them.
    name = unique_name("beside")
    stray = {kind: SHM_DIR / f"kvalloc.{os.getpid()}.{unique_name(kind)}"
             for kind in ("dir", "fifo", "sparse")}
    limit = int(2.5 * (1 << 30))

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        stray["dir"].mkdir()
        os.mkfifo(stray["fifo"])
        with open(stray["sparse"], "wb") as sparse:
            sparse.truncate(3 << 30)
        with pykvalloc.Pool(16 << 20, name=name) as pool:
            pool.publish()
            done = run_kvalloc("ls", "--json", timeout=60, preexec_fn=limit_memory)
            assert done.returncode == 0, done.stderr
            listed = json.loads(done.stdout)
            assert entry_for(listed, SHM_DIR / pool.segment_name[1:])["pool"] == name
            entries = {kind: entry_for(listed, path) for kind, path in stray.items()}
            problems = {kind: entry["problem"] for kind, entry in entries.items()}
            assert entries["dir"]["problem_kind"] == "unreadable" and "a directory" in problems["dir"]
            assert entries["fifo"]["problem_kind"] == "unreadable" and "a FIFO" in problems["fifo"]
            # Its magic stays zero: a writer still setting it up, or no segment.
            assert entries["sparse"]["problem_kind"] == "not a segment"
            for kind, path in stray.items():
                assert entry_for(listed, path)["state"] == "unreadable" and path.exists(), kind

            done = run_kvalloc("dump", str(stray["dir"]), timeout=60)
            assert done.returncode == 1
            assert done.stderr == f"kvalloc dump: {stray['dir']} is a directory, not a segment file\n"
    finally:
        if stray["dir"].is_dir():
            stray["dir"].rmdir()
        stray["fifo"].unlink(missing_ok=True)
        stray["sparse"].unlink(missing_ok=True)


def test_a_pid_no_process_can_have_is_a_dead_writer_not_a_crash(capsys, monkeypatch):
    # The file name allows ten digits; past 2**31 os.kill raised OverflowError out of `ls`.
    monkeypatch.setenv("COLUMNS", "200")
    with prune_lock(exclusive=True), \
            crafted_segment(segment_bytes(), pid=9_999_999_999) as segment, \
            crafted_segment(b"\0" * 64, pid=2**32 - 1) as stray:
        listed = listing(capsys)
        entry = entry_for(listed, segment)
        assert entry["pid"] == 9_999_999_999 and not entry["alive"] and entry["state"] == "dead"
        entry = entry_for(listed, stray)
        assert not entry["alive"] and entry["state"] == "unreadable"
        assert main(["ls"]) == 0
        assert "9999999999" in capsys.readouterr().out
        assert set(listing(capsys, "--prune")["removed"]) >= {str(segment), str(stray)}
        assert not segment.exists() and not stray.exists()


def test_a_segment_directory_that_cannot_be_listed_is_a_clear_error(capsys, monkeypatch,
                                                                   tmp_path):
    not_a_directory = tmp_path / "shm"
    not_a_directory.write_text("")
    monkeypatch.setattr(ls, "list_segments", lambda: list_segments(not_a_directory))
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvalloc ls: cannot list the segments in "
                          f"{not_a_directory}: Not a directory")
    assert "Traceback" not in err


def test_ls_help(capsys):
    with pytest.raises(SystemExit):
        main(["ls", "--help"])
    assert "--prune" in capsys.readouterr().out


def test_names_are_shown_as_written_not_read_as_markup(capsys, monkeypatch):
    # A process may call itself "[/]engine": ls handed it to Rich as markup and died with a
    # MarkupError (one odd name broke the whole listing); "[engine]" vanished from its row.
    monkeypatch.setenv("COLUMNS", "200")
    with writer_named("[/]engine") as (first, _), writer_named("[engine]") as (second, _):
        assert main(["ls"]) == 0
        table = capsys.readouterr().out
        assert "[/]engine" in next(line for line in table.splitlines() if first in line)
        assert "[engine]" in next(line for line in table.splitlines() if second in line)


def test_a_kv_cache_is_listed_by_its_blocks_not_its_region(capsys, monkeypatch):
    # The pool counts a KV cache's whole region as one allocation, so "use" said 100.0 % for
    # every KV cache, full or empty; its blocks say how full it is.
    monkeypatch.setenv("COLUMNS", "200")
    name = unique_name("kvls")
    with pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64, name=name) as cache:
        held = cache.allocate(16 * 16)                       # 16 of 64 blocks used
        cache.allocate(8 * 16, block_keys=list(range(1, 9))).free()  # 8 more kept by the prefix cache
        cache.publish()
        assert main(["ls"]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if name in line)
        assert "KV 25.0% +12.5% cached" in row, row
        entry = next(e for e in listing(capsys)["segments"] if e["pool"] == name)
        assert (entry["kv_used_blocks"], entry["kv_cached_blocks"], entry["kv_total_blocks"]) == (16, 8, 64)
        held.free()


def test_at_80_columns_piped_the_columns_that_matter_show_whole():
    # Piped, Rich lays the table out in 80 columns: every column was cut, the pid a user needs
    # for `kvalloc dump` included. The columns that matter stay whole; the rest are dropped.
    name = unique_name("a-long-pool-name-for-the-eighty-column-listing")
    with pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64, name=name) as cache:
        held = cache.allocate(16 * 16)
        cache.publish()
        listed = run_kvalloc("ls")  # stdout is a pipe; the environment sets no COLUMNS
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), lines
        heading = next(line for line in lines if "pid" in line)
        assert "state" in heading and "use" in heading and "pool" in heading
        row = next(line for line in lines if f" {os.getpid()} " in line)
        assert "KV 25.0% +0.0% cached" in row and "live" in row
        # The pool's name is the one column cut, with an ellipsis (other runs' pools listed
        # beside it may take some of its room).
        assert name[:3] in row and name not in row and "…" in row
        for dropped in ("up", "in use"):  # the least needed go first
            assert f" {dropped} " not in heading
        held.free()


def test_a_wide_terminal_shows_every_column():
    with writer_named("wide") as (name, _):
        found = next(found for found in list_segments() if found.name == name)
        entry = ls.describe(found)
        assert entry is not None
        table = ls._table([entry], width=200)
        assert [column.header for column in table.columns] == [c for c, _ in ls._COLUMNS]
        narrow = [column.header for column in ls._table([entry], width=50).columns]
        assert {"pid", "pool", "use", "state"} <= set(narrow) and "up" not in narrow
