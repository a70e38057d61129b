"""The kvalloc command: --version, --help and the demo, in process and as the installed script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import clean_env

import pykvalloc
from pykvalloc import _ffi
from kvalloc_cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvalloc (pykvalloc) {pykvalloc.__version__}\n")
    assert f"library: {_ffi.load().path}" in out


def test_help_lists_the_demo(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kvalloc" in out and "demo" in out and "--version" in out


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_demo(capsys):
    assert main(["demo", "--requests", "300", "--no-tui"]) == 0
    said = capsys.readouterr()
    out = said.out
    # What the demo is doing is a status line, on stderr; stdout holds the report alone.
    assert "Replaying 300 requests of the embedded workload" in said.err
    assert "2 GiB paged KV cache" in said.err and "Replaying" not in out
    for expected in ("Replay of default workload (300 requests", "prefix hit rate",
                     "KV use at first preemption", "mean KV use while busy", "allocator share of the run",
                     "inside the library"):
        assert expected in out, expected
    row = next(line for line in out.splitlines() if "finished" in line)
    assert "300" in row


@pytest.mark.parametrize("argv", [["--kv-size", "lots"], ["--requests", "many"]])
def test_demo_rejects_bad_options(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2


def test_a_kv_size_that_holds_no_token_is_a_usage_error(capsys):
    # 1,000 bytes of KV hold not one token of this model: said before anything runs.
    assert main(["demo", "--kv-size", "1000", "--no-tui"]) == 2
    said = capsys.readouterr()
    assert said.err == "kvalloc demo: --kv-size 1000 B holds not one token of this model (128 KiB per token)\n"
    assert said.out == ""


def test_demo_rejects_the_requests_that_can_never_fit_and_reports_the_rest(capsys):
    # 64 MiB of KV holds 512 tokens of this model: the workload's long requests can never fit.
    # They are rejected, as an engine rejects them; the replay used to end at the first one.
    assert main(["demo", "--kv-size", "64M", "--requests", "100", "--no-tui"]) == 1
    out = capsys.readouterr().out
    assert "which can never complete on this KV cache" in " ".join(out.split())    # however it wraps
    row = next(line for line in out.splitlines() if "rejected" in line and "│" in line)
    assert int(row.split()[-2]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--requests", "0"], "argument --requests: must be at least 1, not 0"),
    (["--requests", "-1"], "argument --requests: must be at least 1, not -1"),
    (["--speed", "nan"], "argument --speed: must be a finite number above 0, not 'nan'"),
    (["--speed", "inf"], "argument --speed: must be a finite number above 0"),
    (["--speed", "0"], "argument --speed: must be a finite number above 0"),
    (["--kv-size", "0"], "argument --kv-size: must be at least 1 byte"),
])
def test_demo_refuses_bad_numbers_before_it_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--no-tui", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Replaying" not in captured.out


def test_installed_script_runs_headless_and_prints_the_report():
    script = Path(sys.executable).parent / "kvalloc"
    if not script.exists():
        script = Path(shutil.which("kvalloc") or "")
    if not script.is_file():
        pytest.skip("the kvalloc script is not installed beside this interpreter")
    # Without a terminal the demo replays at full speed and prints its report. The timeout
    # guards against a hang only (conftest.py says "hung"): how fast it runs is for benchmarks.
    result = subprocess.run([str(script), "demo"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "prefix hit rate" in result.stdout and "KV use at first preemption" in result.stdout


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "kvalloc_cli", "--version"],
                            capture_output=True, text=True, env=clean_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvalloc (pykvalloc)")


def test_demo_on_a_terminal_watches_the_replay_live_then_reports():
    # A real pseudo-terminal: the demo starts the replay in a second process and opens the
    # inspector on it; q quits the inspector and the report follows.
    import pty
    import select
    script = Path(sys.executable).parent / "kvalloc"
    if not script.is_file():
        pytest.skip("the kvalloc script is not installed beside this interpreter")
    pid, fd = pty.fork()
    if pid == 0:
        env = clean_env()
        env.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execve(str(script), [str(script), "demo", "--requests", "300", "--speed", "100"], env)
    seen = b""

    def read_until(text: bytes, idle_polls: int = 1200) -> None:
        # The bound guards against a hang only (polls of 0.1 s with nothing to read, counted,
        # not timed): it ends as soon as ``text`` shows.
        nonlocal seen
        idle = 0
        while text not in seen:
            assert idle < idle_polls, f"hung: no {text!r} on the terminal after {idle} idle polls"
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready:
                idle += 1
                continue
            try:
                seen += os.read(fd, 65536)
            except OSError:
                return

    read_until(b"KV cache")                    # the inspector is drawing the live pool
    assert b"kvalloc-demo-" in seen and b"KV cache" in seen
    read_until(b"xited")                       # 300 requests at 100x take about a second
    assert b"xited" in seen                    # the inspector says the engine exited, and lives
    os.write(fd, b"q")
    read_until(b"allocator share")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert b"prefix hit rate" in seen and b"allocator share" in seen


def test_plot_without_matplotlib_is_refused_before_the_replay(capsys, monkeypatch, tmp_path):
    # matplotlib is an extra ('pykvalloc[plot]'): without it --plot once ran the whole replay,
    # printed its report and then died with a traceback.
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "matplotlib" else real(name, *rest))
    assert main(["replay", "--requests", "5", "--plot", str(tmp_path / "use.png")]) == 2
    said = capsys.readouterr()
    assert "--plot needs matplotlib: pip install 'pykvalloc[plot]'" in said.err
    assert "Traceback" not in said.err and said.out == ""  # nothing replayed
    assert not (tmp_path / "use.png").exists()


def test_quitting_the_watched_demo_early_reports_the_run_so_far(capsys, monkeypatch):
    # On a terminal the demo's replay runs in a child while kvalloc top watches it. Quitting
    # before the replay ended once printed "the replay did not finish" and exit status 1; the
    # replay now stops at its next step and reports what it got through. The real app, driven
    # by Textual's pilot in the terminal's place, quits with q after a second.
    import argparse
    import asyncio

    import kvalloc_tui.app
    from kvalloc_cli import demo

    class Watched(kvalloc_tui.app.KvallocTop):
        def run(self, *args, **kwargs):
            async def watch_then_quit() -> None:
                async with self.run_test(size=(100, 30)) as pilot:
                    await pilot.pause(1.0)
                    await pilot.press("q")
            asyncio.run(watch_then_quit())

    monkeypatch.setattr(kvalloc_tui.app, "KvallocTop", Watched)
    status = demo.watched(argparse.Namespace(requests=2000, kv_size=2 << 30, speed=5.0))
    said = capsys.readouterr()
    assert status == 0, said.err
    text = " ".join(said.out.split())  # as wrapped to the terminal's width
    assert "stopped early, as asked" in text and "of 2,000 requests had finished" in text


@pytest.mark.parametrize("argv", [["demo", "--requests", "20", "--no-tui"],
                                  ["replay", "--requests", "3", "--quiet", "-o", "/dev/full"]])
def test_output_that_cannot_be_written_is_one_line_not_a_traceback(argv):
    # Writing to a full disk (here /dev/full: stdout for the demo, the -o file for the replay)
    # raised OSError through the command.
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "kvalloc_cli", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=clean_env(), timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "No space left on device" in line]
    assert errors == [f"kvalloc {argv[0]}: [Errno 28] No space left on device"], done.stderr


@pytest.mark.parametrize("option", ["--time-scale", "--speed"])
def test_speeds_and_scales_outside_their_range_are_refused(capsys, option):
    # 1e-320 passed as "finite and above 0": "inf s" of simulated time in the report (and
    # Infinity in its JSON), or a timestamp overflow in the pacer.
    for value in ("1e-320", "1e-7", "1e7"):
        with pytest.raises(SystemExit) as info:
            main(["replay", "--requests", "3", option, value])
        assert info.value.code == 2
        assert f"argument {option}: must lie between 1e-06 and 1e+06" in capsys.readouterr().err


def test_the_json_report_is_strict_json(tmp_path, capsys):
    import argparse

    from kvalloc_cli.output import emit_json

    out = tmp_path / "r.json"
    figures = {"rate": float("nan"), "rows": [1.5, float("inf")], "nested": {"x": float("-inf")}}
    strict = {"rate": None, "rows": [1.5, None], "nested": {"x": None}}
    emit_json(argparse.Namespace(json=False, output=out), figures)
    assert json.loads(out.read_text()) == strict
    said = capsys.readouterr()
    assert said.out == "" and said.err == f"wrote {out}\n"
    emit_json(argparse.Namespace(json=True, output=None), figures)
    assert json.loads(capsys.readouterr().out) == strict


def test_help_states_the_conventions(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for said in ("conventions of every command:", "--json", "-o FILE", "--speed", "stderr",
                 '"kvalloc COMMAND: message"', "pip install 'pykvalloc[cli,tui]'"):
        assert said in out, said


def test_a_usage_error_is_one_line():
    done = subprocess.run([sys.executable, "-m", "kvalloc_cli", "replay", "--speed", "fast"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "kvalloc replay: argument --speed: not a number: 'fast'\n"
