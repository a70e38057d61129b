"""Variable-size pools: the Python face of ``kva_var``.

A ``VarPool`` hands out ranges of any size, rounded up to its alignment (256 B by default),
under one policy chosen at creation: ``"tlsf"`` (two-level segregated fit, O(1)), ``"first"``,
``"best"`` or ``"worst"`` fit. Freed ranges merge with their free neighbours at once. As
everywhere in libkvalloc, the bookkeeping lives beside the memory, never in it.

The memory comes from a ``Pool`` the VarPool creates for itself and owns: any keyword a
``Pool`` takes (``pages``, ``backend="cuda"``, ``device``, ``numa_node``, ...) picks its
backing.

``alloc`` returns an ``Allocation``, the handle a ``Pool`` hands out, under the same rules
(pool.py): ``address`` (a device address in a CUDA pool; ``int(allocation)`` too), ``size``,
``view()`` for numpy, and ``free``/``usable_size`` take the handle, never a bare address. A
second free of a handle raises ``DoubleFree`` before its address reaches C, where it may name a
newer allocation's range by now; a handle of another pool raises ``InvalidPointer``; a free
while numpy views of the range live raises ``AllocationInUseError``.

Lifetime: ``close()`` is idempotent and releases the range, then the backing pool; a
forgotten VarPool is released when it becomes garbage. A live numpy view keeps its VarPool
alive and the memory mapped, after ``close()`` too. Calls are serialized by a lock, so a
VarPool may be shared between threads.
"""

from __future__ import annotations

import threading
import weakref
from ctypes import byref, c_void_p
from dataclasses import dataclass
from typing import Any

from . import _ffi, _locks
from .errors import BackendError, InvalidArgument, PoolClosedError
from .pool import (
    _SIZE_MAX,
    Allocation,
    Pool,
    _Allocator,
    _refuse_copy,
    _returned_address,
    _size_arg,
)

__all__ = ["VarPool", "VarStats", "POLICIES"]

# Policy names as Python spells them, to kva_var_policy.
POLICIES = {"tlsf": 0, "first": 1, "best": 2, "worst": 3}
_POLICY_NAMES = {value: name for name, value in POLICIES.items()}
# Bytes of each red zone a checked pool puts around an allocation (KVA_REDZONE, checked.h; the
# library does not publish it). test_varpool's checked pool of exactly a power of two fails if it
# grows.
_REDZONE = 16


_MAX_BLOCKS = 2**32 - 1      # a pool's block indices are u32, UINT32_MAX meaning none
_MIN_BLOCK_MAX = 64 << 20    # the largest min_block a pool takes (config.h)


@dataclass(frozen=True)
class VarStats:
    """A snapshot of ``kva_var_stats``. ``used`` counts rounded sizes, ``requested`` the sizes
    asked for; ``internal_waste`` is the difference; ``fragmentation`` is
    ``1 - largest_free / free`` (0 when nothing is free)."""

    capacity: int
    alignment: int
    policy: str
    used: int
    requested: int
    internal_waste: int
    free: int
    largest_free: int
    fragmentation: float
    free_ranges: int
    live_allocations: int
    allocs: int
    frees: int
    failures: int
    rejected_calls: int
    metadata_bytes: int


def _destroy(lib: _ffi.KvaLib, handle: int, pool: Pool) -> None:
    # The range goes back to the pool before the pool goes: the finalizer holds the pool, so
    # garbage collection cannot release them in the other order.
    lib.kva_var_destroy(handle)
    pool._user_gone()
    # Also a finalizer: the pool's locks only if free at once (_locks.py).
    _locks.run_or_defer([pool._lock, pool._users_lock], pool._close_locked)


class VarPool(_Allocator):
    """A variable-size pool of ``capacity`` bytes; see the module docstring."""

    __slots__ = ("_lib", "_handle", "_lock", "_pool", "_finalizer", "_closed", "_base",
                 "_policy", "_capacity", "_alignment", "_c_free", "_c_usable_size",
                 "__weakref__")

    def __init__(self, capacity: int, policy: str = "tlsf", *, alignment: int = 256,
                 **pool_options: Any) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        lib = _ffi.load()
        config = _ffi.KvaVarConfig()
        lib.kva_var_config_init(byref(config))
        config.capacity = _size_arg("capacity", capacity)
        config.alignment = _size_arg("alignment", alignment)
        config.policy = POLICIES[policy]
        # The backing pool's largest block must hold the whole range (and a checked pool's two
        # red zones around it): the next power of two. Only the range is ever touched, so with
        # THP or small pages the rest is address space.
        need = config.capacity + (2 * _REDZONE if pool_options.get("checked") else 0)
        backing = 1 << 20
        while backing < need:
            backing <<= 1
        if backing > _SIZE_MAX:
            raise InvalidArgument(f"capacity {config.capacity} is more than a pool can hold")
        # Blocks above the default 4 KiB where a pool's 32-bit block indices need them (from
        # 16 TiB up), as the library does for the pool it makes itself.
        if "min_block" not in pool_options:
            min_block = 4096
            while backing // min_block >= _MAX_BLOCKS and min_block < _MIN_BLOCK_MAX:
                min_block *= 2
            pool_options["min_block"] = min_block
        # Transparent huge pages are this class's preference, not the caller's: a process that
        # gets none (its container or parent may deny them) takes base pages, as the library's
        # own pools do; pages the caller names are used or refused.
        if "pages" in pool_options or "hugepages" in pool_options:
            pool = Pool(backing, **pool_options)
        else:
            try:
                pool = Pool(backing, pages="thp", **pool_options)
            except BackendError as exc:
                # Only the refusal of THP itself (kva_os_advise_thp's message); any other
                # backend error is the caller's to see as it was.
                if "transparent huge pages" not in str(exc):
                    raise
                pool = Pool(backing, pages="small", **pool_options)
        handle = c_void_p()
        # The VarPool is its pool's one user: the exit hook that closes idle pools
        # (pool.py, _close_idle_pools) must leave it to the VarPool, which may be used later.
        with pool._lock:
            pool_handle = pool._add_user()
        try:
            lib.kva_var_create(byref(config), pool_handle, byref(handle))
        except BaseException:
            pool._user_gone()
            pool.close()
            raise
        self._lib = lib
        self._c_free = lib.kva_var_free
        self._c_usable_size = lib.kva_var_usable_size
        self._pool = pool
        self._handle = _returned_address(handle, "kva_var_create")
        self._finalizer = weakref.finalize(self, _destroy, lib, self._handle, pool)
        self._finalizer.atexit = False
        # True once close() ran the finalizer, the only way it runs while this object is
        # reachable; every call tests it (a plain attribute, where finalize.alive is a lookup).
        self._closed = False
        self._lock = threading.Lock()
        _locks.track(self, 0)
        base = c_void_p()
        lib.kva_var_base(self._handle, byref(base))
        self._base = _returned_address(base, "kva_var_base")
        self._policy = policy
        stats = self.stats()
        self._capacity = stats.capacity
        self._alignment = stats.alignment

    def close(self) -> None:
        """Releases the range and the backing pool; idempotent. Its allocations become
        invalid; the memory stays mapped until the last numpy view of it is garbage."""
        with self._lock:
            self._closed = True
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> VarPool:
        self._open_handle()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"<pykvalloc.VarPool {self._policy} {self._capacity} B at {self._base:#x} "
                f"{state}>")

    def __reduce_ex__(self, protocol: Any) -> Any:
        _refuse_copy(self)

    def _fork_locks(self) -> tuple[list[Any], list[Any]]:
        return [self._lock], []

    def _open_handle(self) -> int:
        if self._closed:
            raise PoolClosedError("the VarPool is closed")
        return self._handle

    @property
    def _mapping(self) -> Pool:
        return self._pool

    @property
    def base(self) -> int:
        """The address of the start of the range (offset 0)."""
        return self._base

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def policy(self) -> str:
        return self._policy

    def alloc(self, size: int) -> Allocation:
        """``size`` new bytes (rounded up to the alignment), to give back with ``free``.
        ``OutOfMemory`` when no free range holds them now, ``InvalidArgument`` for 0 or more
        than the capacity."""
        return self._allocate(self._lib.kva_var_alloc, _size_arg("size", size))

    def stats(self) -> VarStats:
        raw = _ffi.KvaVarStats()
        with self._lock:
            self._lib.kva_var_get_stats(self._open_handle(), byref(raw))
        return VarStats(
            capacity=raw.capacity, alignment=raw.alignment, policy=_POLICY_NAMES[raw.policy],
            used=raw.bytes_used, requested=raw.bytes_requested,
            internal_waste=raw.internal_waste, free=raw.bytes_free,
            largest_free=raw.largest_free, fragmentation=raw.fragmentation,
            free_ranges=raw.free_ranges, live_allocations=raw.live_allocations,
            allocs=raw.alloc_count, frees=raw.free_count, failures=raw.alloc_failures,
            rejected_calls=raw.rejected_calls, metadata_bytes=raw.metadata_bytes)

    def check(self) -> None:
        """Walks every invariant of the metadata; ``CorruptionError`` naming the first broken."""
        with self._lock:
            self._lib.kva_var_check(self._open_handle())
