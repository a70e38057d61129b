"""The opt-in tests against vLLM (make test-vllm): every module here needs vLLM and torch, in
.venv-vllm; make test's pytest never collects this directory (testpaths is tests/python)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run make test-vllm, which uses "
                    ".venv-vllm")
