"""What a serving engine allocates around its KV cache, through the same pool: the replay's
``--engine-buffers`` (on in ``kvalloc demo``), so that the pool's buddy orders, slab classes and
fragmentation move as an engine's would, and the report says what each kind of allocation cost.

Per step, as a two-level pool serves a forward pass (a buddy for large buffers, slab classes for
small objects):
- *activations* and *attn output* (attention output): one buffer each of
  ``tokens x hidden x 2`` bytes (fp16), where ``tokens`` is what the step computes (a few
  decodes, or thousands of prompt tokens) and ``hidden`` the model's width,
  ``kv_heads x head_dim x QUERY_HEADS_PER_KV_HEAD`` (4096 for the default Llama-3-8B-like model):
  sizes from kilobytes to tens of MiB, through the buddy (the pool serves those up to its
  largest slab class, 64 KiB, from slabs: a step of a few decodes);
- *scratch*: in a step that computes a prompt (more than ``SCRATCH_FROM_TOKENS`` tokens), one
  64 KiB buffer per 2,048 tokens, rounded up, through a slab class;
and per request, from its admission to its release (finished or preempted):
- *token meta* (token metadata): one 64-byte record (its sampling parameters and positions),
  through a slab class.
A step's buffers are freed one step later (the engine overlaps the next step's preparation with
this one's), so two steps' worth are live at a time. Each call is timed around the ctypes call,
as the malloc baselines are. The calls are few per step (a per-sequence record every step cost
more than the rest of the replay), so that the replay is not much slower for them.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import OutOfMemory
from ..pool import Allocation, Pool

if TYPE_CHECKING:
    from .backends import Geometry

#: Query heads per KV head: grouped-query attention as in Llama-3-8B (32 query heads, 8 KV heads).
QUERY_HEADS_PER_KV_HEAD = 4
ACTIVATION_BYTES = 2          # fp16
SCRATCH_BYTES = 64 << 10
SCRATCH_TOKENS = 2048         # tokens of a step per scratch buffer
SCRATCH_FROM_TOKENS = 256     # a step of decodes alone (a token a sequence) needs none
METADATA_BYTES = 64
#: The pool's room for these buffers beside the KV region: two steps of the largest buffers
#: (8,192 tokens x 4,096 x 2 B = 64 MiB each, two per step) and the slabs, with room to spare.
WORKSPACE_BYTES = 512 << 20

CLASSES = ("activations", "attn output", "scratch", "token meta")


@dataclass
class ClassCost:
    """What one kind of allocation cost over a replay."""
    name: str
    allocations: int = 0
    from_slabs: int = 0             # allocations a slab class served (the rest: the buddy)
    failures: int = 0               # the workspace was full: the engine would have waited
    bytes: int = 0                  # asked for, in all
    live_bytes: int = 0
    peak_live_bytes: int = 0
    ns: list[int] = field(default_factory=list)   # each alloc and free call

    def as_dict(self) -> dict[str, Any]:
        ordered = sorted(self.ns)

        def at(q: float) -> float | None:
            return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else None
        path = ("slab" if self.from_slabs == self.allocations else
                "buddy" if not self.from_slabs else "both")
        return {"path": path, "from_slabs": self.from_slabs,
                "allocations": self.allocations, "failures": self.failures,
                "mean_bytes": self.bytes / self.allocations if self.allocations else 0.0,
                "peak_live_bytes": self.peak_live_bytes, "calls": len(ordered),
                "ns_p50": at(0.5), "ns_p99": at(0.99), "total_ms": sum(ordered) / 1e6}


class EngineBuffers:
    """The per-step buffers of an engine, allocated from ``pool`` (which also holds the KV
    cache)."""

    def __init__(self, pool: Pool, geometry: Geometry) -> None:
        self.pool = pool
        # The model's width: its config's when given, else that of grouped-query attention
        # over its first group's KV heads.
        first = geometry.shapes[0]
        self.hidden = geometry.hidden_size or first.kv_heads * first.head_dim * QUERY_HEADS_PER_KV_HEAD
        self.costs = {name: ClassCost(name) for name in CLASSES}
        # The pool serves a size up to its largest slab class from slabs, the rest from the
        # buddy: a decode step's activations (a few tokens) come from slabs too.
        self.largest_slab = max((c.object_size for c in pool.class_stats()), default=0)
        # The previous step's buffers, freed after the next step's are allocated.
        self._held: deque[list[tuple[ClassCost, Allocation]]] = deque()
        self._requests: dict[int, list[tuple[ClassCost, Allocation]]] = {}

    def step(self, tokens: int) -> None:
        """Allocates one step's buffers, for ``tokens`` computed, and frees those of the step
        before the previous one."""
        now: list[tuple[ClassCost, Allocation]] = []
        if tokens:
            size = tokens * self.hidden * ACTIVATION_BYTES
            self._alloc(self.costs["activations"], size, now)
            self._alloc(self.costs["attn output"], size, now)
            for _ in range(-(-tokens // SCRATCH_TOKENS) if tokens > SCRATCH_FROM_TOKENS else 0):
                self._alloc(self.costs["scratch"], SCRATCH_BYTES, now)
        self._held.append(now)
        while len(self._held) > 2:
            self._free(self._held.popleft())

    def admitted(self, request: int) -> None:
        """A request (any key unique while it runs) was admitted: its metadata record."""
        held: list[tuple[ClassCost, Allocation]] = []
        self._alloc(self.costs["token meta"], METADATA_BYTES, held)
        self._requests[request] = held

    def released(self, request: int) -> None:
        self._free(self._requests.pop(request, []))

    def close(self) -> None:
        """Frees every buffer still held."""
        while self._held:
            self._free(self._held.popleft())
        for request in list(self._requests):
            self.released(request)

    def report(self) -> dict[str, dict[str, Any]]:
        return {name: cost.as_dict() for name, cost in self.costs.items()}

    def _alloc(self, cost: ClassCost, size: int, into: list[tuple[ClassCost, Allocation]]) -> None:
        start = time.perf_counter_ns()
        try:
            allocation = self.pool.alloc(size)
        except OutOfMemory:
            cost.ns.append(time.perf_counter_ns() - start)
            cost.failures += 1
            return
        cost.ns.append(time.perf_counter_ns() - start)
        cost.allocations += 1
        cost.from_slabs += size <= self.largest_slab
        cost.bytes += size
        cost.live_bytes += size
        cost.peak_live_bytes = max(cost.peak_live_bytes, cost.live_bytes)
        into.append((cost, allocation))

    def _free(self, held: list[tuple[ClassCost, Allocation]]) -> None:
        for cost, allocation in held:
            start = time.perf_counter_ns()
            self.pool.free(allocation)
            cost.ns.append(time.perf_counter_ns() - start)
            cost.live_bytes -= allocation.size
