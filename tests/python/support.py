"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pykvalloc import _ffi

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def clean_env(**overrides: str) -> dict[str, str]:
    """The environment for a child process: no library override unless asked for."""
    env = {k: v for k, v in os.environ.items() if k not in (_ffi.ENV_VAR, "PYTHONPATH")}
    env.update(overrides)
    return env


def run_python(code: str, env: dict[str, str] | None = None,
               cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (this one's) so that a crash cannot take pytest down
    with it: a segfault shows up as a negative return code."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env if env is not None else clean_env(), cwd=cwd, timeout=timeout)


def run_kvalloc(*args: str, timeout: float = 60,
                preexec_fn: Any = None) -> subprocess.CompletedProcess:
    """The ``kvalloc`` command in a fresh interpreter (``python -m kvalloc_cli``), as a user runs
    it; a command that hangs fails the test with TimeoutExpired instead of hanging it."""
    return subprocess.run([sys.executable, "-m", "kvalloc_cli", *args], capture_output=True,
                          text=True, env=clean_env(), timeout=timeout, preexec_fn=preexec_fn)


def mapped(address: int) -> bool:
    """Whether the address lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False
