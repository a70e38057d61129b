#!/usr/bin/env python3
"""vLLM's KV-cache manager against pykvalloc's on the Mooncake conversation trace: the program
behind `kvalloc bench engines` (kvalloc_cli/bench_engines.py says what it measures), runnable
from a source checkout with a Python that has vLLM: .venv-vllm/bin/python tools/bench_engines.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from kvalloc_cli.bench_engines import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
