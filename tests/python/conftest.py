"""Fixtures of the pykvalloc tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import MiB

import pykvalloc
from pykvalloc import _ffi


def pytest_report_header(config: pytest.Config) -> str:
    try:
        library = str(_ffi.find_library())
    except pykvalloc.KvallocError as exc:
        library = f"not found ({exc})"
    package = Path(pykvalloc.__file__).parent
    return f"pykvalloc {pykvalloc.__version__} from {package}; libkvalloc: {library}"


@pytest.fixture
def pool() -> Iterator[pykvalloc.Pool]:
    """A 16 MiB pool with the library's default settings, closed after the test."""
    with pykvalloc.Pool(16 * MiB, name="pytest") as p:
        yield p


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test's timeout on a child process guards against a hang and never judges speed: when
    one runs out, the failure says that the child hung."""
    try:
        return (yield)
    except subprocess.TimeoutExpired as exc:
        command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
        pytest.fail(f"hung: {command[:300]} did not exit within {exc.timeout:.3g} s")
