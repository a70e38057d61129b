"""Adapters of pykvalloc onto inference engines' own extension points, each an optional extra.

Importing this package (or ``import pykvalloc``) imports no engine and no torch: each adapter
imports its engine when its classes are first used.

* ``pykvalloc.integrations.vllm``: vLLM's KV offloading tier (``pip install pykvalloc[vllm]``).
"""

from __future__ import annotations

__all__: list[str] = []
