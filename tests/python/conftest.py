"""Fixtures of the pykvalloc tests."""

from __future__ import annotations

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
