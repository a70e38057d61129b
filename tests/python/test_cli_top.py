"""``kvalloc top`` as a command: its arguments and refusals. The app itself: test_tui.py."""

from __future__ import annotations

import pytest
from stats_writer import unique_name

from pykvalloc import stats
from kvalloc_cli import main, top


def test_help_lists_the_keys(capsys):
    with pytest.raises(SystemExit) as info:
        main(["top", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "PID|NAME" in out and "--interval" in out and "space pause" in out


@pytest.mark.parametrize("interval", ["0", "11", "soon"])
def test_bad_intervals_are_refused(capsys, interval):
    with pytest.raises(SystemExit) as info:
        main(["top", "--interval", interval])
    assert info.value.code == 2
    assert "--interval" in capsys.readouterr().err


def test_a_pool_that_does_not_exist_yet_is_waited_for_not_refused(capsys):
    # The app waits for it (test_tui.py, test_top_terminal.py); here the only refusal left is
    # the missing terminal.
    assert main(["top", unique_name("absent")]) == 1  # pytest's stdin is no terminal
    err = capsys.readouterr().err
    assert "needs a terminal" in err and "no pool segment matches" not in err


@pytest.mark.parametrize("name", ["bad name", "kv:cache", "é", "x" * 64, "", "pool\n"])
def test_a_name_no_pool_can_have_is_a_usage_error_not_a_wait(capsys, name):
    with pytest.raises(SystemExit) as info:
        main(["top", name])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "can never name a pool" in err
    assert "1 to 63 characters of A-Z a-z 0-9 _ . -" in err


def test_a_missing_segment_path_is_an_error_not_a_wait(capsys):
    assert main(["top", "/dev/shm/kvalloc.1.absent"]) == 1
    assert capsys.readouterr().err.startswith("kvalloc top: no segment")


def test_no_live_pool_at_all_is_no_error(capsys, monkeypatch):
    # Other test runs may own live pools on this machine; here the listing is empty. top waits
    # for a pool to appear (test_tui.py), so the only refusal left is the missing terminal.
    monkeypatch.setattr(top, "list_segments", lambda: [])
    assert main(["top"]) == 1  # pytest's stdin is no terminal
    err = capsys.readouterr().err
    assert "needs a terminal" in err and "no live pools" not in err


def test_a_segment_directory_that_cannot_be_listed_is_a_clear_error(capsys, monkeypatch,
                                                                   tmp_path):
    not_a_directory = tmp_path / "shm"
    not_a_directory.write_text("")
    monkeypatch.setattr(top, "list_segments", lambda: stats.list_segments(not_a_directory))
    assert main(["top"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvalloc top: cannot list the segments in ")
    assert "Traceback" not in err


def test_without_a_terminal_it_refuses_instead_of_running_blind(capsys, monkeypatch):
    # Without a terminal nothing could press q: the app ran on forever, writing escape codes.
    monkeypatch.setattr(top, "list_segments", lambda: [_Live()])
    assert main(["top"]) == 1  # pytest's stdin is no terminal
    assert "kvalloc top: needs a terminal" in capsys.readouterr().err


class _Live:
    def process_alive(self) -> bool:
        return True
