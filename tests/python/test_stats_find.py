"""Finding a segment among many: a name that matches none, or a pid that matches many, is a short
error naming a few of the candidates and how many more there are, not a list of them all."""

from __future__ import annotations

import os

import pytest
from stats_writer import unique_name

from pykvalloc import stats
from kvalloc_cli import dump, main
from pykvalloc.errors import AmbiguousSegment, SegmentNotFound

SEGMENTS = 3000  # a /dev/shm where an engine left a few thousand segments


@pytest.fixture
def crowded(tmp_path):
    """A directory of ``SEGMENTS`` files named like segments of this process (so alive)."""
    for index in range(SEGMENTS):
        (tmp_path / f"kvalloc.{os.getpid()}.pool-{index:05d}").touch()
    return tmp_path


def test_a_name_that_matches_nothing_lists_five_candidates_and_counts_the_rest(crowded):
    with pytest.raises(SegmentNotFound) as info:
        stats.find_segment("absent", crowded)
    message = str(info.value)
    assert len(message) < 500, len(message)
    shown = [f"kvalloc.{os.getpid()}.pool-{index:05d}" for index in range(5)]
    assert f"(segments there: {', '.join(shown)} and {SEGMENTS - 5:,} more)" in message
    assert f"pool-{5:05d}" not in message


def test_a_pid_that_matches_many_lists_five_of_them(crowded):
    with pytest.raises(AmbiguousSegment) as info:
        stats.find_segment(str(os.getpid()), crowded)
    message = str(info.value)
    assert len(message) < 500, len(message)
    assert f"matches {SEGMENTS:,} segments: kvalloc.{os.getpid()}.pool-00000, " in message
    assert f"and {SEGMENTS - 5:,} more; name one of them" in message


def test_a_few_candidates_are_all_listed(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"kvalloc.{os.getpid()}.{name}").touch()
    with pytest.raises(SegmentNotFound, match=rf"\(segments there: kvalloc\.{os.getpid()}\.a, "
                                              rf"kvalloc\.{os.getpid()}\.b\)$"):
        stats.find_segment("c", tmp_path)
    with pytest.raises(SegmentNotFound, match=r"\(segments there: none\)$"):
        stats.find_segment("c", tmp_path / "empty")


def test_kvalloc_dump_of_an_unknown_pool_says_so_in_one_short_line(crowded, capsys, monkeypatch):
    monkeypatch.setattr(dump, "open_segment", lambda target: stats.open_segment(target, crowded))
    target = unique_name("absent")
    assert main(["dump", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvalloc dump: no pool segment matches {target!r}")
    assert len(err) < 500 and err.count("\n") == 1


@pytest.mark.parametrize("target", ["9" * 5000, "p" * 5000, "²", "/dev/shm/" + "x" * 5000])
def test_a_huge_target_is_cut_short_in_the_message(crowded, capsys, monkeypatch, target):
    # A 5,000-character target was echoed whole (a 5 KB line), and one of more digits than int()
    # reads raised ValueError as soon as segments were there to compare pids with.
    monkeypatch.setattr(dump, "open_segment", lambda target: stats.open_segment(target, crowded))
    assert main(["dump", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvalloc dump: ") and "Traceback" not in err
    assert len(err) < 500 and err.count("\n") == 1, err
