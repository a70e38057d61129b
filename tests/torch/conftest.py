"""The package under test is this tree's: the torch venv may hold an editable install of another
checkout, whose import hook (scikit-build-core's redirecting finder) would come before
PYTHONPATH; it is taken off the import path here, before any test imports pykvalloc."""

from __future__ import annotations

import sys
from pathlib import Path

TREE = Path(__file__).resolve().parents[2]
sys.meta_path[:] = [finder for finder in sys.meta_path
                    if "pykvalloc" not in type(finder).__module__]
if str(TREE) not in sys.path[:1]:
    sys.path.insert(0, str(TREE))
