"""100,000 random operations against a Python model of the pool.

The model knows which allocations are live and what was written into each. Every operation's
outcome is checked against it as it happens; every 1,000 operations ``check()`` runs and the
statistics and the heap walk are compared with the model in full.

The seed is random and printed (pytest shows it on failure); ``KVALLOC_TEST_SEED=<n>`` replays
a run.
"""

from __future__ import annotations

import ctypes
import os
import random

import pytest
from support import MiB

import pykvalloc
from pykvalloc import WalkKind

OPERATIONS = 100_000
CHECK_EVERY = 1_000
PHASE = 5_000  # operations between switches of pressure: filling, then draining


def _random_size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.70:
        return rng.randint(1, 512)          # token metadata and small records
    if roll < 0.90:
        return rng.randint(513, 65536)      # KV pages: the rest of the slab range
    return rng.randint(65537, 2 * MiB)      # buddy blocks


class Model:
    """What the pool should hold: every live allocation with its usable size and tag byte."""

    def __init__(self, pool: pykvalloc.Pool) -> None:
        self.pool = pool
        self.live: dict[int, tuple[pykvalloc.Allocation, int, int]] = {}
        # The live addresses again, as a list, so that a random one is picked in O(1).
        self.addresses: list[int] = []
        self.position: dict[int, int] = {}
        self.allocs = self.frees = self.failures = 0

    def add(self, allocation: pykvalloc.Allocation, tag: int, alignment: int = 1) -> None:
        usable = self.pool.usable_size(allocation)
        assert usable >= allocation.size
        assert allocation.address % alignment == 0
        # kvalloc.h: a slab object is aligned to the largest power of two dividing its size
        # class, a buddy block to its own power-of-two size: the lowest set bit either way.
        assert allocation.offset % (usable & -usable) == 0, (allocation, usable)
        assert allocation.address not in self.live, "address handed out twice"
        assert 0 <= allocation.offset and allocation.offset + usable <= self.pool.capacity
        # Tag the first and last byte: an allocation overlapping this one would overwrite a
        # tag before this one is freed.
        ctypes.memset(allocation.address, tag, 1)
        ctypes.memset(allocation.address + allocation.size - 1, tag, 1)
        self.live[allocation.address] = (allocation, usable, tag)
        self.position[allocation.address] = len(self.addresses)
        self.addresses.append(allocation.address)
        self.allocs += 1

    def pick(self, rng: random.Random) -> int:
        return self.addresses[rng.randrange(len(self.addresses))]

    def remove(self, address: int) -> pykvalloc.Allocation:
        allocation, _, tag = self.live.pop(address)
        index = self.position.pop(address)
        last = self.addresses.pop()
        if last != address:
            self.addresses[index] = last
            self.position[last] = index
        expected = bytes([tag])
        assert ctypes.string_at(allocation.address, 1) == expected
        assert ctypes.string_at(allocation.address + allocation.size - 1, 1) == expected
        self.frees += 1
        return allocation

    def verify(self) -> None:
        self.pool.check()
        stats = self.pool.stats()
        assert stats.live_allocations == len(self.live)
        assert stats.bytes_in_use == sum(usable for _, usable, _ in self.live.values())
        assert (stats.alloc_count, stats.free_count) == (self.allocs, self.frees)
        assert stats.alloc_failures == self.failures
        regions = list(self.pool.walk())
        end = 0
        for region in regions:
            assert region.offset >= end and region.size > 0, "walk out of order or overlapping"
            end = region.end
        assert end <= self.pool.capacity
        live = {(r.offset, r.size) for r in regions if r.kind.is_live}
        assert live == {(allocation.offset, usable)
                        for allocation, usable, _ in self.live.values()}
        assert sum(r.size for r in regions if r.kind is WalkKind.FREE) == stats.bytes_free


CONFIGS = {
    "64MiB": dict(capacity=64 * MiB, slab_chunk=256 << 10),
    # Not a power of two: the buddy covers it with blocks of several orders and a tail.
    "odd-48MiB": dict(capacity=48 * MiB + 13 * 1024, min_block=1024, slab_chunk=64 << 10),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_random_operations_against_a_model(config):
    seed = int(os.environ.get("KVALLOC_TEST_SEED", random.randrange(1 << 32)))
    print(f"seed {seed} (KVALLOC_TEST_SEED={seed} replays this run)")
    rng = random.Random(seed)
    with pykvalloc.Pool(**config, name="model") as pool:
        model = Model(pool)
        for step in range(OPERATIONS):
            filling = (step // PHASE) % 2 == 0
            roll = rng.random()
            tag = step % 255 + 1
            if roll < (0.62 if filling else 0.38) or not model.live:
                size = _random_size(rng)
                alignment, how = 1, rng.random()
                try:
                    if how < 0.1:
                        alignment = 1 << rng.randint(0, 16)
                        allocation = pool.alloc_aligned(size, alignment)
                    elif how < 0.15 and size > 65536:
                        allocation = pool.alloc_exact(size)
                    else:
                        allocation = pool.alloc(size)
                except pykvalloc.OutOfMemory:
                    model.failures += 1
                else:
                    model.add(allocation, tag, alignment)
            elif roll < 0.997:
                pool.free(model.remove(model.pick(rng)))
            elif roll < 0.999:
                pool.trim()
            else:
                freed = model.remove(model.pick(rng))
                pool.free(freed)
                with pytest.raises(pykvalloc.DoubleFree):
                    pool.free(freed)
            if (step + 1) % CHECK_EVERY == 0:
                model.verify()
        while model.addresses:
            pool.free(model.remove(model.addresses[-1]))
        model.verify()
        pool.trim()
        stats = pool.stats()
        assert stats.bytes_free == stats.capacity == pool.capacity
        assert stats.fragmentation == 0.0 or stats.largest_free < stats.bytes_free
    assert model.failures > 0, "the pool never filled up: the out-of-memory path went untested"
    print(f"{OPERATIONS:,} operations: {model.allocs:,} allocations, {model.failures:,} out of memory")
