"""engines_split.py — where pykvalloc's time goes in ``kvalloc bench engines``: the C call of each
prefill (``kva_kv_seq_admit``) and of each decode step (``kva_kv_seq_extend_step``), timed around
the function object inside the benchmark's own run, against the whole Python call
(docs/benchmarks.md, "Against vLLM's own KV manager").

    .venv/bin/python tools/experiments/engines_split.py [bench_engines arguments]

The benchmark runs as it does alone (pykvalloc's side only when vLLM is not importable). The
timer around the C call adds a Python call to both figures, about 0.3 us warm, so the part
outside C is a little smaller than the difference printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cli"))

import kvalloc_cli.bench_engines as bench  # noqa: E402
import pykvalloc.decode_step as decode_step  # noqa: E402

inside = {"prefill": [0, 0], "decode": [0, 0]}


def timed(function: Any, what: str) -> Any:
    def call(*args: Any) -> Any:
        start = time.perf_counter_ns()
        result = function(*args)
        inside[what][0] += time.perf_counter_ns() - start
        inside[what][1] += 1
        return result
    return call


side_init = bench.PykvallocSide.__init__


def init(self: Any, *args: Any, **kwargs: Any) -> None:
    side_init(self, *args, **kwargs)
    self.cache._admit.call = timed(self.cache._admit.call, "prefill")
    for figures in inside.values():
        figures[0] = figures[1] = 0


step_init = decode_step.DecodeStep.__init__


def init_step(self: Any, *args: Any, **kwargs: Any) -> None:
    step_init(self, *args, **kwargs)
    self._extend = timed(self._extend, "decode")


side_close = bench.PykvallocSide.close


def close(self: Any) -> None:
    t = self.timings
    prefill, decode = inside["prefill"], inside["decode"]
    print(f"  {self.cache.num_blocks:,} blocks, pykvalloc split: prefill {t.prefill_ns / max(t.prefills, 1) / 1e3:.2f} us a request, "
          f"C call {prefill[0] / max(prefill[1], 1) / 1e3:.2f} us; decode "
          f"{t.decode_ns / max(t.steps, 1) / 1e3:.2f} us a step, C call "
          f"{decode[0] / max(decode[1], 1) / 1e3:.2f} us", file=sys.stderr, flush=True)
    side_close(self)


bench.PykvallocSide.__init__ = init  # type: ignore[method-assign]
bench.PykvallocSide.close = close  # type: ignore[method-assign]
decode_step.DecodeStep.__init__ = init_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(bench.main(sys.argv[1:]))
