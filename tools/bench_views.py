#!/usr/bin/env python3
"""What making a tensor over pool memory costs an engine: a KV tensor view, a DLPack export and
the array a consumer makes of it, beside numpy's own ``frombuffer`` and ``from_dlpack`` of a
numpy array (the floor of any Python-level view).

Each row is the median over --repeats runs of --calls calls (each call's objects dropped before
the next, as an engine that makes and drops them would), in nanoseconds per call; the cost is
the same whatever the size of the memory (the rows at two cache sizes show it). Run from a
checkout with the library built (PYKVALLOC_LIB, or the editable install)::

    python tools/bench_views.py                 # about 20 s; --json for the figures as JSON
    python tools/bench_views.py --torch         # also torch.from_dlpack, where torch is installed
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# This checkout's package, even where an editable install of another checkout hooks the import.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.meta_path[:] = [finder for finder in sys.meta_path if "pykvalloc" not in type(finder).__module__]

import numpy as np  # noqa: E402

import pykvalloc  # noqa: E402


def per_call_ns(function: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` calls, in ns."""
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                function()
            samples.append((time.perf_counter_ns() - start) / calls)
    finally:
        gc.enable()
    return statistics.median(samples)


def rows(calls: int, repeats: int, with_torch: bool) -> dict[str, float]:
    results: dict[str, float] = {}
    buffer = bytearray(1 << 20)
    array = np.zeros(1 << 18, dtype=np.float32)
    results["numpy frombuffer (1 MiB bytearray)"] = per_call_ns(
        lambda: np.frombuffer(buffer, dtype=np.float16), calls, repeats)
    results["numpy from_dlpack(numpy array)"] = per_call_ns(
        lambda: np.from_dlpack(array), calls, repeats)
    torch = None
    if with_torch:
        import torch  # type: ignore[import-not-found, no-redef]
        results["torch.from_dlpack(numpy array)"] = per_call_ns(
            lambda: torch.from_dlpack(array), calls, repeats)
    with pykvalloc.Pool(64 << 20) as pool:
        allocation = pool.alloc(1 << 20)
        tensor = allocation.tensor("float16", (512, 1024))
        results["Allocation.view (numpy)"] = per_call_ns(
            lambda: allocation.view(np.float16), calls, repeats)
        results["Allocation.tensor"] = per_call_ns(
            lambda: allocation.tensor("float16", (512, 1024)), calls, repeats)
        results["Tensor.__dlpack__ (capsule only)"] = per_call_ns(
            lambda: tensor.__dlpack__(), calls, repeats)
        results["numpy from_dlpack(Tensor)"] = per_call_ns(
            lambda: np.from_dlpack(tensor), calls, repeats)
        results["numpy from_dlpack(Allocation)"] = per_call_ns(
            lambda: np.from_dlpack(allocation), calls, repeats)
        if torch is not None:
            results["torch.from_dlpack(Tensor)"] = per_call_ns(
                lambda: torch.from_dlpack(tensor), calls, repeats)
        del tensor
    for blocks in (1024, 65536):
        with pykvalloc.KVCache(num_blocks=blocks, block_tokens=16, layers=4, kv_heads=8,
                               head_dim=128, dtype="float16") as cache:
            label = f"{blocks} blocks"
            results[f"KVCache.kv_tensor(layer), {label}"] = per_call_ns(
                lambda: cache.kv_tensor(2), calls, repeats)
            results[f"numpy from_dlpack(kv_tensor(layer)), {label}"] = per_call_ns(
                lambda: np.from_dlpack(cache.kv_tensor(2)), calls, repeats)
            if torch is not None:
                results[f"torch.from_dlpack(kv_tensor(layer)), {label}"] = per_call_ns(
                    lambda: torch.from_dlpack(cache.kv_tensor(2)), calls, repeats)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per run (default 20000)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per row (default 7)")
    parser.add_argument("--torch", action="store_true", help="also torch.from_dlpack")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    results = rows(args.calls, args.repeats, args.torch)
    if args.json:
        print(json.dumps({"bench_views_ns": results}, indent=1))
    else:
        width = max(map(len, results))
        for name, ns in results.items():
            print(f"{name:<{width}}  {ns:8.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
