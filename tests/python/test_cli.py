"""The kvalloc command: --version, --help and the demo, in process and as the installed script."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import clean_env

import pykvalloc
from pykvalloc import _ffi
from pykvalloc.cli import main


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
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for expected in ("Pool 'kvalloc-demo': allocated", "token metadata", "KV pages",
                     "read back through another: ok", "kva_check: every invariant holds",
                     "Pool statistics", "fragmentation", "Free buddy blocks per order",
                     "Slab size classes in use"):
        assert expected in out, expected


def test_demo_options(capsys):
    assert main(["demo", "--capacity", "16M", "--pages", "small"]) == 0
    out = capsys.readouterr().out
    assert "small pages, 4 KiB pages" in out and "16 MiB" in out


@pytest.mark.parametrize("capacity", ["1M", "lots"])
def test_demo_rejects_bad_capacity(capsys, capacity):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--capacity", capacity])
    assert info.value.code == 2
    assert "--capacity" in capsys.readouterr().err


def test_library_errors_become_a_message_and_status_1(capsys):
    hugetlb_free = next((int(line.split()[1]) for line in
                         Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("HugePages_Free:")), 0)
    if hugetlb_free:
        pytest.skip("this machine has hugetlb pages reserved")
    assert main(["demo", "--pages", "hugetlb"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvalloc demo: BackendError: backing memory unavailable")


def test_installed_script_runs_headless_and_fast():
    script = Path(sys.executable).parent / "kvalloc"
    if not script.exists():
        script = Path(shutil.which("kvalloc") or "")
    if not script.is_file():
        pytest.skip("the kvalloc script is not installed beside this interpreter")
    started = time.perf_counter()
    result = subprocess.run([str(script), "demo"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, env=clean_env(), timeout=60)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    assert "Free buddy blocks per order" in result.stdout
    assert elapsed < 5, f"kvalloc demo took {elapsed:.1f} s"


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "pykvalloc", "--version"],
                            capture_output=True, text=True, env=clean_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvalloc (pykvalloc)")
