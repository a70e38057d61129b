"""Pools and allocations: the Python face of ``kva_pool``.

Lifetime rules. Each one exists because the alternative can crash the interpreter or hand the
same bytes to two owners. A ``Pool`` owns one C pool under the rules every owner of a C handle
follows (``HandleOwner``, _owner.py: ``close()`` idempotent, then ``PoolClosedError`` from every
method; users that outlive ``close()``; a finalizer for a forgotten pool; no copies); here is
what they mean for a pool:

* The memory stays mapped while any numpy view of it exists. Every view's base object holds a
  strong reference to its pool and counts as a user of it, so ``close()`` with live views
  closes the pool to all calls at once but defers the unmap until the last view is garbage. A
  view can never point at unmapped memory.
* A ``KVCache`` or ``VarPool`` built on a pool is a user of it in the same way: ``close()`` on
  the pool then closes it to its own calls, and the C pool is destroyed after the cache or
  VarPool (whose memory is in it) is closed or garbage. Their calls never reach a destroyed
  pool.
* ``free()`` refuses (``AllocationInUseError``) while numpy views of that allocation are alive,
  or ``Tensor``s over it and their DLPack exports (tensor.py), which count as views:
  the next allocation would get the same bytes while the old view could still write them.
  ``mmap.close()`` refuses exported buffers for the same reason.
* At interpreter exit, pools without users are closed; a pool with live views is left to the
  operating system, because module teardown cannot promise that nothing touches a view after
  the unmap.
* Each ``Pool`` serializes its calls with its lock, since the bookkeeping above (open or
  closed, live views, allocations freed) is Python state: sharing a pool between threads is
  safe, not parallel. The C pool itself takes calls from any number of threads at once (C
  callers get that; kvalloc.h, "Thread safety"). Finalizers never wait on these locks, and
  ``os.fork()`` while another thread holds one leaves the child a usable pool (``_locks.py``).
* An ``Allocation`` cannot be copied or pickled either: a copy would share the address without
  sharing its bookkeeping. Only a pool creates an ``Allocation``: one made up by hand could
  view any address.
* Freeing a freed allocation, or one of another pool, is caught here and never reaches C (its
  address may belong to a newer allocation by now), so ``Stats.rejected_calls`` counts only
  what C itself rejected.

A ``VarPool`` (varpool.py) hands out the same ``Allocation`` handles and takes them back through
the same code (``_Allocator``), so the rules on allocations and views above hold for it too.
"""

from __future__ import annotations

import atexit
import enum
import math
import operator
import re
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from ctypes import Structure, byref, c_char, c_int, c_size_t, c_void_p, sizeof
from ctypes import addressof as ctypes_address
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, SupportsIndex, TypedDict, TypeVar

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt  # annotations only: numpy.typing is missing from old numpy
    from _typeshed import DataclassInstance

from . import _dlpack, _ffi
from ._owner import ArrayAnchor, HandleOwner, refuse_copy
from .errors import (
    AllocationFreedError,
    AllocationInUseError,
    CorruptionError,
    DoubleFree,
    InvalidArgument,
    InvalidPointer,
    KvallocError,
)
from .sizes import format_size
from .tensor import (
    DEVICE_CPU,
    DEVICE_CUDA,
    DEVICE_CUDA_HOST,
    Tensor,
    contiguous_strides,
    extent,
    shape_arg,
    tensor_dtype,
)

__all__ = [
    "Pool",
    "Allocation",
    "Stats",
    "ClassStats",
    "HeapRegion",
    "PageMode",
    "PageKind",
    "Backend",
    "NumaPolicy",
    "WalkKind",
    "PoolOptions",
]

_SIZE_MAX = (1 << (8 * sizeof(c_size_t))) - 1
_ALLOCATION_KEY = object()  # proves to Allocation.__init__ that a Pool or VarPool is calling


class PageMode(enum.IntEnum):
    """How the host region is backed (``kva_page_mode``)."""

    AUTO = 0     # 2 MiB hugetlb, else transparent huge pages, else 4 KiB pages
    HUGETLB = 1  # hugetlb only; BackendError when the machine has none reserved
    THP = 2      # normal mapping advised MADV_HUGEPAGE
    SMALL = 3    # normal pages, no advice


class PageKind(enum.IntEnum):
    """What actually backs a pool (``kva_page_kind``)."""

    HUGETLB = 1
    THP = 2
    SMALL = 3
    DEVICE = 4  # GPU memory of a CUDA pool; page_size is the mapping granularity
    EXTERNAL = 5  # memory the caller owns (Pool.over, external=); page_size is the base page

    @property
    def label(self) -> str:
        return {PageKind.HUGETLB: "hugetlb", PageKind.THP: "transparent huge pages",
                PageKind.SMALL: "small pages", PageKind.DEVICE: "GPU memory",
                PageKind.EXTERNAL: "memory the caller owns"}[self]


class Backend(enum.IntEnum):
    """Where a pool's memory lives (``kva_backend``)."""

    HOST = 0  # host memory, mapped at creation
    CUDA = 1  # one GPU's memory, mapped on demand through the CUDA driver; the CPU cannot touch it


class NumaPolicy(enum.IntEnum):
    """How a host pool is bound to its NUMA node (``kva_numa_policy``)."""

    BIND = 0       # pages only from that node
    PREFERRED = 1  # pages from that node while it has free memory


class WalkKind(enum.IntEnum):
    """The kind of one region of a heap walk (``kva_walk_kind``)."""

    FREE = 0         # a free buddy block
    BLOCK = 1        # a live buddy allocation
    SLAB_OBJECT = 2  # a live slab object
    SLAB_FREE = 3    # a run of free objects inside a slab

    @property
    def is_live(self) -> bool:
        return self in (WalkKind.BLOCK, WalkKind.SLAB_OBJECT)


class HeapRegion(NamedTuple):
    """One region of ``Pool.walk()``: bytes ``[offset, offset + size)`` from the pool base."""

    offset: int
    size: int
    kind: WalkKind

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Stats:
    """A snapshot of ``kva_stats``; see kvalloc.h for the exact meaning of each figure."""

    capacity: int
    min_block: int
    slab_chunk: int
    max_alloc_size: int
    bytes_in_use: int
    bytes_free: int
    slab_bytes: int
    slab_free_bytes: int
    largest_free: int
    fragmentation: float
    free_blocks: tuple[int, ...]  # free buddy blocks per order; block size = min_block << order
    live_allocations: int
    alloc_count: int
    free_count: int
    alloc_failures: int
    rejected_calls: int
    slab_count: int
    page_kind: PageKind
    page_size: int
    metadata_bytes: int
    # The backing memory. Defaults, so that a Stats rebuilt from a source that predates them
    # (a statistics segment) still constructs.
    numa_node: int | None = None     # the node the region is bound to; None if none
    backend: Backend = Backend.HOST
    mapped_bytes: int = 0            # CUDA: device memory mapped now; host: the whole region
    pinned: bool = False             # registered with the CUDA driver (Pool(pin=True))
    locked: bool = False             # mlocked (Pool(lock=True))
    # Threads: arenas, the threads holding a cache of the pool, the free bytes those caches hold
    # (part of slab_free_bytes), and the frees passed to another thread's cache.
    arenas: int = 1
    thread_caches: int = 0
    cached_bytes: int = 0
    remote_frees: int = 0
    # Peaks since creation or reset_peaks(): peak_block_bytes exact (the most bytes in buddy
    # blocks at once, slab chunks included); peak_bytes_in_use the highest bytes_in_use a stats
    # query or a publish computed, a lower bound (slab objects are counted per thread, with no
    # shared counter to compare on the fast path). See kvalloc.h.
    peak_block_bytes: int = 0
    peak_bytes_in_use: int = 0

    @property
    def num_orders(self) -> int:
        return len(self.free_blocks)

    def block_size(self, order: int) -> int:
        """Bytes of one buddy block of ``order``."""
        return self.min_block << order

    @classmethod
    def _from_c(cls, raw: _ffi.KvaStats) -> Stats:
        orders = min(raw.num_orders, _ffi.KVA_MAX_ORDERS)
        return _snapshot(cls, raw, free_blocks=tuple(raw.free_blocks[:orders]),
                         page_kind=PageKind(raw.page_kind),
                         numa_node=None if raw.numa_node < 0 else raw.numa_node,
                         backend=Backend(raw.backend), pinned=bool(raw.pinned),
                         locked=bool(raw.locked))


_Snapshot = TypeVar("_Snapshot", bound="DataclassInstance")


def _snapshot(cls: type[_Snapshot], raw: Structure, **converted: object) -> _Snapshot:
    """A frozen dataclass of figures from its C struct: each field copied from the struct
    member of the same name, except those given in ``converted``."""
    copied = {field.name: getattr(raw, field.name) for field in fields(cls)
              if field.name not in converted}
    return cls(**copied, **converted)


@dataclass(frozen=True)
class ClassStats:
    """Figures of one slab size class (``kva_class_stats``)."""

    index: int
    object_size: int
    objects_per_slab: int
    live_objects: int
    slabs: int


def _size_arg(what: str, value: int) -> int:
    if isinstance(value, bool):  # an index to Python, but never meant as a size
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if not 0 <= number <= _SIZE_MAX:
        # ctypes would silently wrap a negative number into a huge size_t.
        raise InvalidArgument(f"{what} {number} is outside [0, {_SIZE_MAX}]")
    return number


_Enum = TypeVar("_Enum", bound=enum.IntEnum)


def _enum_arg(what: str, value: object, kind: type[_Enum]) -> _Enum:
    """A member of ``kind`` from itself, its name in any case, or its value (not a bool, whose
    meaning as a member would be a guess)."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        member = kind.__members__.get(value.upper())
        if member is not None:
            return member
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return kind(value)
        except ValueError:
            pass
    choices = ", ".join(repr(member.name.lower()) for member in kind)
    # The class name in words: PageMode is "page mode", KVLayout "KV layout".
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*", kind.__name__)
    label = " ".join(word if len(word) > 1 and word.isupper() else word.lower() for word in words)
    raise InvalidArgument(f"{what} must be one of {choices}; {value!r} is not a {label}")


def _pages_arg(pages: str | PageMode | None,
               hugepages: bool | str | PageMode | None = None) -> PageMode:
    """The page mode from ``pages`` or its alias ``hugepages`` (True: huge pages when the
    machine has them, else normal ones; False: normal pages only); None for both: ``"auto"``.
    Every class that takes a page mode reads it here."""
    if hugepages is None:
        return _enum_arg("pages", "auto" if pages is None else pages, PageMode)
    if pages is not None:
        raise InvalidArgument("give pages or hugepages, not both")
    if isinstance(hugepages, bool):
        return PageMode.AUTO if hugepages else PageMode.SMALL
    return _enum_arg("hugepages", hugepages, PageMode)


def _int_arg(what: str, value: int, low: int) -> int:
    """A C int of at least ``low``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if not low <= number <= 0x7FFFFFFF:
        raise InvalidArgument(f"{what} {number} is outside [{low}, {0x7FFFFFFF}]")
    return number


def _name_arg(name: str | None) -> bytes | None:
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"name must be a str or None, not {type(name).__name__}")
    if "\0" in name:
        # C would see only the part before the NUL; the library checks everything else.
        raise InvalidArgument(f"pool name {name!r} contains a NUL character")
    return name.encode("utf-8")


def _shape_arg(shape: int | Sequence[int]) -> tuple[int, ...]:
    try:
        dims = (operator.index(shape),) if not isinstance(shape, Iterable) else tuple(shape)
        dims = tuple(operator.index(dim) for dim in dims)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(dim < 0 for dim in dims):
        raise InvalidArgument(f"shape {dims} has a negative dimension")
    return dims


def _strides_arg(strides: Sequence[int]) -> Iterator[int]:
    try:
        for stride in strides:
            step = operator.index(stride)
            if step < 0:
                raise InvalidArgument(f"strides {tuple(strides)} has a negative stride")
            yield step
    except TypeError:
        raise TypeError(f"strides must be a sequence of ints, not {strides!r}") from None


def _external_memory(memory: object) -> tuple[int, int, Backend, object]:
    """The address, length and backend of memory handed to ``Pool.over``, and the object that
    keeps it alive."""
    cuda = getattr(memory, "__cuda_array_interface__", None)
    interface = cuda if cuda is not None else getattr(memory, "__array_interface__", None)
    if isinstance(interface, dict):
        try:
            address, readonly = interface["data"]
            strides = interface.get("strides")
            shape = tuple(interface["shape"])
            itemsize = np.dtype(interface["typestr"]).itemsize
        except (KeyError, TypeError, ValueError) as error:
            # Another library's interface, malformed: its fault, said as the caller's error.
            raise InvalidArgument(f"{type(memory).__name__}'s array interface lacks a valid data "
                                  f"pointer, shape or typestr: {error!r}") from None
        if readonly:
            raise InvalidArgument(f"{type(memory).__name__} memory is read-only; a pool hands "
                                  "out blocks to write")
        if strides is not None and strides != _contiguous_strides(shape, itemsize):
            raise InvalidArgument(f"{type(memory).__name__} memory is not contiguous")
        backend = Backend.CUDA if cuda is not None else Backend.HOST
        return int(address or 0), math.prod(shape) * itemsize, backend, memory
    try:
        view = memoryview(memory)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{type(memory).__name__} is not memory a pool can manage: give "
                              "a numpy or CUDA array, a writable buffer, or external= an "
                              "address") from None
    with view:
        # C order: ctypes takes an export of the buffer as one run of bytes in that order only.
        if view.readonly or not view.c_contiguous:
            raise InvalidArgument(f"{type(memory).__name__} memory is read-only or not "
                                  "contiguous")
        length = view.nbytes
    # A ctypes array over the buffer holds an export of it for as long as the pool keeps it.
    keeper = (c_char * length).from_buffer(memory)  # type: ignore[arg-type]
    return ctypes_address(keeper), length, Backend.HOST, keeper


def _contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _returned_address(out: c_void_p, function: str) -> int:
    # ctypes reads a NULL void * as None. The library sets the out-parameter on success;
    # should it ever not, raise rather than build an object around address None.
    if out.value is None:
        raise KvallocError(f"{function} succeeded but returned a NULL address")
    return out.value


class Allocation:
    """A block handed out by ``Pool.alloc`` (and its variants) or by ``VarPool.alloc``.

    ``address`` and ``size`` (the bytes requested) stay readable after the free, for logs and
    debugging, and ``int(allocation)`` is the address; every use of the memory (``view``,
    ``usable_size``, ``free`` of the pool that made it) raises once it is freed.
    """

    __slots__ = ("_pool", "_address", "_size", "_live", "_views")

    # _key is positional: a keyword argument through a class call costs CPython about 100 ns,
    # a third of what a handle adds to an alloc.
    def __init__(self, pool: _Allocator, address: int, size: int,
                 _key: object = None) -> None:
        if _key is not _ALLOCATION_KEY:
            # An Allocation made up by hand could view any address, and reading it could
            # crash the interpreter; only a Pool or a VarPool creates them.
            raise TypeError("Allocation objects come from Pool.alloc or VarPool.alloc, not "
                            "from a constructor")
        self._pool = pool
        self._address = address
        self._size = size
        self._live = True
        self._views = 0  # numpy views and tensors alive; maintained under its pool's _users_lock

    @property
    def address(self) -> int:
        return self._address

    def __int__(self) -> int:
        return self._address

    @property
    def size(self) -> int:
        return self._size

    @property
    def pool(self) -> _Allocator:
        """The Pool or VarPool that made it, the only one that takes it back."""
        return self._pool

    @property
    def offset(self) -> int:
        """Bytes from the pool base (a Pool's: the coordinates of ``Pool.walk()``)."""
        return self._address - self._pool.base

    @property
    def freed(self) -> bool:
        return not self._live

    def view(self, dtype: npt.DTypeLike = np.uint8,
             shape: int | Sequence[int] | None = None) -> npt.NDArray[Any]:
        """A writable numpy array over this allocation's memory.

        Without ``shape`` the array is one-dimensional and as long as ``size`` allows. The array
        keeps the pool alive and mapped; while it (or anything derived from it) is alive, the
        allocation cannot be freed. dtypes holding Python objects are refused: raw memory would
        be read as object pointers.
        """
        return self._pool._view(self, dtype, shape)

    def tensor(self, dtype: object = "uint8", shape: int | Sequence[int] | None = None,
               strides: Sequence[int] | None = None) -> Tensor:
        """A ``pykvalloc.Tensor`` over this allocation's memory, for DLPack
        (``torch.from_dlpack(allocation.tensor("bfloat16", (n, 128)))``), the CUDA array
        interface (CUDA pools) and numpy (host pools). ``dtype`` is a name (``"float16"``,
        ``"bf16"``, ``"fp8"``), a numpy or a torch dtype; without ``shape`` the tensor is
        one-dimensional and as long as ``size`` allows; ``strides`` (in elements, default
        row-major) must keep every element inside the allocation. While the tensor, or
        anything exported from it, is alive the allocation cannot be freed, as with a view."""
        return self._pool._tensor(self, dtype, shape, strides)

    def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
        """The allocation's bytes as a DLPack capsule: ``numpy.from_dlpack(allocation)`` is a
        uint8 array over them. ``allocation.tensor(dtype, shape)`` exports other types and
        shapes. See pykvalloc.tensor for the stream, device and copy arguments."""
        return self.tensor().__dlpack__(stream=stream, max_version=max_version,
                                        dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0) CPU for host pools, (3, 0) CUDA host for pinned ones, (2, device) for CUDA
        pools."""
        return self._pool._mapping._dl_device

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        """The allocation's bytes (uint8), version 3, on a CUDA pool; AttributeError on host
        pools, whose memory numpy reads through ``view()``."""
        if self._pool._mapping._backend is not Backend.CUDA:
            raise AttributeError("__cuda_array_interface__ describes GPU memory; this "
                                 "allocation is host memory (use view() or DLPack)")
        return self.tensor().__cuda_array_interface__

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)

    def __repr__(self) -> str:
        state = "freed" if not self._live else f"{self._views} views" if self._views else "live"
        return (f"<pykvalloc.Allocation {format_size(self._size)} at {self._address:#x} "
                f"(offset {self.offset}) {state}>")


class _Allocator(HandleOwner):
    """What Pool and VarPool share: handing out ``Allocation`` handles and taking them back.

    Every handle is checked here (its owner, freed or not, numpy views alive) before its address
    reaches C, where a stale address may name a newer allocation's memory. A subclass provides
    ``base``, its C free and usable-size functions (``_c_free``, ``_c_usable_size``) and
    ``_mapping``: the Pool whose memory its allocations are in. Every view is a user of the
    allocator that handed its allocation out.
    """

    __slots__ = ("_c_free", "_c_usable_size")

    _c_free: Callable[[int, int | None], int]
    _c_usable_size: Callable[[int, int | None], int]

    @property
    @abstractmethod
    def _mapping(self) -> Pool: ...

    @property
    @abstractmethod
    def base(self) -> int: ...

    def _owned_live(self, allocation: Allocation,
                    freed_error: type[KvallocError] = AllocationFreedError) -> None:
        if not isinstance(allocation, Allocation):
            raise TypeError(f"expected an Allocation, not {type(allocation).__name__}")
        if allocation._pool is not self:
            raise InvalidPointer(f"{allocation!r} belongs to {allocation._pool!r}, not {self!r}")
        if not allocation._live:
            raise freed_error(f"{allocation!r} was already freed")

    def _allocate(self, function: Callable[..., int], nbytes: int, *arguments: int) -> Allocation:
        out = c_void_p()
        with self._lock:
            function(self._open_handle(), nbytes, *arguments, byref(out))
        return Allocation(self, _returned_address(out, function.__name__), nbytes,
                          _ALLOCATION_KEY)

    def free(self, allocation: Allocation) -> None:
        """Returns the allocation's memory to the pool.

        DoubleFree if it was already freed, InvalidPointer if it belongs to another pool,
        AllocationInUseError while numpy views or tensors of it are alive: in each case nothing reaches C
        and nothing changes. In a checked Pool, CorruptionError if a red zone around it was
        overwritten: the memory is freed all the same, and so is the allocation.
        """
        with self._lock:
            handle = self._open_handle()
            if not (isinstance(allocation, Allocation) and allocation._pool is self
                    and allocation._live and not allocation._views):
                self._refuse_free(allocation)
            try:
                self._c_free(handle, allocation._address)
            except CorruptionError:
                allocation._live = False  # freed in C: the address may be the next one's
                raise
            allocation._live = False

    def _refuse_free(self, allocation: Allocation) -> None:
        """Raises what ``free`` found wrong with the allocation (the fast path tells only that
        something is), unless all it found were views that are gone now."""
        self._owned_live(allocation, freed_error=DoubleFree)
        _dlpack.sweep()  # a capsule nobody took holds its allocation until it is seen
        if allocation._views:
            raise AllocationInUseError(
                f"{allocation!r} still has {allocation._views} numpy view(s) or tensor(s) alive "
                "(DLPack exports and the arrays made from them count); delete them before "
                "freeing it")

    def usable_size(self, allocation: Allocation) -> int:
        """Bytes the allocation may really use: in a Pool its size class or buddy block size,
        in a VarPool its size rounded up to the alignment."""
        with self._lock:
            handle = self._open_handle()
            self._owned_live(allocation)
            return int(self._c_usable_size(handle, allocation._address))

    def _tensor(self, allocation: Allocation, dtype: object,
                shape: int | Sequence[int] | None, strides: Sequence[int] | None) -> Tensor:
        element = tensor_dtype(dtype)
        dims = (allocation._size // element.itemsize,) if shape is None else shape_arg(shape)
        if strides is None:
            steps = contiguous_strides(dims)
        else:
            steps = tuple(_strides_arg(strides))
            if len(steps) != len(dims):
                raise InvalidArgument(f"strides {steps} do not match shape {dims}")
        span = extent(dims, steps, element.itemsize)
        device = self._mapping._dl_device
        with self._lock:
            self._open_handle()
            self._owned_live(allocation)
            if span > allocation._size:
                raise InvalidArgument(f"shape {dims} with strides {steps} of {element.name} "
                                      f"spans {span} bytes; {allocation!r} has "
                                      f"{allocation._size}")
            # A user of this allocator, as a view is (_view): the memory stays while it lives.
            return Tensor._new(allocation._address, dims, steps, element, device,
                               lambda: self._add_user(allocation),
                               lambda: self._user_gone(allocation))

    def _view(self, allocation: Allocation, dtype: npt.DTypeLike,
              shape: int | Sequence[int] | None) -> npt.NDArray[Any]:
        mapping = self._mapping
        if mapping._backend is Backend.CUDA:
            raise InvalidArgument(
                f"{allocation!r} is GPU memory (a backend='cuda' pool), which the CPU cannot "
                "access: copy it with the CUDA API, or wrap the address in a GPU array")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise InvalidArgument(f"dtype {dt} holds Python objects; a view over raw memory "
                                  "cannot")
        if dt.itemsize == 0:
            raise InvalidArgument(f"dtype {dt} has no size")
        dims = (allocation._size // dt.itemsize,) if shape is None else _shape_arg(shape)
        nbytes = math.prod(dims) * dt.itemsize
        if dt.subdtype is not None:
            # numpy turns a subarray dtype into trailing dimensions; say so up front.
            dt, dims = dt.base, dims + dt.shape
        with self._lock:
            self._open_handle()
            self._owned_live(allocation)
            if nbytes > allocation._size:
                raise InvalidArgument(f"shape {dims} of {dt} needs {nbytes} bytes; "
                                      f"{allocation!r} has {allocation._size}")
            # The anchor holds this pool, and the view is a user of it: a close destroys the C
            # object only once the view is garbage. For a Pool that keeps the memory mapped;
            # for a VarPool it keeps its range from going back to its mapping (kva_var_destroy
            # frees it there, where the next allocation would get the viewed memory), and the
            # VarPool, a user of its mapping until then, keeps that mapped.
            anchor = ArrayAnchor(self, allocation._address, nbytes)
            released = weakref.finalize(anchor, self._user_gone, allocation)
            released.atexit = False  # at exit the views die with the process, not before it
            self._add_user(allocation)
        return np.asarray(anchor).view(dt).reshape(dims)


class Pool(_Allocator):
    """One region of memory managed by libkvalloc.

    ``capacity`` is the number of bytes to manage. ``min_block`` (smallest buddy block, a power
    of two, default 4 KiB), ``slab_chunk`` (bytes of one slab; default automatic: 2 MiB, less in pools under 64 MiB) and ``pages``
    (``"auto"``, ``"hugetlb"``, ``"thp"`` or ``"small"``) are passed to the library, which
    validates them and raises ``InvalidArgument`` with its reason. ``name`` labels the pool
    (``[A-Za-z0-9_.-]``, at most 63 bytes); ``prefault`` takes every page fault up front.
    A named pool publishes live statistics in shared memory for ``kvalloc top``:
    ``publish_interval_ms`` bounds the time between publishes (library default 200) and
    ``trace`` records the timing of every call in the segment's trace ring.

    Backing memory. ``backend="host"`` (the default) maps host memory; ``hugepages`` is another
    way to say ``pages`` (True: huge pages when the machine has them, False: normal pages only),
    ``numa_node`` binds the memory to a NUMA node (``numa_policy`` ``"bind"`` or
    ``"preferred"``), ``lock`` mlocks it and ``pin`` registers it with the CUDA driver as
    page-locked memory for fast copies to GPU ``device`` (an offload tier). ``backend="cuda"``
    manages the memory of GPU ``device`` through the CUDA driver, loaded at run time (no CUDA
    is needed to install pykvalloc): addresses are device addresses, mapped on demand;
    ``trim()`` unmaps what no allocation uses, and so does a free that leaves more than
    ``trim_watermark`` bytes mapped but unused; ``prefault`` maps everything at creation.
    No driver or no GPU raises ``BackendError`` saying which. ``checked`` (host, for
    debugging) poisons free memory and puts red zones around allocations: a write after free or
    past an allocation's ends raises ``CorruptionError`` (kvalloc.h, kva_config.checked).
    ``arenas`` sets the number of per-CPU arenas (0, the default: one per CPU).

    Memory you already own. ``external`` (an address) makes the pool manage the ``capacity``
    bytes there instead of mapping its own: host memory, or device memory with
    ``backend="cuda"``. The library never maps, frees, binds, locks or writes that range, so it
    must outlive the pool: pass the object that owns it as ``owner`` and the pool keeps it alive
    (``Pool.over`` does this for a numpy array, a CUDA array or a writable buffer). The base must
    be a multiple of 64 KiB (and of the slab chunk), the length a multiple of the page size, the
    largest block is the largest power of two dividing the base, ``pages``, ``prefault``,
    ``lock``, ``pin``, ``numa_node``, ``trim_watermark``, ``checked`` and ``shared`` do not
    apply, and two live pools of a process never share a byte (kvalloc.h, kva_config.external).

    Memory shared with other processes. ``shared=True`` puts a host pool in a shared memory
    object (a sealed memfd) with the same page, NUMA, prefault and lock choices;
    ``shared_fd()`` returns a descriptor another process passes to ``SharedMapping`` to map the
    same memory at its own address. This process alone allocates; the others read and write the
    blocks it tells them about, by offset. A child forked from this process inherits a copy of
    the pool over the same bytes: there every allocation and free (and every change to a
    ``KVCache`` or ``VarPool`` over it) raises ``BackendError``; it maps the memory with
    ``SharedMapping`` instead.

    Use it as a context manager or call ``close()``; see the module docstring for what happens
    to views that outlive the pool.
    """

    __slots__ = ("_lib", "_base", "_capacity", "_min_block", "_slab_chunk", "_name", "_backend",
                 "_dl_device", "_owner")

    _fork_rank = 1

    def __init__(self, capacity: int, *, min_block: int | None = None,
                 slab_chunk: int | None = None, name: str | None = None,
                 pages: str | PageMode | None = None, prefault: bool = False, trace: bool = False,
                 publish_interval_ms: int | None = None, backend: str | Backend = "host",
                 device: int = 0, numa_node: int | None = None,
                 numa_policy: str | NumaPolicy = "bind",
                 hugepages: bool | str | PageMode | None = None, lock: bool = False,
                 pin: bool = False, trim_watermark: int = 0, checked: bool = False,
                 arenas: int = 0, external: int | None = None, owner: object = None,
                 shared: bool = False) -> None:
        if external is not None:
            external = _size_arg("external", external)
            if external == 0:
                raise InvalidArgument("external address 0 is NULL: a range the caller owns "
                                      "has a real address")
        elif owner is not None:
            raise InvalidArgument("owner keeps external memory alive; this pool has none")
        lib = _ffi.load()
        config = _ffi.KvaConfig()
        lib.kva_config_init(byref(config))
        config.capacity = _size_arg("capacity", capacity)
        if min_block is not None:
            config.min_block = _size_arg("min_block", min_block)
        if slab_chunk is not None:
            config.slab_chunk = _size_arg("slab_chunk", slab_chunk)
        config.name = _name_arg(name)
        config.pages = _pages_arg(pages, hugepages)
        config.prefault = 1 if prefault else 0
        config.backend = _enum_arg("backend", backend, Backend)
        config.device = _int_arg("device", device, 0)
        config.numa_node = -1 if numa_node is None else _int_arg("numa_node", numa_node, 0)
        config.numa_policy = _enum_arg("numa_policy", numa_policy, NumaPolicy)
        config.lock = 1 if lock else 0
        config.pin = 1 if pin else 0
        config.trim_watermark = _size_arg("trim_watermark", trim_watermark)
        config.checked = 1 if checked else 0
        config.arenas = _int_arg("arenas", arenas, 0)
        config.external = external
        config.shared = 1 if shared else 0
        config.trace = 1 if trace else 0
        if publish_interval_ms is not None:
            interval = _size_arg("publish_interval_ms", publish_interval_ms)
            if interval > 0xFFFFFFFF:  # an unsigned int in C
                raise InvalidArgument(f"publish_interval_ms {interval} does not fit 32 bits")
            config.publish_interval_ms = interval

        handle = c_void_p()
        lib.kva_pool_create(byref(config), byref(handle))
        self._own(_returned_address(handle, "kva_pool_create"), lib.kva_pool_destroy)
        # Held for the pool's whole life, views included: the memory is the owner's.
        self._owner = owner
        self._lib = lib
        self._c_free = lib.kva_free
        self._c_usable_size = lib.kva_usable_size
        self._name = name

        base = c_void_p()
        lib.kva_pool_base(self._handle, byref(base))
        self._base = _returned_address(base, "kva_pool_base")
        stats = self.stats()
        self._capacity = stats.capacity
        self._min_block = stats.min_block
        self._slab_chunk = stats.slab_chunk
        self._backend = stats.backend
        # The DLPack device of its memory (pykvalloc.tensor): pinned memory is registered
        # portable (every context may use it), hence device 0.
        self._dl_device = ((DEVICE_CUDA, config.device) if stats.backend is Backend.CUDA else
                           (DEVICE_CUDA_HOST, 0) if stats.pinned else (DEVICE_CPU, 0))
        _open_pools.add(self)

    @classmethod
    def over(cls, memory: object, *, device: int = 0, **options: Any) -> Pool:
        """A pool over memory the caller already owns, kept alive by the pool: a numpy array
        (``__array_interface__``), a CUDA array such as a torch CUDA tensor
        (``__cuda_array_interface__``: a ``backend="cuda"`` pool on ``device``) or a writable
        buffer (``mmap.mmap``, ``bytearray``; the pool holds an export of it, so an mmap cannot
        be closed under the pool). The memory must be contiguous and writable; the rules of
        ``external`` apply to its address and length. ``options`` are Pool's other keywords
        (``min_block``, ``slab_chunk``, ``name``, ``arenas``, ...)."""
        address, length, backend, keeper = _external_memory(memory)
        return cls(length, external=address, owner=keeper, backend=backend, device=device,
                   **options)

    def shared_fd(self) -> int:
        """A new descriptor of a ``shared=True`` pool's memory for another process (send it
        with ``socket.send_fds`` or let a child inherit it with ``pass_fds``); the caller
        closes it. The memory object is sealed: no holder can shrink or grow it.
        InvalidArgument for a pool that is not shared."""
        fd = c_int(-1)
        with self._lock:
            self._lib.kva_pool_shared_fd(self._open_handle(), byref(fd))
        return fd.value

    @property
    def _mapping(self) -> Pool:
        return self

    # -- allocation -------------------------------------------------------------------------

    def alloc(self, size: int) -> Allocation:
        """Allocates ``size`` bytes. OutOfMemory when no free range fits now; InvalidArgument
        for 0 or for more than the pool can ever hold."""
        return self._allocate(self._lib.kva_alloc, _size_arg("size", size))

    def alloc_aligned(self, size: int, alignment: int) -> Allocation:
        """As ``alloc``, with the address a multiple of ``alignment``, a power of two."""
        return self._allocate(self._lib.kva_alloc_aligned, _size_arg("size", size),
                              _size_arg("alignment", alignment))

    def alloc_exact(self, size: int) -> Allocation:
        """A contiguous range of ``size`` bytes rounded up only to ``min_block``, not to a
        power of two: for large regions such as one layer of a KV cache. The unused tail of the
        buddy block is free at once; the start is aligned to the power of two above ``size``."""
        return self._allocate(self._lib.kva_alloc_exact, _size_arg("size", size))

    def alloc_array(self, count: int, size: int) -> Allocation:
        """``count`` elements of ``size`` bytes (not zeroed): InvalidArgument when the product
        overflows a size, as the C library checks it."""
        count, size = _size_arg("count", count), _size_arg("size", size)
        out = c_void_p()
        with self._lock:
            self._lib.kva_alloc_array(self._open_handle(), count, size, byref(out))
        return Allocation(self, _returned_address(out, "kva_alloc_array"), count * size,
                          _ALLOCATION_KEY)

    # -- maintenance and introspection ------------------------------------------------------

    def trim(self) -> None:
        """Returns every empty slab to the buddy allocator; in a CUDA pool, then unmaps the
        device memory no allocation uses."""
        with self._lock:
            self._lib.kva_trim(self._open_handle())

    def thread_flush(self) -> None:
        """Returns the calling thread's cached free objects to the pool's arenas (a thread's
        exit does this by itself)."""
        with self._lock:
            self._lib.kva_thread_flush(self._open_handle())

    def check(self) -> None:
        """Verifies every invariant of the pool's metadata; CorruptionError names the first
        broken one. Its cost grows with the pool."""
        with self._lock:
            self._lib.kva_check(self._open_handle())

    def stats(self) -> Stats:
        raw = _ffi.KvaStats()
        with self._lock:
            self._lib.kva_get_stats(self._open_handle(), byref(raw))
        return Stats._from_c(raw)

    def reset_peaks(self) -> None:
        """Starts the peaks of ``stats()`` afresh from the figures as they stand (torch's
        ``reset_peak_memory_stats``)."""
        with self._lock:
            self._lib.kva_reset_peaks(self._open_handle())

    def publish(self) -> None:
        """Copies the pool's state into its statistics segment now (a named pool; an anonymous
        one has no segment and nothing happens). The library also publishes on its own, at most
        ``publish_interval_ms`` apart, from the calls that leave the fast paths."""
        with self._lock:
            self._lib.kva_stats_publish(self._open_handle())

    @property
    def segment_name(self) -> str | None:
        """The POSIX shared-memory name of the statistics segment (``/kvalloc.<pid>.<name>``;
        the file is ``/dev/shm`` + this name), None for an anonymous pool."""
        with self._lock:
            name = self._lib.kva_stats_segment_name(self._open_handle())
        return None if name is None else name.decode()

    def class_stats(self) -> list[ClassStats]:
        """Figures of every slab size class, smallest first."""
        raw = _ffi.KvaClassStats()
        result = []
        with self._lock:
            handle = self._open_handle()
            for index in range(_ffi.KVA_NUM_SIZE_CLASSES):
                self._lib.kva_get_class_stats(handle, index, byref(raw))
                result.append(ClassStats(index, raw.object_size, raw.objects_per_slab,
                                         raw.live_objects, raw.slabs))
        return result

    def walk(self) -> Iterator[HeapRegion]:
        """Every live allocation and every free range, in address order.

        The whole walk is taken under the pool's lock before the first region is yielded, so
        the regions are one consistent snapshot however slowly they are consumed.
        """
        regions: list[HeapRegion] = []
        failure: list[BaseException] = []

        def visit(offset: int, size: int, kind: int, _ctx: int | None) -> int:
            # An exception must not escape into C (ctypes would print it and go on with the
            # walk, a region missing): stop the walk, raise it afterwards.
            try:
                regions.append(HeapRegion(offset, size, WalkKind(kind)))
                return 0
            except BaseException as exc:  # noqa: BLE001 - re-raised after the walk
                failure.append(exc)
                return 1

        callback = _ffi.WALK_FN(visit)
        with self._lock:
            self._lib.kva_walk(self._open_handle(), callback, None)
        if failure:
            if isinstance(failure[0], ValueError):  # a region kind this package does not know
                raise KvallocError(f"heap walk stopped: {failure[0]}") from failure[0]
            raise failure[0]
        return iter(regions)

    # -- properties -------------------------------------------------------------------------

    @property
    def base(self) -> int:
        """Address of offset 0 of the managed region."""
        return self._base

    @property
    def capacity(self) -> int:
        """Bytes managed: the requested capacity rounded down to ``min_block``."""
        return self._capacity

    @property
    def min_block(self) -> int:
        return self._min_block

    @property
    def slab_chunk(self) -> int:
        return self._slab_chunk

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def backend(self) -> Backend:
        """Where the memory lives; with ``Backend.CUDA`` addresses are device addresses."""
        return self._backend

    def _describe(self) -> str:
        label = f"{self._name!r} " if self._name else ""
        return f"{label}{format_size(self._capacity)} at {self._base:#x}"


class PoolOptions(TypedDict, total=False):
    """The keywords of ``Pool`` after ``capacity``: what a class that makes a pool for itself
    passes on (``VarPool(capacity, **pool_options)``)."""

    min_block: int | None
    slab_chunk: int | None
    name: str | None
    pages: str | PageMode | None
    prefault: bool
    trace: bool
    publish_interval_ms: int | None
    backend: str | Backend
    device: int
    numa_node: int | None
    numa_policy: str | NumaPolicy
    hugepages: bool | str | PageMode | None
    lock: bool
    pin: bool
    trim_watermark: int
    checked: bool
    arenas: int


# Every pool, for the exit hook; weak so that it never keeps a pool alive.
_open_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _close_idle_pools() -> None:
    """At exit, releases every pool no numpy view, KV cache or VarPool still uses; the rest the
    OS reclaims."""
    for pool in list(_open_pools):
        if pool._users == 0:
            pool.close()
