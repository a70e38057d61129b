"""``kvalloc ls``: live pools with their figures, and --prune for what killed writers left."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from stats_writer import Writer, crafted_segment, prune_lock, unique_name

import pykvalloc
from pykvalloc.cli import main


def listing(capsys, *options: str) -> dict:
    assert main(["ls", "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def entry_for(listing: dict, path) -> dict | None:
    return next((e for e in listing["segments"] if e["segment"] == str(path)), None)


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
        assert entry["problem"].startswith("BadMagic")


def test_ls_help(capsys):
    with pytest.raises(SystemExit):
        main(["ls", "--help"])
    assert "--prune" in capsys.readouterr().out
