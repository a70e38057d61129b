"""The command without its extras: pykvalloc installs with numpy alone, and the ``kvalloc`` script
comes with it; each command that lacks a module of an extra says in one line how to install it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import clean_env

# Runs the command (argv[2:]) with the modules of argv[1] (comma-separated) unimportable, as in
# an install without their extra, and prints its exit status.
WITHOUT = r"""
import json, os, sys

class Unimportable:
    def __init__(self, names):
        self.names = names
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Unimportable(set(sys.argv[1].split(","))))
import pykvalloc
from kvalloc_cli import main
argv = sys.argv[2:]
if argv[:1] == ["watched-demo"]:
    import argparse
    from kvalloc_cli import demo
    status = demo.watched(argparse.Namespace(requests=10, kv_size=2 << 30, speed=30.0))
elif argv[:1] == ["dump-a-pool"]:
    with pykvalloc.Pool(16 << 20, name=f"extras-{os.getpid()}") as pool:
        pool.publish()
        status = main(["dump", pool.segment_name.lstrip("/")] + argv[1:])
else:
    status = main(argv)
print(json.dumps({"status": status, "textual": "textual" in sys.modules}), file=sys.stderr)
"""


def run_without(modules: str, *argv: str) -> tuple[dict, list[str], str]:
    """(the verdict line as a dict, the other lines of stderr, stdout)."""
    done = subprocess.run([sys.executable, "-c", WITHOUT, modules, *argv], capture_output=True,
                          text=True, env=clean_env(), stdin=subprocess.DEVNULL, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert lines and done.returncode == 0, done.stderr
    return json.loads(lines[-1]), lines[:-1], done.stdout


@pytest.mark.parametrize("argv", [["--version"], ["ls"], ["demo", "--no-tui"], ["top"]])
def test_without_rich_every_command_says_to_install_the_cli_extra(argv):
    verdict, said, out = run_without("rich", *argv)
    assert verdict["status"] == 1
    assert said == ["kvalloc: the command needs rich: pip install 'pykvalloc[cli]'"]
    assert out == ""


def test_without_textual_top_says_to_install_the_tui_extra():
    verdict, said, out = run_without("textual", "top", "no-such-pool")
    assert verdict["status"] == 1
    assert said == ["kvalloc top: needs textual: pip install 'pykvalloc[tui]'"]
    assert out == ""


def test_without_textual_the_demo_on_a_terminal_says_to_install_the_tui_extra():
    verdict, said, out = run_without("textual", "watched-demo")
    assert verdict["status"] == 1
    assert said == ["kvalloc demo: watching live needs textual: pip install 'pykvalloc[tui]' "
                    "(--no-tui replays without it)"]
    assert out == ""


def test_without_textual_the_headless_demo_and_dump_run():
    # Neither loads Textual: dump prints with kvalloc_tui.render, which needs rich alone.
    verdict, _, out = run_without("textual", "demo", "--no-tui", "--requests", "20")
    assert verdict == {"status": 0, "textual": False}
    assert "prefix hit rate" in out
    verdict, _, out = run_without("textual", "dump-a-pool")
    assert verdict == {"status": 0, "textual": False}
    assert "Pool statistics" in out
