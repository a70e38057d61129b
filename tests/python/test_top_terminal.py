"""``kvalloc top`` in a real terminal: tmux runs it at 80 x 24 against a KV cache this test
publishes, and the test reads the screen back (``capture-pane``) and presses keys
(``send-keys``). The pilot tests (test_tui.py) check the widgets; this checks what a terminal
shows. tmux comes with the system packages (scripts/ensure-system-deps.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from stats_writer import unique_name
from support import clean_env

import pykvalloc

MiB = 1 << 20
POLLS = 600   # of 0.1 s: a bound against a hang that a loaded machine never reaches

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (scripts/ensure-system-deps.sh "
                                       "installs it)")


class Terminal:
    """One tmux server of its own (-L), one 80 x 24 window running a command."""

    def __init__(self, command: list[str]) -> None:
        self.socket = unique_name("tmux")
        # The window outlives the command, to show how it ended.
        shell = " ".join(_quote(part) for part in command) + "; echo exit status $?; sleep 600"
        self._tmux("new-session", "-d", "-x", "80", "-y", "24", "-s", "top", shell)

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=60, env=clean_env(TERM="xterm-256color"))
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> list[str]:
        return self._tmux("capture-pane", "-p", "-t", "top").splitlines()

    def wait_for(self, what: Callable[[list[str]], bool]) -> list[str]:
        for _ in range(POLLS):
            lines = self.screen()
            if what(lines):
                return lines
            time.sleep(0.1)
        raise AssertionError("hung: the terminal never showed it:\n" + "\n".join(self.screen()))

    def press(self, key: str) -> None:
        self._tmux("send-keys", "-t", "top", key)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=60)


def _quote(part: str) -> str:
    return "'" + part.replace("'", "'\\''") + "'"


@pytest.fixture
def engine() -> Iterator[tuple[str, pykvalloc.KVCache]]:
    """A pool holding a KV cache with two sequences, and buffers around it."""
    name = unique_name("term")
    with pykvalloc.Pool(64 * MiB, name=name, trace=True, pages="small",
                        publish_interval_ms=50) as pool, \
            pykvalloc.KVCache(64, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                              pool=pool, trace=True) as cache:
        held = [cache.allocate(4 * 16), cache.allocate(4 * 16, block_keys=[1, 2, 3, 4])]
        buffers = [pool.alloc(size) for size in (3 * MiB, 700 << 10)]
        metadata = [pool.alloc(64) for _ in range(100)]
        cache.publish()
        yield name, cache
        for allocation in (*buffers, *metadata):
            pool.free(allocation)
        for sequence in held:
            sequence.free()


def test_top_at_80x24_in_a_real_terminal(engine):
    name, cache = engine
    terminal = Terminal([sys.executable, "-m", "kvalloc_cli", "top", name, "--interval", "0.2"])
    try:
        lines = terminal.wait_for(lambda lines: any("KV cache" in line for line in lines)
                                  and any("hit " in line for line in lines))
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        header = lines[0]
        assert f"pid {os.getpid()}" in header and "KV 12.5% +0.0% cached" in header
        for title in ("KV cache", "sequences", "namespaces", "latency"):
            assert any(title in line for line in lines), title
        assert any("used 8 12.5%" in line for line in lines)
        assert any(line.strip().startswith("peak used 8 12.5%") for line in lines)
        latency = next(line for line in lines if "KV allocate" in line)
        assert "≤" in latency  # the KV cache's call latencies, beside the namespaces
        footer = terminal.wait_for(lambda lines: "↻" in lines[-1])[-1]
        assert "+ - ↻ 0.2 s" in footer and "v Pool view" in footer

        terminal.press("v")  # the pool's page
        lines = terminal.wait_for(lambda lines: any("heap map" in line for line in lines))
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        for title in ("heap map", "free blocks per order", "slab classes", "recent operations"):
            assert any(title in line for line in lines), title
        assert any("64 B ▕" in line for line in lines)
        terminal.press("v")  # back to the KV cache's
        terminal.wait_for(lambda lines: any("KV cache" in line for line in lines))

        # The KV figures move with the cache: a third sequence, and the screen follows.
        third = cache.allocate(8 * 16)
        cache.publish()
        terminal.wait_for(lambda lines: any("used 16 25.0%" in line for line in lines))
        third.free()

        terminal.press("+")  # more often
        terminal.wait_for(lambda lines: "+ - ↻ 0.1 s" in lines[-1])
        terminal.press("q")
        terminal.wait_for(lambda lines: any("exit status 0" in line for line in lines))
    finally:
        terminal.close()


def test_top_waits_for_a_named_pool_and_ctrl_c_quits():
    name = unique_name("later")
    terminal = Terminal([sys.executable, "-m", "kvalloc_cli", "top", name, "--interval", "0.2"])
    try:
        lines = terminal.wait_for(lambda lines: any("waiting for pool" in line for line in lines))
        assert f"waiting for pool '{name}' to publish…" in lines[0]
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        with pykvalloc.Pool(16 * MiB, name=name, publish_interval_ms=50) as pool:
            pool.publish()
            lines = terminal.wait_for(lambda lines: f"pid {os.getpid()}" in lines[0]
                                      and " up " in lines[0])
            assert lines[0].strip().startswith(name) and "use " in lines[0]
            terminal.press("C-c")
            terminal.wait_for(lambda lines: any("exit status 0" in line for line in lines))
    finally:
        terminal.close()


def test_the_kv_page_in_a_real_terminal_pins_rates_sequences_and_namespaces():
    from test_tui_kv import runs_text, serving

    name = unique_name("kvterm")
    with serving(name) as (_, truth):
        kv, longest, again = truth["stats"], truth["longest"], truth["again"]
        terminal = Terminal([sys.executable, "-m", "kvalloc_cli", "top", name, "--interval",
                             "0.2"])
        try:
            lines = terminal.wait_for(lambda lines: any("blocks of " in line for line in lines))
            assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
            text = "\n".join(lines)
            assert f"pinned {kv.pinned_blocks}" in text
            assert f"readmit {kv.readmit_hit_tokens / kv.readmit_query_tokens:>6.1%}" in text
            assert f"live 2  pins 1  longest {longest.num_tokens:,} tok" in text
            assert f"blocks of {longest.handle:#x}: {runs_text(longest.block_table)}" in text
            namespaces = {line.split()[0]: line.split()[1:4] for line in lines
                          if line.strip()[:1].isdigit() and len(line.split()) > 5}
            assert namespaces["7"] == ["1", "0", str(longest.num_blocks)]
            terminal.press("Down")
            terminal.wait_for(lambda lines: any(f"blocks of {again.handle:#x}: "
                                                f"{runs_text(again.block_table)}" in line
                                                for line in lines))
            terminal.press("q")
            terminal.wait_for(lambda lines: any("exit status 0" in line for line in lines))
        finally:
            terminal.close()


def test_the_demo_in_a_real_terminal_shows_its_tenants_and_pinned_blocks():
    # kvalloc demo on a terminal: its replay serves 4 tenants with the system prompt pinned in
    # each, and the inspector it opens shows a namespace row per tenant and the pinned blocks.
    from kvalloc_cli.demo import TENANTS

    terminal = Terminal([sys.executable, "-m", "kvalloc_cli", "demo", "--speed", "10"])
    try:
        def tenants_and_pins(lines: list[str]) -> bool:
            rows = {line.split()[0] for line in lines
                    if line.strip()[:1].isdigit() and len(line.split()) > 5}
            pinned = [line.split("pinned ")[1].split()[0] for line in lines if "pinned " in line]
            return rows >= {str(t) for t in range(TENANTS)} and any(p not in ("0", "-") for p in pinned)

        lines = terminal.wait_for(tenants_and_pins)
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        assert any("namespaces" in line for line in lines)
        terminal.press("q")  # the report of the run so far follows
        lines = terminal.wait_for(lambda lines: any("exit status 0" in line for line in lines))
        text = " ".join(" ".join(lines).split())
        assert "system prompt pinned" in text or "Eviction never takes a pinned block" in text, text
    finally:
        terminal.close()
