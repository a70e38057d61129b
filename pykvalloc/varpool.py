"""Variable-size pools: the Python face of ``kva_var``.

A ``VarPool`` hands out ranges of any size, rounded up to its alignment (256 B by default),
under one policy chosen at creation: ``"tlsf"`` (two-level segregated fit, O(1)), ``"first"``,
``"best"`` or ``"worst"`` fit. Freed ranges merge with their free neighbours at once. As
everywhere in libkvalloc, the bookkeeping lives beside the memory, never in it.

The memory is one range of a ``Pool``: an open one the caller gives (``pool=``), which the
VarPool then uses without owning it, or one the VarPool creates for itself and owns, which any
keyword a ``Pool`` takes (``pages``, ``backend="cuda"``, ``device``, ``numa_node``, ...) shapes.
The library sizes that pool (``kva_var_backing_config``): the power of two that holds the range,
on transparent huge pages where this process gets them, else base pages, unless ``pages`` names
the pages to use.

``alloc`` returns an ``Allocation``, the handle a ``Pool`` hands out, under the same rules
(pool.py): ``address`` (a device address in a CUDA pool; ``int(allocation)`` too), ``size``,
``view()`` for numpy, and ``free``/``usable_size`` take the handle, never a bare address. A
second free of a handle raises ``DoubleFree`` before its address reaches C, where it may name a
newer allocation's range by now; a handle of another pool raises ``InvalidPointer``; a free
while numpy views of the range live raises ``AllocationInUseError``.

Lifetime (``HandleOwner``, _owner.py): ``close()`` is idempotent and gives the range back to
the pool, then closes the pool if the VarPool made it; a forgotten VarPool is released when it
becomes garbage. A live numpy view keeps its VarPool (and so its pool) alive and the memory
mapped, after ``close()`` too. Calls are serialized by a lock, so a VarPool may be shared
between threads.
"""

from __future__ import annotations

from ctypes import byref, c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _ffi
from .errors import InvalidArgument
from .pool import (
    Allocation,
    Backend,
    PageMode,
    Pool,
    PoolOptions,
    _Allocator,
    _enum_arg,
    _returned_address,
    _size_arg,
    _snapshot,
)
from .sizes import format_size

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VarPool", "VarStats", "POLICIES"]

# Policy names as Python spells them, to kva_var_policy.
POLICIES = {"tlsf": 0, "first": 1, "best": 2, "worst": 3}
_POLICY_NAMES = {value: name for name, value in POLICIES.items()}


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
    peak_used: int  # the most ``used`` at once since creation or reset_peaks()

    @classmethod
    def _from_c(cls, raw: _ffi.KvaVarStats) -> VarStats:
        return _snapshot(cls, raw, policy=_POLICY_NAMES[raw.policy], used=raw.bytes_used,
                         peak_used=raw.peak_bytes_used,
                         requested=raw.bytes_requested, free=raw.bytes_free,
                         allocs=raw.alloc_count, frees=raw.free_count,
                         failures=raw.alloc_failures)


def _own_pool(lib: _ffi.KvaLib, config: _ffi.KvaVarConfig, options: PoolOptions) -> Pool:
    """The pool a VarPool of ``config`` makes for itself, as the library sizes it."""
    backing = _ffi.KvaConfig()
    lib.kva_config_init(byref(backing))
    # The two options that change the pool's size and pages; the Pool checks them all.
    backing.checked = 1 if options.get("checked") else 0
    backing.backend = _enum_arg("backend", options.get("backend", "host"), Backend)
    lib.kva_var_backing_config(byref(config), byref(backing))
    if "pages" not in options and "hugepages" not in options:
        options["pages"] = PageMode(backing.pages)
    options.setdefault("min_block", backing.min_block)
    return Pool(backing.capacity, **options)


class VarPool(_Allocator):
    """A variable-size pool of ``capacity`` bytes; see the module docstring."""

    __slots__ = ("_lib", "_base", "_policy", "_capacity", "_alignment")

    _reentrant = False  # no VarPool method calls another under its lock
    _pool: Pool  # the pool its range is in, given or its own

    def __init__(self, capacity: int, policy: str = "tlsf", *, alignment: int = 256,
                 pool: Pool | None = None, **pool_options: Unpack[PoolOptions]) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if pool is not None and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be a pykvalloc.Pool, not {type(pool).__name__}")
        if pool is not None and pool_options:
            raise InvalidArgument(f"{', '.join(pool_options)}: options of the pool a VarPool "
                                  "makes for itself; a given pool has its own")
        lib = _ffi.load()
        config = _ffi.KvaVarConfig()
        lib.kva_var_config_init(byref(config))
        config.capacity = _size_arg("capacity", capacity)
        config.alignment = _size_arg("alignment", alignment)
        config.policy = POLICIES[policy]
        owns_pool = pool is None
        backing = _own_pool(lib, config, pool_options) if pool is None else pool

        def create(pool_handle: int | None) -> int:
            handle = c_void_p()
            lib.kva_var_create(byref(config), pool_handle, byref(handle))
            return _returned_address(handle, "kva_var_create")

        try:
            handle = self._create_over(backing, create)
        except BaseException:
            if owns_pool:
                backing.close()
            raise
        self._own(handle, lib.kva_var_destroy, backing, owns_pool)
        self._lib = lib
        self._c_free = lib.kva_var_free
        self._c_usable_size = lib.kva_var_usable_size
        base = c_void_p()
        lib.kva_var_base(handle, byref(base))
        self._base = _returned_address(base, "kva_var_base")
        self._policy = policy
        stats = self.stats()
        self._capacity = stats.capacity
        self._alignment = stats.alignment

    def _describe(self) -> str:
        return f"{self._policy} {format_size(self._capacity)} at {self._base:#x}"

    @property
    def _mapping(self) -> Pool:
        return self._pool

    @property
    def pool(self) -> Pool:
        """The pool whose memory the VarPool hands out."""
        return self._mapping

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
        return VarStats._from_c(raw)

    def reset_peaks(self) -> None:
        """Starts ``stats().peak_used`` afresh from ``used`` as it stands."""
        with self._lock:
            self._lib.kva_var_reset_peaks(self._open_handle())

    def check(self) -> None:
        """Walks every invariant of the metadata; ``CorruptionError`` naming the first broken."""
        with self._lock:
            self._lib.kva_var_check(self._open_handle())
