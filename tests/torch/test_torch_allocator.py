"""pykvalloc.torch with the installed torch (make test-torch): what can be checked without a GPU.
The allocator's behaviour is test_torch_alloc's (C, fake driver) and tools/gpu_check.py's (a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pykvalloc
import pykvalloc.torch as kvtorch
from conftest import TREE

torch = pytest.importorskip("torch")


def test_import_of_pykvalloc_leaves_torch_alone() -> None:
    # This tree's package, as conftest.py arranges for the tests themselves.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'pykvalloc' not in type(f).__module__]; "
            f"sys.path.insert(0, {str(TREE)!r}); "
            "import pykvalloc, pykvalloc.torch; "
            "assert pykvalloc.__file__.startswith(sys.path[0]), pykvalloc.__file__; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_pluggable_allocator_loads_the_entry_points() -> None:
    assert kvtorch.library_path().is_file()
    chosen = kvtorch.allocator()
    assert isinstance(chosen, torch.cuda.memory.CUDAPluggableAllocator)


def test_capacity_is_checked() -> None:
    with pytest.raises(pykvalloc.InvalidArgument):
        kvtorch.allocator(capacity=0)
    assert kvtorch.stats(0) is None  # no pool before the first allocation
