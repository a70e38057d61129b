"""What importing the library pulls in: ``pykvalloc`` sits below the command (``kvalloc_cli``) and
the inspector (``kvalloc_tui``), so none of its modules imports them, their dependencies
(rich, Textual, psutil, matplotlib) or an engine."""

from __future__ import annotations

import json

from support import run_python

ABOVE_THE_LIBRARY = ("kvalloc_cli", "kvalloc_tui", "rich", "textual", "psutil", "matplotlib",
                     "torch", "vllm")

IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json, pkgutil, sys
import pykvalloc
# Python modules only: the shared library beside them is no extension module.
names = sorted(m.name for m in pkgutil.walk_packages(pykvalloc.__path__, "pykvalloc.")
               if m.name != "pykvalloc.__main__"
               and importlib.util.find_spec(m.name).origin.endswith(".py"))
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def test_no_module_of_the_library_imports_what_sits_above_it():
    done = run_python(IMPORT_EVERY_MODULE)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert {"pykvalloc.stats", "pykvalloc.replay.simulator", "pykvalloc.pool"} <= set(found["modules"])
    above = [name for name in found["loaded"] if name.split(".")[0] in ABOVE_THE_LIBRARY]
    assert above == []


def test_python_dash_m_pykvalloc_says_where_the_command_is():
    done = run_python("import runpy; runpy.run_module('pykvalloc', run_name='__main__')")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "the kvalloc command is the kvalloc_cli package: run `kvalloc` or `python -m kvalloc_cli` "
        "(pip install 'pykvalloc[cli,tui]')"]
