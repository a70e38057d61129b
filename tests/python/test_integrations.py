"""pykvalloc.integrations: optional adapters that import their engine only when used. The
adapters themselves are tested against the engines in tests/vllm (make test-vllm)."""

from __future__ import annotations

import importlib.util

import pytest
from support import run_python


def test_the_vllm_adapter_imports_vllm_only_when_its_classes_are_used() -> None:
    done = run_python(
        "import sys\n"
        "import pykvalloc.integrations, pykvalloc.integrations.vllm as adapter\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
        "print(adapter.__all__)\n"
        "try:\n"
        "    adapter.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    print('AttributeError', exc)\n")
    assert done.returncode == 0, done.stderr
    loaded, names, missing = done.stdout.splitlines()
    assert loaded == "[]"
    assert names == "['KvallocOffloadingSpec', 'KvallocOffloadingManager']"
    assert missing.startswith("AttributeError") and "NoSuchThing" in missing


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here: tests/vllm use the adapter")
def test_without_vllm_the_adapter_says_what_to_install() -> None:
    done = run_python(
        "import pykvalloc.integrations.vllm as adapter\n"
        "try:\n"
        "    adapter.KvallocOffloadingSpec\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    assert done.returncode == 0, done.stderr
    assert "pip install 'pykvalloc[vllm]'" in done.stdout
